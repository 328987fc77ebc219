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

// HN query heads against ≤ 16 tokens (`live` lanes) of dimension-major K: four independent FMA
// chains a head (a broadcast query element times one K vector each), summed at the end. DIM > 0:
// head_dim known at compile time (with a loop of unknown trip count GCC kept the accumulators in
// memory, stored every iteration); DIM == 0: any head_dim.
template <DType T, int HN, int DIM>
PYSERVE_AVX512 inline void score_heads(const float* q, int runtime_dim, const void* k,
                                       int64_t k_stride, __mmask16 live, float* s, int stride,
                                       float* top, bool first) {
  const int dim = DIM > 0 ? DIM : runtime_dim;
  const int whole = dim / 4 * 4;
  __m512 acc[HN][4];
  for (int h = 0; h < HN; ++h)
    for (int c = 0; c < 4; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int i = 0; i < whole; i += 4) {
    __m512 key[4];
    for (int c = 0; c < 4; ++c) {
      const void* row = element<T>(k, (i + c) * k_stride);
      key[c] = live == 0xffff ? load<T>(row) : load<T>(row, live);
    }
    for (int h = 0; h < HN; ++h)
      for (int c = 0; c < 4; ++c)
        acc[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * dim + i + c]), key[c], acc[h][c]);
  }
  __m512 sum[HN];
  for (int h = 0; h < HN; ++h)
    sum[h] =
        _mm512_add_ps(_mm512_add_ps(acc[h][0], acc[h][1]), _mm512_add_ps(acc[h][2], acc[h][3]));
  for (int i = whole; i < dim; ++i) {
    const __m512 key = load<T>(element<T>(k, i * k_stride), live);
    for (int h = 0; h < HN; ++h)
      sum[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * dim + i]), key, sum[h]);
  }
  for (int h = 0; h < HN; ++h) {
    _mm512_mask_storeu_ps(s + h * stride, live, sum[h]);
    const float most = _mm512_mask_reduce_max_ps(live, sum[h]);
    top[h] = first || most > top[h] ? most : top[h];
  }
}

template <DType T, int DIM>
PYSERVE_AVX512 void score_as(const float* q, int group, int dim, const void* k, int64_t k_stride,
                             int tokens, float* s, int stride, float* top) {
  for (int t0 = 0; t0 < tokens; t0 += 16) {
    const __mmask16 live = lanes(tokens - t0);
    const void* tile = element<T>(k, t0);
    for (int h = 0; h < group; h += 4) {
      const float* qh = q + h * dim;
      float* sh = s + h * stride + t0;
      const bool first = t0 == 0;
      switch (group - h) {
        case 1:
          score_heads<T, 1, DIM>(qh, dim, tile, k_stride, live, sh, stride, top + h, first);
          break;
        case 2:
          score_heads<T, 2, DIM>(qh, dim, tile, k_stride, live, sh, stride, top + h, first);
          break;
        case 3:
          score_heads<T, 3, DIM>(qh, dim, tile, k_stride, live, sh, stride, top + h, first);
          break;
        default:
          score_heads<T, 4, DIM>(qh, dim, tile, k_stride, live, sh, stride, top + h, first);
      }
    }
  }
}

template <DType T>
PYSERVE_AVX512 void score_for(const float* q, int group, int dim, const void* k, int64_t k_stride,
                              int tokens, float* s, int stride, float* top) {
  if (dim == 64) return score_as<T, 64>(q, group, dim, k, k_stride, tokens, s, stride, top);
  if (dim == 128) return score_as<T, 128>(q, group, dim, k, k_stride, tokens, s, stride, top);
  return score_as<T, 0>(q, group, dim, k, k_stride, tokens, s, stride, top);
}

PYSERVE_AVX512 void score(DType cache, const float* q, int group, int dim, const void* k,
                          int64_t k_stride, int tokens, float* s, int stride, float* top) {
  switch (cache) {
    case DType::kFloat32:
      return score_for<DType::kFloat32>(q, group, dim, k, k_stride, tokens, s, stride, top);
    case DType::kBFloat16:
      return score_for<DType::kBFloat16>(q, group, dim, k, k_stride, tokens, s, stride, top);
    case DType::kFloat16:
      return score_for<DType::kFloat16>(q, group, dim, k, k_stride, tokens, s, stride, top);
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
