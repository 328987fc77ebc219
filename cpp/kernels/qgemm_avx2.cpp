// The AVX2 path for x86-64 CPUs without AVX-512 VNNI (Zen 2/3, Haswell to Comet Lake). It reads
// the same packed layout, half a tile (8 rows, 32 bytes a quad block) at a time, and builds the
// u8×s8 dot product from vpmaddubsw + vpmaddwd. vpmaddubsw saturates at 16 bits: 4-bit weights
// (≤ 15) cannot reach it, and 8-bit weights are recentred to q = u − 128 with the sign trick
// (|q|·sign(q)·a), whose pair sums stay within ±32512.
#include "qgemm.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#define PYSERVE_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace pyserve_kernels {
namespace {

constexpr int kHalfRows = kTileRows / 2;

PYSERVE_AVX2 inline __m256i broadcast_quad(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// Σ over each lane's 4 bytes of u·a (u unsigned ≤ 15, a signed), as int32.
PYSERVE_AVX2 inline __m256i dot_u4(__m256i u, __m256i a) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
}

// Σ over each lane's 4 bytes of (u − 128)·a (u unsigned 8-bit, a signed in [−127, 127]).
PYSERVE_AVX2 inline __m256i dot_centred_u8(__m256i u, __m256i a) {
  const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i product = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q));
  return _mm256_madd_epi16(product, _mm256_set1_epi16(1));
}

// vpshufb patterns that widen the bytes (k0, k1) or (k2, k3) of every 32-bit lane to words.
constexpr int widen_pattern(int lane, int first) {
  const unsigned low = static_cast<unsigned>(4 * lane + first);  // bytes: low, zero, low+1, zero
  return static_cast<int>(low | 0x8000u | (low + 1) << 16 | 0x80000000u);
}

// Σ over each lane's 4 bytes of u·a, u unsigned 8-bit and a the 4 int16 activations at `a`.
PYSERVE_AVX2 inline __m256i dot_u8_i16(__m256i u, const int16_t* a) {
  const __m256i low = _mm256_shuffle_epi8(
      u, _mm256_setr_epi32(widen_pattern(0, 0), widen_pattern(1, 0), widen_pattern(2, 0),
                           widen_pattern(3, 0), widen_pattern(0, 0), widen_pattern(1, 0),
                           widen_pattern(2, 0), widen_pattern(3, 0)));
  const __m256i high = _mm256_shuffle_epi8(
      u, _mm256_setr_epi32(widen_pattern(0, 2), widen_pattern(1, 2), widen_pattern(2, 2),
                           widen_pattern(3, 2), widen_pattern(0, 2), widen_pattern(1, 2),
                           widen_pattern(2, 2), widen_pattern(3, 2)));
  return _mm256_add_epi32(_mm256_madd_epi16(low, broadcast_quad(a)),
                          _mm256_madd_epi16(high, broadcast_quad(a + 2)));
}

// 8 unsigned bytes as floats (half a super-block group's sc or mn, qgemm.h).
PYSERVE_AVX2 inline __m256 byte_floats(const uint8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Quads 2j (low nibbles) and 2j + 1 (high nibbles) of a 4- or 5-bit group at `block` (half a
// tile: 32 bytes of each 64-byte block) as bytes u; 5 bits: with their bit of the high plane.
template <int BITS>
PYSERVE_AVX2 inline void nibble_quads(const uint8_t* block, int j, __m256i* lo, __m256i* hi) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j));
  *lo = _mm256_and_si256(packed, low_nibbles);
  *hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
  if constexpr (BITS == 5) {  // bit i of the plane's bytes is quad i's: moved to bit 4
    const __m256i plane =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kHighPlaneOffset));
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    for (int q = 0; q < 2; ++q) {
      const int i = 2 * j + q;
      const __m256i moved = i <= 4 ? _mm256_sll_epi16(plane, _mm_cvtsi32_si128(4 - i))
                                   : _mm256_srl_epi16(plane, _mm_cvtsi32_si128(i - 4));
      __m256i* u = q == 0 ? lo : hi;
      *u = _mm256_or_si256(*u, _mm256_and_si256(moved, bit4));
    }
  }
}

// acc + d·(a group's integer dot in its row's unit): int16 shifts it by e − U, int8 multiplies
// it by the scale (qgemm.h); `at` is the row's cell.
template <class Q>
PYSERVE_AVX2 inline __m256 add_scaled(__m256 acc, __m256i dot, __m256 d, const QuantizedRows& a,
                                      int64_t at) {
  if constexpr (sizeof(Q) == 2) {
    const __m256i shifted = _mm256_sllv_epi32(dot, _mm256_set1_epi32(a.shift[at]));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(shifted), d, acc);
  } else {
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(a.scale[at])), d,
                           acc);
  }
}

// Half tile `half` of tile t for rows row0.. row0 + R − 1: acc times the row's unit, plus bias.
template <int R>
PYSERVE_AVX2 inline void store_half_tile(const __m256 (&acc)[R], const PackedWeights& w,
                                         const QuantizedRows& a, int row0, int t, int half,
                                         const float* bias, float* out, int64_t out_stride) {
  const int first = t * kTileRows + kHalfRows * half;
  const int count = std::clamp(w.n - first, 0, kHalfRows);
  for (int r = 0; r < R; ++r) {
    alignas(32) float lane[kHalfRows];
    _mm256_store_ps(lane, acc[r]);
    const float unit = a.unit[row0 + r];
    float* o = out + static_cast<int64_t>(row0 + r) * out_stride + first;
    for (int n = 0; n < count; ++n) o[n] = std::fma(lane[n], unit, bias ? bias[first + n] : 0.0f);
  }
}

// The 6-bit (Q6_K) tiles of qgemm.h, half a tile at a time as tiles_rows below: per 16 inputs
// the quads' low nibbles and high bit pairs merge into bytes u ≤ 63 (vpmaddubsw's pair sums stay
// within 16 bits), and the rows' Σu·q, started at −32·Σq, is scaled by D·sc.
template <int R, class Q>
PYSERVE_AVX2 void q6_tiles_rows(const PackedWeights& w, const QuantizedRows& a, int row0, int tile0,
                                int tile1, const float* bias, float* out, int64_t out_stride) {
  const int groups = w.groups();
  const size_t group_bytes = w.group_bytes();
  const int halves = a.k_padded / 16;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  const __m256i pair_bits = _mm256_set1_epi8(0x30);
  for (int t = tile0; t < tile1; ++t) {
    for (int half_tile = 0; half_tile < 2; ++half_tile) {
      const uint8_t* block =
          w.data + static_cast<size_t>(t) * groups * group_bytes + 32 * half_tile;
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      __m256 big_d = _mm256_setzero_ps();  // a super-block's
      for (int g = 0; g < groups; ++g) {
        const uint16_t* const from = q6_block_at(w, t, g);
        if (g % kSuperGroups == 0)
          big_d = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + kHalfRows * half_tile)));
        const int8_t* const sc = q6_sc_at(from, g) + kHalfRows * half_tile;
        const Q* qa = static_cast<const Q*>(a.q) + static_cast<int64_t>(row0) * a.k_padded + g * 32;
        for (int h = 0; h < 2; ++h) {  // inputs 16h..16h + 15: quads 4h..4h + 3
          __m256i dot[R];              // Σ(u − 32)·q: from −32·Σq
          for (int r = 0; r < R; ++r)
            dot[r] =
                _mm256_set1_epi32(a.centre[static_cast<int64_t>(row0 + r) * halves + 2 * g + h]);
          const __m256i pairs =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 256 + 64 * h));
          for (int p = 0; p < 2; ++p) {  // quads 4h + 2p (low nibbles) and 4h + 2p + 1
            const __m256i packed =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * (2 * h + p)));
            const __m256i high0 =
                _mm256_and_si256(p == 0 ? _mm256_slli_epi16(pairs, 4) : pairs, pair_bits);
            const __m256i high1 = _mm256_and_si256(
                p == 0 ? _mm256_slli_epi16(pairs, 2) : _mm256_srli_epi16(pairs, 2), pair_bits);
            const __m256i u0 = _mm256_or_si256(_mm256_and_si256(packed, low_nibbles), high0);
            const __m256i u1 =
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles), high1);
            for (int r = 0; r < R; ++r) {
              const Q* q = qa + r * a.k_padded + 4 * (4 * h + 2 * p);
              if constexpr (sizeof(Q) == 2) {
                dot[r] = _mm256_add_epi32(dot[r], dot_u8_i16(u0, q));
                dot[r] = _mm256_add_epi32(dot[r], dot_u8_i16(u1, q + 4));
              } else {
                dot[r] = _mm256_add_epi32(dot[r], dot_u4(u0, broadcast_quad(q)));
                dot[r] = _mm256_add_epi32(dot[r], dot_u4(u1, broadcast_quad(q + 4)));
              }
            }
          }
          const __m256 d = _mm256_mul_ps(
              big_d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + h * kTileRows)))));
          for (int r = 0; r < R; ++r)  // in the row's unit (see qgemm.h)
            acc[r] = add_scaled<Q>(acc[r], dot[r], d, a, (row0 + r) * int64_t{groups} + g);
        }
        block += group_bytes;
      }
      store_half_tile<R>(acc, w, a, row0, t, half_tile, bias, out, out_stride);
    }
  }
}

// 8 rows' 2^(e − 128) of an MXFP4 group's exponent bytes (qgemm.h's e8m0_half).
PYSERVE_AVX2 inline __m256 e8m0_halves(const uint8_t* exponents) {
  const __m256i e =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(exponents)));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, below));
}

// MXFP4 (qgemm.h) half a tile at a time as tiles_rows below: the codes looked up into u ≤ 24
// (vpmaddubsw's pair sums stay within 16 bits), each group's Σu·q started at −12·Σq and scaled by
// its power of two, with no offset term.
template <int R, class Q>
PYSERVE_AVX2 void mxfp4_tiles_rows(const PackedWeights& w, const QuantizedRows& a, int row0,
                                   int tile0, int tile1, const float* bias, float* out,
                                   int64_t out_stride) {
  const int groups = w.groups();
  const size_t group_bytes = w.group_bytes();
  const __m256i codes = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const void*>(kMxfp4Codes))));
  for (int t = tile0; t < tile1; ++t) {
    for (int h = 0; h < 2; ++h) {
      const uint8_t* block = w.data + static_cast<size_t>(t) * groups * group_bytes + 32 * h;
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int g = 0; g < groups; ++g) {
        __m256i dot[R];  // Σ(u − 12)·q: from −12·Σq
        for (int r = 0; r < R; ++r)
          dot[r] =
              _mm256_set1_epi32(-kMxfp4Offset * a.sum[static_cast<int64_t>(row0 + r) * groups + g]);
        const Q* qa = static_cast<const Q*>(a.q) + static_cast<int64_t>(row0) * a.k_padded + g * 32;
        for (int p = 0; p < 4; ++p) {
          __m256i lo, hi;
          nibble_quads<4>(block, p, &lo, &hi);
          lo = _mm256_shuffle_epi8(codes, lo);
          hi = _mm256_shuffle_epi8(codes, hi);
          for (int r = 0; r < R; ++r) {
            const Q* q = qa + r * a.k_padded + 8 * p;
            if constexpr (sizeof(Q) == 2) {
              dot[r] = _mm256_add_epi32(dot[r], dot_u8_i16(lo, q));
              dot[r] = _mm256_add_epi32(dot[r], dot_u8_i16(hi, q + 4));
            } else {
              dot[r] = _mm256_add_epi32(dot[r], dot_u4(lo, broadcast_quad(q)));
              dot[r] = _mm256_add_epi32(dot[r], dot_u4(hi, broadcast_quad(q + 4)));
            }
          }
        }
        const __m256 d = e8m0_halves(mxfp4_exponents_at(w, t, g) + kHalfRows * h);
        for (int r = 0; r < R; ++r)  // in the row's unit (see qgemm.h)
          acc[r] = add_scaled<Q>(acc[r], dot[r], d, a, (row0 + r) * int64_t{groups} + g);
        block += group_bytes;
      }
      store_half_tile<R>(acc, w, a, row0, t, h, bias, out, out_stride);
    }
  }
}

template <int R, int BITS, class Q>
PYSERVE_AVX2 void tiles_rows(const PackedWeights& w, const QuantizedRows& a, int row0, int tile0,
                             int tile1, const float* bias, float* out, int64_t out_stride) {
  const int groups = w.groups();
  const bool super_scales = w.super_scales;
  // a tile's super-block scales (qgemm.h), where the weight has them
  const size_t super_tile_halves = static_cast<size_t>(groups / kSuperGroups) * kSuperScaleHalves;
  const int group = w.group;
  const size_t group_bytes = w.group_bytes();
  for (int t = tile0; t < tile1; ++t) {
    for (int h = 0; h < 2; ++h) {
      const uint8_t* block = w.data + static_cast<size_t>(t) * groups * group_bytes + 32 * h;
      const uint16_t* sc = w.scales + static_cast<size_t>(t) * groups * 2 * kTileRows;
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      __m256 big_d = _mm256_setzero_ps(), neg_dmin = _mm256_setzero_ps();  // a super-block's
      for (int g = 0; g < groups; ++g) {
        __m256i dot[R];
        for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
        const Q* qa =
            static_cast<const Q*>(a.q) + static_cast<int64_t>(row0) * a.k_padded + g * group;
        if constexpr (sizeof(Q) == 2) {  // words: no saturation to dodge
          for (int j = 0; j < group / (BITS == 8 ? 4 : 8); ++j) {
            const __m256i raw =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j));
            if constexpr (BITS == 8) {
              for (int r = 0; r < R; ++r)
                dot[r] = _mm256_add_epi32(dot[r], dot_u8_i16(raw, qa + r * a.k_padded + 4 * j));
            } else {
              __m256i lo, hi;
              nibble_quads<BITS>(block, j, &lo, &hi);
              for (int r = 0; r < R; ++r) {
                const Q* q = qa + r * a.k_padded + 8 * j;
                dot[r] = _mm256_add_epi32(dot[r], dot_u8_i16(lo, q));
                dot[r] = _mm256_add_epi32(dot[r], dot_u8_i16(hi, q + 4));
              }
            }
          }
        } else if constexpr (BITS == 8) {
          for (int j = 0; j < group / 4; ++j) {
            const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j));
            for (int r = 0; r < R; ++r) {
              const __m256i av = broadcast_quad(qa + r * a.k_padded + 4 * j);
              dot[r] = _mm256_add_epi32(dot[r], dot_centred_u8(u, av));
            }
          }
          for (int r = 0; r < R; ++r) {  // back from Σ(u − 128)·q to Σu·q
            const int32_t sum = a.sum[static_cast<int64_t>(row0 + r) * groups + g];
            dot[r] = _mm256_add_epi32(dot[r], _mm256_set1_epi32(128 * sum));
          }
        } else {
          for (int p = 0; p < group / 8; ++p) {
            __m256i lo, hi;
            nibble_quads<BITS>(block, p, &lo, &hi);
            for (int r = 0; r < R; ++r) {
              const Q* q = qa + r * a.k_padded + 8 * p;
              dot[r] = _mm256_add_epi32(dot[r], dot_u4(lo, broadcast_quad(q)));
              dot[r] = _mm256_add_epi32(dot[r], dot_u4(hi, broadcast_quad(q + 4)));
            }
          }
        }
        __m256 d, m;
        if (super_scales) {  // D·sc and −Dmin·mn (qgemm.h): exact; D and −Dmin once a block
          const uint16_t* const from =
              w.scales + t * super_tile_halves + g / kSuperGroups * kSuperScaleHalves;
          if (g % kSuperGroups == 0) {
            big_d = _mm256_cvtph_ps(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + kHalfRows * h)));
            neg_dmin = _mm256_cvtph_ps(_mm_loadu_si128(
                reinterpret_cast<const __m128i*>(from + kTileRows + kHalfRows * h)));
          }
          const uint8_t* sc8 = super_sc_at(from, g) + kHalfRows * h;
          d = _mm256_mul_ps(big_d, byte_floats(sc8));
          m = _mm256_mul_ps(neg_dmin, byte_floats(sc8 + kSuperMinOffset));
        } else {
          d = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + kHalfRows * h)));
          m = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + kTileRows + kHalfRows * h)));
        }
        for (int r = 0; r < R; ++r) {  // in the row's unit (see qgemm.h)
          const int64_t at = static_cast<int64_t>(row0 + r) * groups + g;
          acc[r] = add_scaled<Q>(acc[r], dot[r], d, a, at);
          acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.unit_sum[at]), acc[r]);
        }
        block += group_bytes;
        sc += 2 * kTileRows;
      }
      store_half_tile<R>(acc, w, a, row0, t, h, bias, out, out_stride);
    }
  }
}

template <int BITS, class Q, int R = 1>
void tiles_bits(const PackedWeights& w, const QuantizedRows& a, int row0, int rows, int tile0,
                int tile1, const float* bias, float* out, int64_t out_stride) {
  if constexpr (R <= 4) {
    if (rows != R)
      return tiles_bits<BITS, Q, R + 1>(w, a, row0, rows, tile0, tile1, bias, out, out_stride);
    if constexpr (BITS == 6) {
      return q6_tiles_rows<R, Q>(w, a, row0, tile0, tile1, bias, out, out_stride);
    } else {
      if constexpr (BITS == 4) {
        if (w.mxfp4) return mxfp4_tiles_rows<R, Q>(w, a, row0, tile0, tile1, bias, out, out_stride);
      }
      return tiles_rows<R, BITS, Q>(w, a, row0, tile0, tile1, bias, out, out_stride);
    }
  }
}

void tiles_avx2(const PackedWeights& w, const QuantizedRows& a, int row0, int rows, int tile0,
                int tile1, const float* bias, float* out, int64_t out_stride) {
  with_weight_and_activation_types(w.bits, a.bits, [&](auto bits, auto q) {
    tiles_bits<decltype(bits)::value, decltype(q)>(w, a, row0, rows, tile0, tile1, bias, out,
                                                   out_stride);
  });
}

}  // namespace

const KernelTable& avx2_kernels() {
  // activations are quantized by the scalar code: a few microseconds, and bit-identical
  static const KernelTable table{"avx2", 4, 0, scalar_kernels().quantize_rows, tiles_avx2};
  return table;
}

}  // namespace pyserve_kernels

#else

namespace pyserve_kernels {
const KernelTable& avx2_kernels() { return scalar_kernels(); }
}  // namespace pyserve_kernels

#endif
