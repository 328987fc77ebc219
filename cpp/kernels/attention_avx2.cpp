// The AVX2 attention loops (Haswell and later, Zen 1-3): 8 floats a register, a scalar tail for
// a head_dim that is not a multiple of 8, a polynomial exp. Function-level target attributes:
// this file builds with the default flags.
#include "attention.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

#include "attention_convert.h"

#define PYSERVE_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace pyserve_kernels {
namespace {

// 8 cache elements from `p`, as floats.
template <DType T>
PYSERVE_AVX2 inline __m256 load8(const void* p) {
  if constexpr (T == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(p));
  } else if constexpr (T == DType::kInt8) {  // the raw values (kInt8's scale is the caller's)
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p))));
  } else {
    const __m128i raw = _mm_loadu_si128(static_cast<const __m128i*>(p));
    if constexpr (T == DType::kBFloat16)
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    else
      return _mm256_cvtph_ps(raw);
  }
}

template <DType T>
inline const void* element(const void* base, int64_t i) {
  constexpr int bytes = T == DType::kFloat32 ? 4 : T == DType::kInt8 ? 1 : 2;
  return static_cast<const char*>(base) + i * bytes;
}

PYSERVE_AVX2 inline float horizontal_sum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// HN query heads against 8 tokens of dimension-major K: two FMA chains a head (a broadcast
// query element times one K vector each). int8: each group of kInt8Group dimensions summed so on
// its own, then added times its scales (group g's of the 8 tokens at scale + g·k_stride).
template <DType T, int HN>
PYSERVE_AVX2 inline void score_heads(const float* q, int dim, const void* k, int64_t k_stride,
                                     float* s, int stride, float* top, bool first,
                                     const uint16_t* scale) {
  const int step = T == DType::kInt8 ? kInt8Group : dim;
  __m256 total[HN];
  for (int h = 0; h < HN; ++h) total[h] = _mm256_setzero_ps();
  for (int start = 0; start < dim; start += step) {
    const int end = start + step < dim ? start + step : dim;
    __m256 acc[HN][2];
    for (int h = 0; h < HN; ++h) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
    for (int i = start; i < end; ++i) {
      const __m256 key = load8<T>(element<T>(k, i * k_stride));
      for (int h = 0; h < HN; ++h)
        acc[h][i % 2] = _mm256_fmadd_ps(_mm256_set1_ps(q[h * dim + i]), key, acc[h][i % 2]);
    }
    if constexpr (T == DType::kInt8) {  // the raw values' dot products times the group's scales
      const __m256 factor = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + start / step * k_stride)));
      for (int h = 0; h < HN; ++h)
        total[h] = _mm256_fmadd_ps(_mm256_add_ps(acc[h][0], acc[h][1]), factor, total[h]);
    } else {
      for (int h = 0; h < HN; ++h) total[h] = _mm256_add_ps(acc[h][0], acc[h][1]);
    }
  }
  for (int h = 0; h < HN; ++h) {
    const __m256 sum = total[h];
    _mm256_storeu_ps(s + h * stride, sum);
    __m128 most = _mm_max_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    most = _mm_max_ps(most, _mm_movehl_ps(most, most));
    most = _mm_max_ss(most, _mm_movehdup_ps(most));
    const float value = _mm_cvtss_f32(most);
    top[h] = first || value > top[h] ? value : top[h];
  }
}

template <DType T>
PYSERVE_AVX2 void score_as(const float* q, int group, int dim, const void* k, int64_t k_stride,
                           int tokens, float* s, int stride, float* top, const uint16_t* scale) {
  int t0 = 0;
  for (; t0 + 8 <= tokens; t0 += 8) {  // whole vectors of 8 tokens
    const void* tile = element<T>(k, t0);
    const uint16_t* tile_scale = T == DType::kInt8 ? scale + t0 : nullptr;
    for (int h = 0; h < group; h += 3) {
      const float* qh = q + h * dim;
      float* sh = s + h * stride + t0;
      switch (group - h) {
        case 1:
          score_heads<T, 1>(qh, dim, tile, k_stride, sh, stride, top + h, t0 == 0, tile_scale);
          break;
        case 2:
          score_heads<T, 2>(qh, dim, tile, k_stride, sh, stride, top + h, t0 == 0, tile_scale);
          break;
        default:
          score_heads<T, 3>(qh, dim, tile, k_stride, sh, stride, top + h, t0 == 0, tile_scale);
      }
    }
  }
  for (int t = t0; t < tokens; ++t) {  // the last < 8 tokens: scalar
    for (int h = 0; h < group; ++h) {
      float sum = 0.0f;
      const int step = T == DType::kInt8 ? kInt8Group : dim;
      for (int start = 0; start < dim; start += step) {
        float part = 0.0f;
        for (int i = start; i < start + step && i < dim; ++i)
          part += q[h * dim + i] * load_element(T, k, i * k_stride + t);
        sum += T == DType::kInt8 ? part * _cvtsh_ss(scale[start / step * k_stride + t]) : part;
      }
      s[h * stride + t] = sum;
      top[h] = t == 0 || sum > top[h] ? sum : top[h];
    }
  }
}

PYSERVE_AVX2 void score_tile(DType cache, const float* q, int group, int dim, const void* k,
                             int64_t k_stride, int tokens, float* s, int stride, float* top,
                             const uint16_t* scale) {
  switch (cache) {
    case DType::kFloat32:
      return score_as<DType::kFloat32>(q, group, dim, k, k_stride, tokens, s, stride, top, scale);
    case DType::kBFloat16:
      return score_as<DType::kBFloat16>(q, group, dim, k, k_stride, tokens, s, stride, top, scale);
    case DType::kFloat16:
      return score_as<DType::kFloat16>(q, group, dim, k, k_stride, tokens, s, stride, top, scale);
    case DType::kInt8:
      return score_as<DType::kInt8>(q, group, dim, k, k_stride, tokens, s, stride, top, scale);
  }
}

// exp(x) for x ≤ 0 as in the AVX-512 path, 2^n built in the exponent bits (n ≥ −126 here).
PYSERVE_AVX2 inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i bias = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(bias, 23)));
}

PYSERVE_AVX2 float exp_sum(float* s, int n, float shift) {
  const __m256 offset = _mm256_set1_ps(shift);
  __m256 total = _mm256_setzero_ps();
  int t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), offset));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = horizontal_sum(total);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - shift);
    sum += s[t];
  }
  return sum;
}

// tanh as avx512::tanh computes it (avx512_math.h), 8 lanes.
PYSERVE_AVX2 inline __m256 tanh8(__m256 x) {
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 magnitude = _mm256_andnot_ps(sign, x);
  const __m256 e = exp_nonpositive(_mm256_mul_ps(magnitude, _mm256_set1_ps(-2.0f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 large = _mm256_sub_ps(one, _mm256_div_ps(_mm256_add_ps(e, e), _mm256_add_ps(one, e)));
  large = _mm256_or_ps(large, _mm256_and_ps(sign, x));
  const __m256 near_zero = _mm256_cmp_ps(magnitude, _mm256_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm256_blendv_ps(large, small, near_zero);
}

PYSERVE_AVX2 float softcap(float* s, int n, float cap) {
  const float inverse = 1.0f / cap;
  const __m256 c = _mm256_set1_ps(cap), scale = _mm256_set1_ps(inverse);
  __m256 most = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 capped = _mm256_mul_ps(c, tanh8(_mm256_mul_ps(_mm256_loadu_ps(s + t), scale)));
    _mm256_storeu_ps(s + t, capped);
    most = _mm256_max_ps(most, capped);
  }
  __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
  top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
  float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
  for (; t < n; ++t) {  // the last < 8 scores: scalar
    s[t] = cap * tanh_float(s[t] * inverse);
    top = s[t] > top ? s[t] : top;
  }
  return top;
}

// A softmax weight as the V loops apply it; int8: times the scale of its group of the V row (the
// raw values follow).
template <DType T>
PYSERVE_AVX2 inline float weight_of(float p, const uint16_t* scale, int64_t at) {
  if constexpr (T == DType::kInt8) return p * _cvtsh_ss(scale[at]);
  return p;
}

template <DType T, int DIM>
PYSERVE_AVX2 void accumulate_as(const float* p, int stride, int group, int dim, const void* v,
                                int tokens, float* acc, const uint16_t* scale) {
  const int groups = int8_groups(dim);
  if constexpr (DIM > 0) {
    constexpr int chunks = DIM / 8;
    constexpr int per_group = T == DType::kInt8 ? kInt8Group / 8 : chunks;
    for (int h = 0; h < group; ++h) {
      __m256 sum[chunks];
      for (int c = 0; c < chunks; ++c) sum[c] = _mm256_loadu_ps(acc + h * DIM + 8 * c);
      for (int t = 0; t < tokens; ++t) {
        for (int c0 = 0; c0 < chunks; c0 += per_group) {
          const __m256 weight = _mm256_set1_ps(
              weight_of<T>(p[h * stride + t], scale, t * groups + 8 * c0 / kInt8Group));
          for (int c = c0; c < c0 + per_group; ++c)
            sum[c] = _mm256_fmadd_ps(weight, load8<T>(element<T>(v, t * DIM + 8 * c)), sum[c]);
        }
      }
      for (int c = 0; c < chunks; ++c) _mm256_storeu_ps(acc + h * DIM + 8 * c, sum[c]);
    }
  } else {
    const int vector_end = dim / 8 * 8;
    for (int h = 0; h < group; ++h) {
      for (int i = 0; i < vector_end; i += 8) {
        __m256 sum = _mm256_loadu_ps(acc + h * dim + i);
        for (int t = 0; t < tokens; ++t)
          sum = _mm256_fmadd_ps(
              _mm256_set1_ps(weight_of<T>(p[h * stride + t], scale, t * groups + i / kInt8Group)),
              load8<T>(element<T>(v, int64_t{t} * dim + i)), sum);
        _mm256_storeu_ps(acc + h * dim + i, sum);
      }
      for (int i = vector_end; i < dim; ++i)
        for (int t = 0; t < tokens; ++t)
          acc[h * dim + i] += weight_of<T>(p[h * stride + t], scale, t * groups + i / kInt8Group) *
                              load_element(T, v, int64_t{t} * dim + i);
    }
  }
}

template <DType T>
PYSERVE_AVX2 void accumulate_for(const float* p, int stride, int group, int dim, const void* v,
                                 int tokens, float* acc, const uint16_t* scale) {
  if (dim == 64) return accumulate_as<T, 64>(p, stride, group, dim, v, tokens, acc, scale);
  if (dim == 128) return accumulate_as<T, 128>(p, stride, group, dim, v, tokens, acc, scale);
  return accumulate_as<T, 0>(p, stride, group, dim, v, tokens, acc, scale);
}

PYSERVE_AVX2 void accumulate_tile(DType cache, const float* p, int stride, int group, int dim,
                                  const void* v, int tokens, float* acc, const uint16_t* scale) {
  switch (cache) {
    case DType::kFloat32:
      return accumulate_for<DType::kFloat32>(p, stride, group, dim, v, tokens, acc, scale);
    case DType::kBFloat16:
      return accumulate_for<DType::kBFloat16>(p, stride, group, dim, v, tokens, acc, scale);
    case DType::kFloat16:
      return accumulate_for<DType::kFloat16>(p, stride, group, dim, v, tokens, acc, scale);
    case DType::kInt8:
      return accumulate_for<DType::kInt8>(p, stride, group, dim, v, tokens, acc, scale);
  }
}

// A chunk tile by tile, its prefetches issued up front.
PYSERVE_AVX2 void score(DType cache, const float* q, int group, int dim, int64_t k_stride,
                        const Tile* tiles, int count, const PrefetchSpan* ahead, int ahead_count,
                        float* s, int stride, float* top) {
  prefetch_spans(ahead, ahead_count);
  thread_local std::vector<float> most;
  most.resize(group);
  for (int j = 0, offset = 0; j < count; offset += tiles[j++].tokens) {
    score_tile(cache, q, group, dim, tiles[j].k, k_stride, tiles[j].tokens, s + offset, stride,
               j == 0 ? top : most.data(), tiles[j].k_scale);
    if (j > 0)
      for (int h = 0; h < group; ++h) top[h] = most[h] > top[h] ? most[h] : top[h];
  }
}

PYSERVE_AVX2 void accumulate(DType cache, const float* p, int stride, int group, int dim,
                             const Tile* tiles, int count, const PrefetchSpan* ahead,
                             int ahead_count, float* acc) {
  prefetch_spans(ahead, ahead_count);
  for (int j = 0, offset = 0; j < count; offset += tiles[j++].tokens)
    accumulate_tile(cache, p + offset, stride, group, dim, tiles[j].v, tiles[j].tokens, acc,
                    tiles[j].v_scale);
}

}  // namespace

const AttentionKernels& avx2_attention() {
  static const AttentionKernels table{"avx2", score, exp_sum, softcap, accumulate};
  return table;
}

}  // namespace pyserve_kernels

#else  // not x86-64: the dispatcher never picks this path

namespace pyserve_kernels {
const AttentionKernels& avx2_attention() { return scalar_attention(); }
}  // namespace pyserve_kernels

#endif
