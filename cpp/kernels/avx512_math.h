// AVX-512 helpers shared by the attention and layer-op loops: tail masks, loads of float32 /
// bf16 / fp16 elements as floats, a polynomial exp, and float → bf16. Function-level target
// attributes: including files build with the default flags.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include <cstdint>

#include "attention.h"  // DType

#define PYSERVE_AVX512_MATH __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

namespace pyserve_kernels {
namespace avx512 {

inline __mmask16 lanes(int left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
}

// exp(x) for x ≤ 0: x = n·ln2 + r, |r| ≤ ln2/2, exp(r) by Cephes' degree-6 polynomial, times 2^n
// (scalef). Relative error ~2e-7. A NaN stays NaN (max returns its second operand then).
PYSERVE_AVX512_MATH inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// tanh(x) within 1.5 ulp (tests/test_attention_kernel.py measures it against float64): below
// |x| = 0.625 Cephes' odd polynomial, above it 1 − 2e / (1 + e) with e = exp(−2|x|) ≤ 0.29,
// which neither overflows nor loses e's digits to a cancellation, the sign put back. A NaN
// stays NaN.
PYSERVE_AVX512_MATH inline __m512 tanh(__m512 x) {
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
  const __m512 magnitude = _mm512_abs_ps(x);
  const __m512 e = exp_nonpositive(_mm512_mul_ps(magnitude, _mm512_set1_ps(-2.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 large = _mm512_sub_ps(one, _mm512_div_ps(_mm512_add_ps(e, e), _mm512_add_ps(one, e)));
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  large = _mm512_mask_sub_ps(large, negative, _mm512_setzero_ps(), large);
  const __mmask16 near_zero = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(near_zero, large, small);
}

// The address of element i of an array of T.
template <DType T>
inline const void* element(const void* base, int64_t i) {
  constexpr int bytes = T == DType::kFloat32 ? 4 : T == DType::kInt8 ? 1 : 2;
  return static_cast<const char*>(base) + i * bytes;
}

// 16 (or the masked lanes of 16) elements of type T from `p`, as floats.
template <DType T>
PYSERVE_AVX512_MATH inline __m512 load(const void* p, __mmask16 live) {
  if constexpr (T == DType::kFloat32) {
    return _mm512_maskz_loadu_ps(live, p);
  } else if constexpr (T == DType::kInt8) {  // the raw values (kInt8's scale is the caller's)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(live, p)));
  } else {
    const __m256i raw = _mm256_maskz_loadu_epi16(live, p);
    if constexpr (T == DType::kBFloat16)
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    else
      return _mm512_cvtph_ps(raw);
  }
}

template <DType T>
PYSERVE_AVX512_MATH inline __m512 load(const void* p) {
  if constexpr (T == DType::kFloat32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (T == DType::kInt8) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))));
  } else {
    const __m256i raw = _mm256_loadu_si256(static_cast<const __m256i*>(p));
    if constexpr (T == DType::kBFloat16)
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    else
      return _mm512_cvtph_ps(raw);
  }
}

// The bf16 bits of 16 floats, rounded to nearest even; a NaN stays a (quiet) NaN.
PYSERVE_AVX512_MATH inline __m512i bf16_bits32(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
}

// v as bf16 would hold it, still as floats.
PYSERVE_AVX512_MATH inline __m512 round_to_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits32(v), 16));
}

PYSERVE_AVX512_MATH inline void store_bf16(void* p, __mmask16 live, __m512 v) {
  _mm256_mask_storeu_epi16(p, live, _mm512_cvtepi32_epi16(bf16_bits32(v)));
}

}  // namespace avx512
}  // namespace pyserve_kernels

#endif
