// The AVX-512 attention loops (Skylake-X and later Intel, Zen 4 and later AMD): 16 floats a
// register, masked loads for a head_dim that is not a multiple of 16, a polynomial exp.
// Function-level target attributes: this file builds with the default flags.
#include "attention.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include <cmath>

#include "avx512_math.h"

#define PYSERVE_AVX512 PYSERVE_AVX512_MATH

namespace pyserve_kernels {
namespace {

using avx512::element;
using avx512::exp_nonpositive;
using avx512::lanes;
using avx512::load;

// Lane i of the result is the sum of the 16 lanes of v[i]: a transpose-and-add tree, 45 ops for
// 16 sums (_mm512_reduce_add_ps is ~8 a sum).
PYSERVE_AVX512 inline __m512 sums16(const __m512 (&v)[16]) {
  __m512 pairs[8];  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2i] = a, v[2i+1] = b
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 quads[4];  // per 128-bit lane: that lane's sums of v[4i], v[4i+1], v[4i+2], v[4i+3]
  for (int i = 0; i < 4; ++i)
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xee));
  __m512 halves[2];  // 128-bit lanes: quads[2i] lanes 0+1, 2+3, then quads[2i+1] lanes 0+1, 2+3
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xdd));
}

// DIM > 0: a head_dim known at compile time (a multiple of 16), the query heads in registers;
// DIM == 0: any head_dim, masked.
template <DType T, int DIM>
PYSERVE_AVX512 void score_as(const float* q, int group, int dim, const void* k, int tokens,
                             float* s, int stride) {
  if constexpr (DIM > 0) {
    constexpr int chunks = DIM / 16;
    // 16 tokens a head at a time: their 16 partial-sum vectors reduce together (sums16), ~3
    // shuffles and adds a token instead of a horizontal reduction (~8) each. The tile's K rows
    // are read once per head; they stay in L1.
    for (int t0 = 0; t0 < tokens; t0 += 16) {
      const int n = tokens - t0 < 16 ? tokens - t0 : 16;
      const void* k_tile = element<T>(k, static_cast<int64_t>(t0) * DIM);
      for (int h = 0; h < group; ++h) {
        __m512 query[chunks];
        for (int c = 0; c < chunks; ++c) query[c] = _mm512_loadu_ps(q + h * DIM + 16 * c);
        __m512 partial[16];
        for (int i = 0; i < 16; ++i) {
          if (i >= n) {
            partial[i] = _mm512_setzero_ps();
            continue;
          }
          __m512 sum0 = _mm512_mul_ps(query[0], load<T>(element<T>(k_tile, i * DIM)));
          __m512 sum1 = _mm512_setzero_ps();  // two chains: half the FMA latency in a row
          for (int c = 1; c < chunks; ++c) {
            const __m512 key = load<T>(element<T>(k_tile, i * DIM + 16 * c));
            if (c % 2)
              sum1 = _mm512_fmadd_ps(query[c], key, sum1);
            else
              sum0 = _mm512_fmadd_ps(query[c], key, sum0);
          }
          partial[i] = _mm512_add_ps(sum0, sum1);
        }
        _mm512_mask_storeu_ps(s + h * stride + t0, lanes(n), sums16(partial));
      }
    }
  } else {
    for (int t = 0; t < tokens; ++t) {
      const int64_t row = static_cast<int64_t>(t) * dim;
      for (int h = 0; h < group; ++h) {
        __m512 sum = _mm512_setzero_ps();
        for (int i = 0; i < dim; i += 16) {
          const __mmask16 live = lanes(dim - i);
          sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, q + h * dim + i),
                                load<T>(element<T>(k, row + i), live), sum);
        }
        s[h * stride + t] = _mm512_reduce_add_ps(sum);
      }
    }
  }
}

template <DType T>
PYSERVE_AVX512 void score_for(const float* q, int group, int dim, const void* k, int tokens,
                              float* s, int stride) {
  if (dim == 64) return score_as<T, 64>(q, group, dim, k, tokens, s, stride);
  if (dim == 128) return score_as<T, 128>(q, group, dim, k, tokens, s, stride);
  return score_as<T, 0>(q, group, dim, k, tokens, s, stride);
}

PYSERVE_AVX512 void score(DType cache, const float* q, int group, int dim, const void* k,
                          int tokens, float* s, int stride) {
  switch (cache) {
    case DType::kFloat32:
      return score_for<DType::kFloat32>(q, group, dim, k, tokens, s, stride);
    case DType::kBFloat16:
      return score_for<DType::kBFloat16>(q, group, dim, k, tokens, s, stride);
    case DType::kFloat16:
      return score_for<DType::kFloat16>(q, group, dim, k, tokens, s, stride);
  }
}

PYSERVE_AVX512 float exp_sum(float* s, int n, float shift) {
  const __m512 offset = _mm512_set1_ps(shift);
  __m512 total = _mm512_setzero_ps();
  for (int t = 0; t < n; t += 16) {
    const __mmask16 live = lanes(n - t);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), offset));
    _mm512_mask_storeu_ps(s + t, live, e);
    total = _mm512_mask_add_ps(total, live, total, e);
  }
  return _mm512_reduce_add_ps(total);
}

// G heads of the group at a time, their sums in registers, each V row loaded and converted once
// for all of them.
template <DType T, int DIM, int G>
PYSERVE_AVX512 void accumulate_heads(const float* p, int stride, const void* v, int tokens,
                                     float* acc) {
  constexpr int chunks = DIM / 16;
  __m512 sum[G][chunks];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < chunks; ++c) sum[g][c] = _mm512_loadu_ps(acc + g * DIM + 16 * c);
  for (int t = 0; t < tokens; ++t) {
    __m512 row[chunks];
    for (int c = 0; c < chunks; ++c) row[c] = load<T>(element<T>(v, t * DIM + 16 * c));
    for (int g = 0; g < G; ++g) {
      const __m512 weight = _mm512_set1_ps(p[g * stride + t]);
      for (int c = 0; c < chunks; ++c) sum[g][c] = _mm512_fmadd_ps(weight, row[c], sum[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < chunks; ++c) _mm512_storeu_ps(acc + g * DIM + 16 * c, sum[g][c]);
}

template <DType T, int DIM>
PYSERVE_AVX512 void accumulate_as(const float* p, int stride, int group, int dim, const void* v,
                                  int tokens, float* acc) {
  if constexpr (DIM > 0) {
    constexpr int most = DIM <= 64 ? 4 : 2;  // sums + a row within the 32 registers
    int h = 0;
    for (; h + most <= group; h += most)
      accumulate_heads<T, DIM, most>(p + h * stride, stride, v, tokens, acc + h * DIM);
    const float* rest_p = p + h * stride;
    float* rest_acc = acc + h * DIM;
    switch (group - h) {
      case 1:
        return accumulate_heads<T, DIM, 1>(rest_p, stride, v, tokens, rest_acc);
      case 2:
        return accumulate_heads<T, DIM, 2>(rest_p, stride, v, tokens, rest_acc);
      case 3:
        return accumulate_heads<T, DIM, 3>(rest_p, stride, v, tokens, rest_acc);
      default:
        return;
    }
  } else {
    for (int h = 0; h < group; ++h) {
      for (int i = 0; i < dim; i += 16) {
        const __mmask16 live = lanes(dim - i);
        __m512 sum = _mm512_maskz_loadu_ps(live, acc + h * dim + i);
        for (int t = 0; t < tokens; ++t) {
          const __m512 weight = _mm512_set1_ps(p[h * stride + t]);
          sum = _mm512_fmadd_ps(weight, load<T>(element<T>(v, int64_t{t} * dim + i), live), sum);
        }
        _mm512_mask_storeu_ps(acc + h * dim + i, live, sum);
      }
    }
  }
}

template <DType T>
PYSERVE_AVX512 void accumulate_for(const float* p, int stride, int group, int dim, const void* v,
                                   int tokens, float* acc) {
  if (dim == 64) return accumulate_as<T, 64>(p, stride, group, dim, v, tokens, acc);
  if (dim == 128) return accumulate_as<T, 128>(p, stride, group, dim, v, tokens, acc);
  return accumulate_as<T, 0>(p, stride, group, dim, v, tokens, acc);
}

PYSERVE_AVX512 void accumulate(DType cache, const float* p, int stride, int group, int dim,
                               const void* v, int tokens, float* acc) {
  switch (cache) {
    case DType::kFloat32:
      return accumulate_for<DType::kFloat32>(p, stride, group, dim, v, tokens, acc);
    case DType::kBFloat16:
      return accumulate_for<DType::kBFloat16>(p, stride, group, dim, v, tokens, acc);
    case DType::kFloat16:
      return accumulate_for<DType::kFloat16>(p, stride, group, dim, v, tokens, acc);
  }
}

}  // namespace

const AttentionKernels& avx512_attention() {
  static const AttentionKernels table{"avx512", score, exp_sum, accumulate};
  return table;
}

}  // namespace pyserve_kernels

#else  // not x86-64: the dispatcher never picks this path

namespace pyserve_kernels {
const AttentionKernels& avx512_attention() { return scalar_attention(); }
}  // namespace pyserve_kernels

#endif
