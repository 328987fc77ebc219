// The AVX-512 VNNI path (Ice Lake and later Intel, Zen 4 and later AMD). Compiled with
// function-level target attributes, so this file builds with the default flags and runs only
// where the dispatcher found the instructions.
#include "qgemm.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#define PYSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

namespace pyserve_kernels {
namespace {

constexpr int kPanelRows = 8;  // rows a panel of activations interleaves (qgemm.h)
constexpr int kMaxRows = 16;   // rows a pass over the tiles computes: two panels
constexpr int kChainsOfOneRow = 4;
// How far ahead of a group the loop asks for its weights: the hardware prefetchers alone left
// a 1-row decode short of the memory's bandwidth.
constexpr size_t kPrefetchBytes = 1024;

// The first n lanes (all 16 from n = 16 on, none for n <= 0).
inline __mmask16 first_lanes(int n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff)
                 : static_cast<__mmask16>((1u << std::max(n, 0)) - 1);
}

// out[g] = op over the 16 lanes of v[g], for 16 vectors at once: four levels of shuffles that
// pair halves, then quads, then lanes, ~3 instructions a vector against ~8 for a reduction each.
template <class Op>
PYSERVE_AVX512 inline __m512 reduce16(const __m512 (&v)[16], Op op) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // [a's 8 partials, b's 8]
    w[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // quad q: 4 partials of group 4i + q
    x[i] = op(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // quad q: 2 partials of group 8i + q, then 2 of 8i + 4 + q
    y[i] = op(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4q + j: group 4j + q; put group g in lane g
  const __m512 z = op(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

struct MaxPs {
  PYSERVE_AVX512 __m512 operator()(__m512 a, __m512 b) const { return _mm512_max_ps(a, b); }
};
struct AddEpi32 {  // int32 lanes carried in float registers
  PYSERVE_AVX512 __m512 operator()(__m512 a, __m512 b) const {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
};

// qgemm.h's row_scales, 16 groups a vector, with the same integer and float operations.
PYSERVE_AVX512 void row_scales_avx512(const float* amax, int groups, int bits, int headroom,
                                      float* scale, int32_t* shift, float* inverse, float* unit) {
  auto live = [groups](int g) { return first_lanes(groups - g); };
  if (bits == 8) {  // float scales, unit 1
    const __m512 top = _mm512_set1_ps(127.0f);
    for (int g = 0; g < groups; g += 16) {
      const __m512 a = _mm512_maskz_loadu_ps(live(g), amax + g);
      const __mmask16 positive = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ);
      _mm512_mask_storeu_ps(scale + g, live(g), _mm512_div_ps(a, top));
      _mm512_mask_storeu_ps(inverse + g, live(g), _mm512_maskz_div_ps(positive, top, a));
      _mm512_mask_storeu_epi32(shift + g, live(g), _mm512_setzero_si512());
    }
    *unit = 1.0f;
    return;
  }
  const float top = 32767.0f;
  uint32_t top_bits;
  std::memcpy(&top_bits, &top, sizeof top_bits);
  const __m512i mantissa = _mm512_set1_epi32((1 << 23) - 1);
  const __m512i top_mantissa = _mm512_set1_epi32(static_cast<int>(top_bits & ((1u << 23) - 1)));
  const __m512i top_exponent = _mm512_set1_epi32(static_cast<int>(top_bits >> 23));
  const __m512i lowest = _mm512_set1_epi32(kMinExponent);
  __m512i largest = lowest;
  __mmask16 finite = 0xffff;
  for (int g = 0; g < groups; g += 16) {  // group_exponent, then the row's largest
    const __m512 a = _mm512_maskz_loadu_ps(live(g), amax + g);
    const __m512i ai = _mm512_castps_si512(a);
    // ordered: false for NaN and ±inf (and true for the zeros loaded past the last group)
    const __mmask16 finite_here =
        _mm512_cmp_ps_mask(a, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_LE_OQ);
    const __mmask16 normal =
        _mm512_cmp_ps_mask(a, _mm512_set1_ps(std::numeric_limits<float>::min()), _CMP_GE_OQ) &
        finite_here;
    const __mmask16 rounds_up =
        _mm512_cmpgt_epi32_mask(_mm512_and_si512(ai, mantissa), top_mantissa);
    __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(ai, 23), top_exponent);
    e = _mm512_mask_add_epi32(e, rounds_up, e, _mm512_set1_epi32(1));
    e = _mm512_mask_max_epi32(lowest, normal, e, lowest);
    _mm512_mask_storeu_epi32(shift + g, live(g), e);
    largest = _mm512_mask_max_epi32(largest, live(g), largest, e);
    finite &= finite_here;
  }
  const int exponent = _mm512_reduce_max_epi32(largest) - headroom;
  const __m512i base = _mm512_set1_epi32(exponent);
  for (int g = 0; g < groups; g += 16) {
    const __m512i e = _mm512_maskz_loadu_epi32(live(g), shift + g);
    const __m512i s = _mm512_sub_epi32(_mm512_max_epi32(e, base), base);
    _mm512_mask_storeu_epi32(shift + g, live(g), s);
    const __m512i bias = _mm512_set1_epi32(127);  // power_of_two: (e + 127) << 23
    _mm512_mask_storeu_ps(scale + g, live(g),
                          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(s, bias), 23)));
    const __m512i minus = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_add_epi32(base, s));
    _mm512_mask_storeu_ps(
        inverse + g, live(g),
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(minus, bias), 23)));
  }
  *unit = finite == 0xffff ? power_of_two(exponent) : std::numeric_limits<float>::quiet_NaN();
}

template <class Q>
PYSERVE_AVX512 void quantize_rows_as(const float* x, int64_t x_stride, int rows, int k, int group,
                                     int headroom, Q* q, float* scale, int32_t* shift,
                                     float* unit_sum, int32_t* sum, float* unit) {
  constexpr int top = sizeof(Q) == 2 ? 32767 : 127;
  const int groups = (k + group - 1) / group;
  const int k_padded = groups * group;
  // one row at a time into these, then into its panel (see qgemm.h)
  thread_local std::vector<float> amax, inverse, row_scale, row_unit_sum;
  thread_local std::vector<int32_t> row_shift, row_sum, row_q;
  for (auto* v : {&amax, &inverse, &row_scale, &row_unit_sum}) v->resize(groups);
  for (auto* v : {&row_shift, &row_sum}) v->resize(groups);
  const int64_t words = static_cast<int64_t>(k_padded) * sizeof(Q) / 4;  // 4 bytes of q each
  row_q.resize(static_cast<size_t>(words));
  // plain pointers: each read of a thread_local inside the loops was a __tls_get_addr call
  float* const most_of = amax.data();
  float* const times_of = inverse.data();
  float* const scale_of = row_scale.data();
  float* const unit_sum_of = row_unit_sum.data();
  int32_t* const shift_of = row_shift.data();
  int32_t* const sum_of = row_sum.data();
  int32_t* const words_of = row_q.data();
  auto live_inputs = [k](int i) { return first_lanes(k - i); };
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    Q* qr = reinterpret_cast<Q*>(words_of);
    for (int g0 = 0; g0 < groups; g0 += 16) {  // each group's largest magnitude
      __m512 vmax[16];
      __mmask16 nan_groups = 0;  // vmaxps drops NaNs: they are looked for beside it
      for (int j = 0; j < 16; ++j) {
        vmax[j] = _mm512_setzero_ps();
        const int g = g0 + j;
        if (g >= groups) continue;
        __mmask16 nan = 0;
        for (int i = g * group; i < std::min(k, (g + 1) * group); i += 16) {
          const __m512 v = _mm512_maskz_loadu_ps(live_inputs(i), xr + i);
          vmax[j] = _mm512_max_ps(vmax[j], _mm512_abs_ps(v));
          nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
        if (nan) nan_groups |= static_cast<__mmask16>(1u << j);
      }
      const __m512 most =
          _mm512_mask_blend_ps(nan_groups, reduce16(vmax, MaxPs{}),
                               _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
      _mm512_mask_storeu_ps(most_of + g0, first_lanes(groups - g0), most);
    }
    row_scales_avx512(most_of, groups, 8 * sizeof(Q), headroom, scale_of, shift_of, times_of,
                      unit + r);
    for (int g0 = 0; g0 < groups; g0 += 16) {
      __m512 totals[16];
      for (int j = 0; j < 16; ++j) {
        const int g = g0 + j;
        __m512i total = _mm512_setzero_si512();
        if (g < groups) {
          const __m512 times = _mm512_set1_ps(times_of[g]);
          for (int i = g * group; i < (g + 1) * group; i += 16) {
            // round to nearest even (the default MXCSR mode), as std::nearbyint does in the
            // scalar path
            __m512i qi = _mm512_cvtps_epi32(
                _mm512_mul_ps(_mm512_maskz_loadu_ps(live_inputs(i), xr + i), times));
            qi = _mm512_max_epi32(_mm512_min_epi32(qi, _mm512_set1_epi32(top)),
                                  _mm512_set1_epi32(-top));
            total = _mm512_add_epi32(total, qi);
            if constexpr (sizeof(Q) == 1)
              _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + i), _mm512_cvtsepi32_epi8(qi));
            else
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + i), _mm512_cvtsepi32_epi16(qi));
          }
        }
        totals[j] = _mm512_castsi512_ps(total);
      }
      const __m512i sums = _mm512_castps_si512(reduce16(totals, AddEpi32{}));
      const __mmask16 live = first_lanes(groups - g0);
      _mm512_mask_storeu_epi32(sum_of + g0, live, sums);
      _mm512_mask_storeu_ps(
          unit_sum_of + g0, live,
          _mm512_mul_ps(_mm512_maskz_loadu_ps(live, scale_of + g0), _mm512_cvtepi32_ps(sums)));
    }
    // into the row's panel (qgemm.h)
    auto* const panels = static_cast<int32_t*>(static_cast<void*>(q));
    for (int64_t j = 0; j < words; ++j) panels[panel_index(r, j, words, kPanelRows)] = words_of[j];
    for (int g = 0; g < groups; ++g) {
      const int64_t at = panel_index(r, g, groups, kPanelRows);
      scale[at] = scale_of[g];
      shift[at] = shift_of[g];
      unit_sum[at] = unit_sum_of[g];
      sum[at] = sum_of[g];
    }
  }
}

void quantize_rows_avx512(const float* x, int64_t x_stride, int rows, int k, int group, int bits,
                          int headroom, void* q, float* scale, int32_t* shift, float* unit_sum,
                          int32_t* sum, float* unit) {
  if (bits == 16)
    quantize_rows_as(x, x_stride, rows, k, group, headroom, static_cast<int16_t*>(q), scale, shift,
                     unit_sum, sum, unit);
  else
    quantize_rows_as(x, x_stride, rows, k, group, headroom, static_cast<int8_t*>(q), scale, shift,
                     unit_sum, sum, unit);
}

// vpshufb patterns that widen the bytes (k0, k1) or (k2, k3) of every 32-bit lane to words.
constexpr int widen_pattern(int lane, int first) {
  const unsigned low = static_cast<unsigned>(4 * lane + first);  // bytes: low, zero, low+1, zero
  return static_cast<int>(low | 0x8000u | (low + 1) << 16 | 0x80000000u);
}

// The vpshufb pattern that widens bytes (k_first, k_first + 1) of every 32-bit lane to words.
PYSERVE_AVX512 inline __m512i widen_lanes(int first) {
  return _mm512_set4_epi32(widen_pattern(3, first), widen_pattern(2, first),
                           widen_pattern(1, first), widen_pattern(0, first));
}

// dot += u · the 32-bit word at p in every lane, the broadcast folded into the instruction: GCC
// loads it with a vpbroadcastd of its own, one more instruction each, and the pass was bound by
// how many instructions a cycle the core takes in.
PYSERVE_AVX512 inline __m512i dpwssd_word(__m512i dot, __m512i u, const int32_t* p) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(dot) : "v"(u), "m"(*p));
  return dot;
}
PYSERVE_AVX512 inline __m512i dpbusd_word(__m512i dot, __m512i u, const int32_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(dot) : "v"(u), "m"(*p));
  return dot;
}

// 16 unsigned bytes as floats (a super-block group's sc or mn, qgemm.h).
PYSERVE_AVX512 inline __m512 byte_floats(const uint8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

constexpr int kOr = 0xEA;  // vpternlogd: (a & b) | c

// Bit j of every byte of a 5-bit block's high plane (qgemm.h) moved to bit 4, the rest zero.
PYSERVE_AVX512 inline __m512i high_bit(__m512i plane, int j) {
  const __m512i moved = j <= 4 ? _mm512_sll_epi16(plane, _mm_cvtsi32_si128(4 - j))
                               : _mm512_srl_epi16(plane, _mm_cvtsi32_si128(j - 4));
  return _mm512_and_si512(moved, _mm512_set1_epi8(0x10));
}

// Asks for the `bytes` of weights kPrefetchBytes past `at`.
inline void prefetch_ahead(const uint8_t* at, size_t bytes) {
  for (size_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchBytes + line), _MM_HINT_T0);
}

// Independent integer sums a row keeps per group: vpdpwssd / vpdpbusd take ~5 cycles, so with
// few rows one chain of them a group waits on itself; the chains are added up at the group's end
// (integers: the same sum whatever the order).
template <int R>
constexpr int chains() {
  return R >= 8 ? 1 : R >= 4 ? 2 : R == 3 ? 3 : kChainsOfOneRow / R;
}

// dot[0..R) += dot[c·R..(c + 1)·R) for the other chains c.
template <int R, int C>
PYSERVE_AVX512 inline void fold_chains(__m512i* dot) {
  for (int c = 1; c < C; ++c)
    for (int r = 0; r < R; ++r) dot[r] = _mm512_add_epi32(dot[r], dot[c * R + r]);
}

// Adds one quad (16 rows × 4 inputs, unsigned bytes u) times the R rows' words at `at` (their
// panels `panel_words` apart); int16 words widen u with the two vpshufb patterns.
template <int R, class Q>
PYSERVE_AVX512 inline void add_quad(__m512i* dot, __m512i u, const int32_t* at, int64_t panel_words,
                                    __m512i low_pairs, __m512i high_pairs) {
  constexpr int P = kPanelRows;
  const int32_t* const panel[2] = {at, at + panel_words};
  if constexpr (sizeof(Q) == 1) {
    for (int r = 0; r < R; ++r) dot[r] = dpbusd_word(dot[r], u, &panel[r / P][r % P]);
  } else {
    const __m512i low = _mm512_shuffle_epi8(u, low_pairs);
    const __m512i high = _mm512_shuffle_epi8(u, high_pairs);
    for (int r = 0; r < R; ++r) {
      dot[r] = dpwssd_word(dot[r], low, &panel[r / P][r % P]);
      dot[r] = dpwssd_word(dot[r], high, &panel[r / P][P + r % P]);
    }
  }
}

// sum + d·(a group's integer dot in its row's unit): int16 shifts it by the cell's e − U, int8
// multiplies it by the cell's scale (qgemm.h).
template <class Q>
PYSERVE_AVX512 inline __m512 add_scaled(__m512 sum, __m512i dot, __m512 d, const int32_t* shift,
                                        const float* scale) {
  if constexpr (sizeof(Q) == 2) {
    const __m512i shifted = _mm512_sllv_epi32(dot, _mm512_set1_epi32(*shift));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(shifted), d, sum);
  } else {
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(*scale)), d, sum);
  }
}

// Tile t's outputs of rows row0.. row0 + R − 1: acc times the row's unit, plus the bias.
template <int R>
PYSERVE_AVX512 inline void store_tile(const float (&acc)[R][kTileRows], const PackedWeights& w,
                                      const QuantizedRows& a, int row0, int t, const float* bias,
                                      float* out, int64_t out_stride) {
  const __mmask16 live = first_lanes(w.n - t * kTileRows);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(live, bias + t * kTileRows) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    float* o = out + static_cast<int64_t>(row0 + r) * out_stride + t * kTileRows;
    _mm512_mask_storeu_ps(
        o, live, _mm512_fmadd_ps(_mm512_load_ps(acc[r]), _mm512_set1_ps(a.unit[row0 + r]), b));
  }
}

// The 6-bit (Q6_K) tiles of qgemm.h, R rows at a time as tiles_rows below: per 16 inputs the
// quads' low nibbles and high bit pairs are merged into bytes u (one vpternlogd each), and the
// rows' Σu·q, started at −32·Σq, is scaled by D·sc.
template <int R, class Q>
PYSERVE_AVX512 void q6_tiles_rows(const PackedWeights& w, const QuantizedRows& a, int row0,
                                  int tile0, int tile1, const float* bias, float* out,
                                  int64_t out_stride) {
  constexpr int P = kPanelRows;
  constexpr int kQuadWords = sizeof(Q) == 1 ? 1 : 2;  // words of q per 4 inputs
  constexpr int C = std::min(chains<R>(), 4);         // a half holds 4 quads
  const int groups = w.groups();
  const size_t group_bytes = w.group_bytes();
  const int halves = a.k_padded / 16;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  const __m512i pair_bits = _mm512_set1_epi8(0x30);
  const __m512i low_pairs = widen_lanes(0), high_pairs = widen_lanes(2);
  const int64_t panel_words = a.words() * P;
  const int32_t* const q0 = static_cast<const int32_t*>(a.q) + a.word_at(row0, 0);
  const int32_t* const shift0 = a.shift + a.cell_at(row0, 0);
  const float* const scale0 = a.scale + a.cell_at(row0, 0);
  const int32_t* const centre0 = a.centre + static_cast<int64_t>(row0) * halves;
  for (int t = tile0; t < tile1; ++t) {
    const uint8_t* block = w.data + static_cast<size_t>(t) * groups * group_bytes;
    alignas(64) float acc[R][kTileRows];
    for (int r = 0; r < R; ++r) _mm512_store_ps(acc[r], _mm512_setzero_ps());
    const int32_t* qa = q0;
    __m512 big_d = _mm512_setzero_ps();  // a super-block's
    for (int g = 0; g < groups; ++g) {
      const uint16_t* const from = q6_block_at(w, t, g);
      if (g % kSuperGroups == 0)
        big_d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from)));
      const int8_t* const sc = q6_sc_at(from, g);
      prefetch_ahead(block, group_bytes);
      for (int h = 0; h < 2; ++h) {  // inputs 16h..16h + 15: quads 4h..4h + 3
        __m512i dot[R * C];          // Σ(u − 32)·q: from −32·Σq
        for (int r = 0; r < R; ++r) dot[r] = _mm512_set1_epi32(centre0[r * halves + 2 * g + h]);
        for (int r = R; r < R * C; ++r) dot[r] = _mm512_setzero_si512();
        const __m512i pairs = _mm512_loadu_si512(block + 256 + 64 * h);
#pragma GCC unroll 2
        for (int p = 0; p < 2; ++p) {  // nibble block 2h + p: quads 4h + 2p (low), 4h + 2p + 1
          const __m512i packed = _mm512_loadu_si512(block + 64 * (2 * h + p));
          // quad j of the four: its pair at bits 2j, moved to bits 4 and 5
          const __m512i high0 =
              _mm512_and_si512(p == 0 ? _mm512_slli_epi16(pairs, 4) : pairs, pair_bits);
          const __m512i high1 = _mm512_and_si512(
              p == 0 ? _mm512_slli_epi16(pairs, 2) : _mm512_srli_epi16(pairs, 2), pair_bits);
          const int32_t* at = qa + (4 * h + 2 * p) * kQuadWords * P;
          add_quad<R, Q>(dot + (2 * p) % C * R,
                         _mm512_ternarylogic_epi32(packed, low_nibbles, high0, kOr), at,
                         panel_words, low_pairs, high_pairs);
          add_quad<R, Q>(
              dot + (2 * p + 1) % C * R,
              _mm512_ternarylogic_epi32(_mm512_srli_epi16(packed, 4), low_nibbles, high1, kOr),
              at + kQuadWords * P, panel_words, low_pairs, high_pairs);
        }
        fold_chains<R, C>(dot);
        const __m512 d = _mm512_mul_ps(
            big_d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + h * kTileRows)))));
        for (int r = 0; r < R; ++r) {  // in the row's unit (see qgemm.h)
          const int64_t cell = panel_index(r, g, groups, P);
          _mm512_store_ps(acc[r], add_scaled<Q>(_mm512_load_ps(acc[r]), dot[r], d, shift0 + cell,
                                                scale0 + cell));
        }
      }
      qa += 8 * kQuadWords * P;
      block += group_bytes;
    }
    store_tile<R>(acc, w, a, row0, t, bias, out, out_stride);
  }
}

// The 16 rows' 2^(e − 128) of an MXFP4 group's exponent bytes (qgemm.h's e8m0_half).
PYSERVE_AVX512 inline __m512 e8m0_halves(const uint8_t* exponents) {
  const __m512i e =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(exponents)));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
  const __mmask16 below = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(below, normal, small));
}

// R rows × one tile at a time: R int32 accumulators stay in registers while the tile's groups
// stream through once, the R float ones in L1. Up to 16 rows, two panels: vpdpwssd / vpdpbusd
// take ~6 cycles and two issue a cycle, so a tile needs ~12 independent sums in flight. MX: the
// nibbles are MXFP4 codes, looked up into u by one vpshufb each, the sums started at −12·Σq and
// scaled by the group's power of two (qgemm.h).
template <int R, int BITS, class Q, bool kGroupOf32, bool MX = false>
PYSERVE_AVX512 void tiles_rows(const PackedWeights& w, const QuantizedRows& a, int row0, int tile0,
                               int tile1, const float* bias, float* out, int64_t out_stride) {
  constexpr int P = kPanelRows;
  constexpr int kQuadWords = sizeof(Q) == 1 ? 1 : 2;      // words of q per 4 inputs
  constexpr int kBlockBytes = 32 * kTileRows * BITS / 8;  // 32 inputs of a tile
  const int groups = w.groups();
  const bool super_scales = w.super_scales;
  // a tile's super-block scales (qgemm.h), where the weight has them
  const size_t super_tile_halves = static_cast<size_t>(groups / kSuperGroups) * kSuperScaleHalves;
  const int blocks = kGroupOf32 ? 1 : w.group / 32;
  const size_t group_bytes = w.group_bytes();
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  const __m512i low_pairs = widen_lanes(0), high_pairs = widen_lanes(2);
  // the rows' one or two panels (row0 is a panel's first row): row r of them at r = 0..R−1
  const int64_t panel_words = a.words() * P;
  const int32_t* const q0 = static_cast<const int32_t*>(a.q) + a.word_at(row0, 0);
  const int32_t* const shift0 = a.shift + a.cell_at(row0, 0);
  const float* const scale0 = a.scale + a.cell_at(row0, 0);
  const float* const unit_sum0 = a.unit_sum + a.cell_at(row0, 0);
  const int32_t* const sum0 = a.sum + a.cell_at(row0, 0);
  // MXFP4's code → u table, in each 128-bit lane for vpshufb
  const __m512i codes = _mm512_broadcast_i32x4(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const void*>(kMxfp4Codes))));
  constexpr int C = chains<R>();
  // quad j of a group into chain j % C
  auto add = [&](__m512i* dot, int j, __m512i u, const int32_t* at) PYSERVE_AVX512 {
    add_quad<R, Q>(dot + j % C * R, u, at, panel_words, low_pairs, high_pairs);
  };
  for (int t = tile0; t < tile1; ++t) {
    const uint8_t* block = w.data + static_cast<size_t>(t) * groups * group_bytes;
    const uint16_t* sc = w.scales + static_cast<size_t>(t) * groups * 2 * kTileRows;
    alignas(64) float acc[R][kTileRows];
    for (int r = 0; r < R; ++r) _mm512_store_ps(acc[r], _mm512_setzero_ps());
    const int32_t* qa = q0;
    __m512 big_d = _mm512_setzero_ps(), neg_dmin = _mm512_setzero_ps();  // a super-block's
    for (int g = 0; g < groups; ++g) {
      __m512i dot[R * C];
      for (int r = 0; r < R * C; ++r) dot[r] = _mm512_setzero_si512();
      if constexpr (MX) {  // Σ(u − 12)·q: from −12·Σq
        for (int r = 0; r < R; ++r)
          dot[r] = _mm512_set1_epi32(-kMxfp4Offset * sum0[panel_index(r, g, groups, P)]);
      }
      prefetch_ahead(block, group_bytes);
      for (int b = 0; b < blocks; ++b) {
        const uint8_t* wb = block + b * kBlockBytes;
        if constexpr (BITS == 8) {
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j)
            add(dot, j, _mm512_loadu_si512(wb + 64 * j), qa + j * kQuadWords * P);
        } else if constexpr (BITS == 5) {  // the nibbles, and each quad's bit of the plane
          const __m512i plane = _mm512_loadu_si512(wb + kHighPlaneOffset);
#pragma GCC unroll 4
          for (int p = 0; p < 4; ++p) {
            const __m512i packed = _mm512_loadu_si512(wb + 64 * p);
            add(dot, 2 * p,
                _mm512_ternarylogic_epi32(packed, low_nibbles, high_bit(plane, 2 * p), kOr),
                qa + 2 * p * kQuadWords * P);
            add(dot, 2 * p + 1,
                _mm512_ternarylogic_epi32(_mm512_srli_epi16(packed, 4), low_nibbles,
                                          high_bit(plane, 2 * p + 1), kOr),
                qa + (2 * p + 1) * kQuadWords * P);
          }
        } else if constexpr (MX) {
#pragma GCC unroll 4
          for (int p = 0; p < 4; ++p) {
            const __m512i packed = _mm512_loadu_si512(wb + 64 * p);
            add(dot, 2 * p, _mm512_shuffle_epi8(codes, _mm512_and_si512(packed, low_nibbles)),
                qa + 2 * p * kQuadWords * P);
            add(dot, 2 * p + 1,
                _mm512_shuffle_epi8(codes,
                                    _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles)),
                qa + (2 * p + 1) * kQuadWords * P);
          }
        } else {
#pragma GCC unroll 4
          for (int p = 0; p < 4; ++p) {
            const __m512i packed = _mm512_loadu_si512(wb + 64 * p);
            add(dot, 2 * p, _mm512_and_si512(packed, low_nibbles), qa + 2 * p * kQuadWords * P);
            add(dot, 2 * p + 1, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles),
                qa + (2 * p + 1) * kQuadWords * P);
          }
        }
        qa += 8 * kQuadWords * P;
      }
      fold_chains<R, C>(dot);
      if constexpr (MX) {  // w = value · 2^(e − 128): no offset term
        const __m512 d = e8m0_halves(mxfp4_exponents_at(w, t, g));
        for (int r = 0; r < R; ++r) {
          const int64_t cell = panel_index(r, g, groups, P);
          _mm512_store_ps(acc[r], add_scaled<Q>(_mm512_load_ps(acc[r]), dot[r], d, shift0 + cell,
                                                scale0 + cell));
        }
        block += group_bytes;
        continue;
      }
      __m512 d, m;
      if (super_scales) {  // D·sc and −Dmin·mn (qgemm.h): exact; D and −Dmin once a super-block
        const uint16_t* const from =
            w.scales + t * super_tile_halves + g / kSuperGroups * kSuperScaleHalves;
        if (g % kSuperGroups == 0) {
          big_d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from)));
          neg_dmin = _mm512_cvtph_ps(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + kTileRows)));
        }
        const uint8_t* sc8 = super_sc_at(from, g);
        d = _mm512_mul_ps(big_d, byte_floats(sc8));
        m = _mm512_mul_ps(neg_dmin, byte_floats(sc8 + kSuperMinOffset));
      } else {
        d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
        m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + kTileRows)));
      }
      for (int r = 0; r < R; ++r) {  // in the row's unit (see qgemm.h)
        const int64_t cell = panel_index(r, g, groups, P);
        const __m512 sum =
            add_scaled<Q>(_mm512_load_ps(acc[r]), dot[r], d, shift0 + cell, scale0 + cell);
        _mm512_store_ps(acc[r], _mm512_fmadd_ps(m, _mm512_set1_ps(unit_sum0[cell]), sum));
      }
      block += group_bytes;
      sc += 2 * kTileRows;
    }
    store_tile<R>(acc, w, a, row0, t, bias, out, out_stride);
  }
}

template <int BITS, class Q, int R = 1>
void tiles_bits(const PackedWeights& w, const QuantizedRows& a, int row0, int rows, int tile0,
                int tile1, const float* bias, float* out, int64_t out_stride) {
  if constexpr (R <= kMaxRows) {
    if (rows == R) {
      if constexpr (BITS == 6) {
        return q6_tiles_rows<R, Q>(w, a, row0, tile0, tile1, bias, out, out_stride);
      } else {
        if constexpr (BITS == 4) {
          if (w.mxfp4)
            return tiles_rows<R, 4, Q, true, true>(w, a, row0, tile0, tile1, bias, out, out_stride);
        }
        if (w.group == 32)
          return tiles_rows<R, BITS, Q, true>(w, a, row0, tile0, tile1, bias, out, out_stride);
        else
          return tiles_rows<R, BITS, Q, false>(w, a, row0, tile0, tile1, bias, out, out_stride);
      }
    }
    return tiles_bits<BITS, Q, R + 1>(w, a, row0, rows, tile0, tile1, bias, out, out_stride);
  }
}

void tiles_avx512(const PackedWeights& w, const QuantizedRows& a, int row0, int rows, int tile0,
                  int tile1, const float* bias, float* out, int64_t out_stride) {
  with_weight_and_activation_types(w.bits, a.bits, [&](auto bits, auto q) {
    tiles_bits<decltype(bits)::value, decltype(q)>(w, a, row0, rows, tile0, tile1, bias, out,
                                                   out_stride);
  });
}

}  // namespace

const KernelTable& avx512_kernels() {
  static const KernelTable table{"avx512_vnni", kMaxRows, kPanelRows, quantize_rows_avx512,
                                 tiles_avx512};
  return table;
}

}  // namespace pyserve_kernels

#else  // not x86-64 with GCC/Clang: never selected (isa_supported says no)

namespace pyserve_kernels {
const KernelTable& avx512_kernels() { return scalar_kernels(); }
}  // namespace pyserve_kernels

#endif
