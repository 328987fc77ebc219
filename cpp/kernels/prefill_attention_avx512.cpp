// The AVX-512 prefill-attention loops: every vector holds one value for each of a work item's 16
// query rows, so scores, the causal mask, the online softmax and the output accumulate with
// plain vertical ops (cost per row and key: dim FMAs for the score, dim for the output, and an
// exp shared by 16 rows). Function-level target attributes: this file builds with the default
// flags.
#include "prefill_attention.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include <limits>

#include "avx512_math.h"

#define PYSERVE_AVX512 PYSERVE_AVX512_MATH

namespace pyserve_kernels {
namespace {

using avx512::element;
using avx512::exp_nonpositive;
using avx512::lanes;
using avx512::load;

template <DType T>
PYSERVE_AVX512 void to_float_as(const void* src, int64_t n, float* dst) {
  constexpr int bytes = T == DType::kFloat32 ? 4 : T == DType::kInt8 ? 1 : 2;
  const char* from = static_cast<const char*>(src);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load<T>(from + i * bytes));
  if (i < n) {
    const __mmask16 live = lanes(static_cast<int>(n - i));
    _mm512_mask_storeu_ps(dst + i, live, load<T>(from + i * bytes, live));
  }
}

PYSERVE_AVX512 void to_float(DType type, const void* src, int64_t n, float* dst) {
  switch (type) {
    case DType::kFloat32:
      return to_float_as<DType::kFloat32>(src, n, dst);
    case DType::kBFloat16:
      return to_float_as<DType::kBFloat16>(src, n, dst);
    case DType::kFloat16:
      return to_float_as<DType::kFloat16>(src, n, dst);
    case DType::kInt8:
      return to_float_as<DType::kInt8>(src, n, dst);
  }
}

template <DType T>
PYSERVE_AVX512 void keys_to_float_as(const void* src, int64_t stride, int dim, int n, float* dst) {
  const __mmask16 live = lanes(n);
  for (int i = 0; i < dim; ++i)
    _mm512_storeu_ps(dst + i * kPrefillRows, load<T>(element<T>(src, i * stride), live));
}

PYSERVE_AVX512 void keys_to_float(DType type, const void* src, int64_t stride, int dim, int n,
                                  float* dst) {
  switch (type) {
    case DType::kFloat32:
      return keys_to_float_as<DType::kFloat32>(src, stride, dim, n, dst);
    case DType::kBFloat16:
      return keys_to_float_as<DType::kBFloat16>(src, stride, dim, n, dst);
    case DType::kFloat16:
      return keys_to_float_as<DType::kFloat16>(src, stride, dim, n, dst);
    case DType::kInt8:
      return keys_to_float_as<DType::kInt8>(src, stride, dim, n, dst);
  }
}

// r[i] lane j ← r[j] lane i.
PYSERVE_AVX512 inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
  }
}

template <DType T>
PYSERVE_AVX512 void load_queries_as(const void* q, int64_t stride, int rows, int dim, float scale,
                                    float* qt) {
  const __m512 factor = _mm512_set1_ps(scale);
  for (int c = 0; c < dim; c += 16) {
    const __mmask16 live = lanes(dim - c);
    __m512 r[16];
    for (int j = 0; j < 16; ++j)
      r[j] = j < rows ? _mm512_mul_ps(load<T>(element<T>(q, j * stride + c), live), factor)
                      : _mm512_setzero_ps();
    transpose16(r);
    for (int i = 0; i < 16 && c + i < dim; ++i) _mm512_storeu_ps(qt + (c + i) * kPrefillRows, r[i]);
  }
}

PYSERVE_AVX512 void load_queries(DType type, const void* q, int64_t stride, int rows, int dim,
                                 float scale, float* qt) {
  switch (type) {
    case DType::kFloat32:
      return load_queries_as<DType::kFloat32>(q, stride, rows, dim, scale, qt);
    case DType::kBFloat16:
      return load_queries_as<DType::kBFloat16>(q, stride, rows, dim, scale, qt);
    case DType::kFloat16:
      return load_queries_as<DType::kFloat16>(q, stride, rows, dim, scale, qt);
    case DType::kInt8:  // a cache dtype only: check_args refuses int8 queries
      return;
  }
}

template <DType T>
PYSERVE_AVX512 void store_output_as(const float* ot, const float* l, int rows, int dim, void* out,
                                    int64_t stride) {
  const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(l));
  for (int c = 0; c < dim; c += 16) {
    const __mmask16 live = lanes(dim - c);
    __m512 r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = c + i < dim ? _mm512_mul_ps(_mm512_loadu_ps(ot + (c + i) * kPrefillRows), inverse)
                         : _mm512_setzero_ps();
    transpose16(r);
    for (int j = 0; j < rows; ++j) {
      char* at = static_cast<char*>(out) + (j * stride + c) * (T == DType::kFloat32 ? 4 : 2);
      if constexpr (T == DType::kFloat32)
        _mm512_mask_storeu_ps(at, live, r[j]);
      else if constexpr (T == DType::kBFloat16)
        avx512::store_bf16(at, live, r[j]);
      else
        _mm256_mask_storeu_epi16(at, live, _mm512_cvtps_ph(r[j], _MM_FROUND_TO_NEAREST_INT));
    }
  }
}

PYSERVE_AVX512 void store_output(DType type, const float* ot, const float* l, int rows, int dim,
                                 void* out, int64_t stride) {
  switch (type) {
    case DType::kFloat32:
      return store_output_as<DType::kFloat32>(ot, l, rows, dim, out, stride);
    case DType::kBFloat16:
      return store_output_as<DType::kBFloat16>(ot, l, rows, dim, out, stride);
    case DType::kFloat16:
      return store_output_as<DType::kFloat16>(ot, l, rows, dim, out, stride);
    case DType::kInt8:  // a cache dtype only: check_args refuses int8 queries
      return;
  }
}

// The rows that may see key t: row j where t ≤ limit + j, i.e. j ≥ t − limit.
inline __mmask16 rows_seeing(int t, int limit) {
  const int first = t - limit;
  if (first <= 0) return static_cast<__mmask16>(0xffff);
  if (first >= 16) return 0;
  return static_cast<__mmask16>(0xffffu << first);
}

// The rows within the window of key t: row j where t > limit + j − window, i.e. j < t − limit +
// window (all rows without a window).
inline __mmask16 rows_within(int t, int limit, int window) {
  if (window <= 0) return static_cast<__mmask16>(0xffff);
  const int end = t - limit + window;
  if (end >= 16) return static_cast<__mmask16>(0xffff);
  if (end <= 0) return 0;
  return static_cast<__mmask16>((1u << end) - 1u);
}

// ot[d0 + i] = ot[d0 + i]·factor + Σ_t p[t]·v[t][d0 + i] for i < W: W output vectors in
// registers, independent FMA chains (the token loop stays outside: with it inside, one chain of
// dependent FMAs would wait on each other's latency).
template <int W>
PYSERVE_AVX512 inline void accumulate(const float* p, const float* v, int tokens, int dim, int d0,
                                      __m512 factor, float* ot) {
  __m512 acc[W];
  for (int i = 0; i < W; ++i)
    acc[i] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + i) * kPrefillRows), factor);
#pragma GCC unroll 1
  for (int t = 0; t < tokens; ++t) {
    const __m512 weight = _mm512_load_ps(p + t * kPrefillRows);
    const float* row = v + t * dim + d0;
    for (int i = 0; i < W; ++i) acc[i] = _mm512_fmadd_ps(weight, _mm512_set1_ps(row[i]), acc[i]);
  }
  for (int i = 0; i < W; ++i) _mm512_storeu_ps(ot + (d0 + i) * kPrefillRows, acc[i]);
}

// DIM > 0: head_dim known at compile time (a multiple of 16): every K/V element's address is a
// constant offset from one register. DIM == 0: any head_dim. EXTRAS: the window and softcap
// (runtime values) apply; without, plain causal attention compiles as it did before them.
template <int DIM, bool EXTRAS>
PYSERVE_AVX512 void tile_as(const float* qt, const float* k, const float* v, int tokens,
                            int runtime_dim, int limit, int window, float softcap, float* m,
                            float* l, float* ot) {
  const int dim = DIM > 0 ? DIM : runtime_dim;
  // scores of all 16 keys (keys ≥ tokens are zeros: masked below)
  __m512 s[16];
  for (int t = 0; t < 16; ++t) s[t] = _mm512_setzero_ps();
  for (int i = 0; i < dim; ++i) {
    const __m512 q = _mm512_loadu_ps(qt + i * kPrefillRows);
    for (int t = 0; t < 16; ++t)
      s[t] = _mm512_fmadd_ps(q, _mm512_set1_ps(k[i * kPrefillRows + t]), s[t]);
  }
  if constexpr (EXTRAS) {
    if (softcap > 0.0f) {
      const __m512 cap = _mm512_set1_ps(softcap), inverse = _mm512_set1_ps(1.0f / softcap);
      for (int t = 0; t < 16; ++t)  // keys ≥ tokens too: constant indices keep s in registers
        s[t] = _mm512_mul_ps(cap, avx512::tanh(_mm512_mul_ps(s[t], inverse)));
    }
  }
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 m_old = _mm512_loadu_ps(m);
  __m512 top = m_old;
  __mmask16 seen[16];
  for (int t = 0; t < 16; ++t) {
    seen[t] = t < tokens ? rows_seeing(t, limit) : 0;
    if constexpr (EXTRAS) seen[t] &= rows_within(t, limit, window);
    top = _mm512_mask_max_ps(top, seen[t], top, s[t]);
  }
  // rows that have seen nothing yet keep m = -inf; they shift by 0 so no inf - inf appears
  const __mmask16 none = _mm512_cmp_ps_mask(top, minus_inf, _CMP_EQ_OQ);
  const __m512 shift = _mm512_mask_mov_ps(top, none, _mm512_setzero_ps());
  const __m512 factor = exp_nonpositive(_mm512_sub_ps(m_old, shift));  // ~0 from -inf
  _mm512_storeu_ps(m, top);
  __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(l), factor);
  alignas(64) float p[16 * kPrefillRows];
  for (int t = 0; t < 16; ++t) {
    const __m512 e = _mm512_maskz_mov_ps(seen[t], exp_nonpositive(_mm512_sub_ps(s[t], shift)));
    sum = _mm512_add_ps(sum, e);
    _mm512_store_ps(p + t * kPrefillRows, e);
  }
  _mm512_storeu_ps(l, sum);
  int d0 = 0;
  for (; d0 + 16 <= dim; d0 += 16) accumulate<16>(p, v, tokens, dim, d0, factor, ot);
  if constexpr (DIM == 0) {
    for (; d0 + 4 <= dim; d0 += 4) accumulate<4>(p, v, tokens, dim, d0, factor, ot);
    for (; d0 < dim; ++d0) accumulate<1>(p, v, tokens, dim, d0, factor, ot);
  }
}

template <bool EXTRAS>
PYSERVE_AVX512 void tile_for(const float* qt, const float* k, const float* v, int tokens, int dim,
                             int limit, int window, float softcap, float* m, float* l, float* ot) {
  if (dim == 64)
    return tile_as<64, EXTRAS>(qt, k, v, tokens, dim, limit, window, softcap, m, l, ot);
  if (dim == 128)
    return tile_as<128, EXTRAS>(qt, k, v, tokens, dim, limit, window, softcap, m, l, ot);
  return tile_as<0, EXTRAS>(qt, k, v, tokens, dim, limit, window, softcap, m, l, ot);
}

PYSERVE_AVX512 void tile(const float* qt, const float* k, const float* v, int tokens, int dim,
                         int limit, int window, float softcap, float* m, float* l, float* ot) {
  if (window > 0 || softcap > 0.0f)
    return tile_for<true>(qt, k, v, tokens, dim, limit, window, softcap, m, l, ot);
  return tile_for<false>(qt, k, v, tokens, dim, limit, window, softcap, m, l, ot);
}

}  // namespace

const PrefillKernels& avx512_prefill() {
  static const PrefillKernels table{"avx512",     to_float,     keys_to_float,
                                    load_queries, store_output, tile};
  return table;
}

}  // namespace pyserve_kernels

#else  // not x86-64: the dispatcher never picks this path

namespace pyserve_kernels {
const PrefillKernels& avx512_prefill() { return scalar_prefill(); }
}  // namespace pyserve_kernels

#endif
