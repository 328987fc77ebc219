// The AVX-512 layer-op loops (AVX-512F/BW/VL): 16 floats a register, masked row tails.
#include "layer_ops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cmath>
#include <type_traits>

#include "attention_convert.h"
#include "avx512_math.h"

namespace pyserve_kernels {
namespace {

using avx512::lanes;

// 16 (masked) elements from base + i, as floats
template <DType T>
PYSERVE_AVX512_MATH inline __m512 load(const void* base, int64_t i, __mmask16 live) {
  return avx512::load<T>(avx512::element<T>(base, i), live);
}

template <DType T>
PYSERVE_AVX512_MATH inline void store(void* base, int64_t i, __mmask16 live, __m512 v) {
  if constexpr (T == DType::kFloat32)
    _mm512_mask_storeu_ps(static_cast<float*>(base) + i, live, v);
  else
    avx512::store_bf16(static_cast<uint16_t*>(base) + i, live, v);
}

template <DType T>
PYSERVE_AVX512_MATH void rms_norm_rows_as(const RmsNormArgs& a, int row0, int row1) {
  for (int r = row0; r < row1; ++r) {
    int64_t in = r * a.x_stride;
    const int64_t out = r * a.out_stride;
    const void* x = a.x;
    __m512 squares = _mm512_setzero_ps();
    if (a.residual != nullptr) {  // x + residual, kept in the residual rows and normalized
      const int64_t sum = r * a.residual_stride;
      for (int i = 0; i < a.hidden; i += 16) {
        const __mmask16 live = lanes(a.hidden - i);
        __m512 v = _mm512_add_ps(load<T>(a.x, in + i, live), load<T>(a.residual, sum + i, live));
        if constexpr (T != DType::kFloat32) v = avx512::round_to_bf16(v);
        store<T>(a.residual, sum + i, live, v);
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      x = a.residual;
      in = sum;
    } else {
      for (int i = 0; i < a.hidden; i += 16) {
        const __m512 v = load<T>(a.x, in + i, lanes(a.hidden - i));
        squares = _mm512_fmadd_ps(v, v, squares);
      }
    }
    const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(a.hidden);
    const __m512 inverse = _mm512_set1_ps(1.0f / std::sqrt(mean + a.eps));
    for (int i = 0; i < a.hidden; i += 16) {
      const __mmask16 live = lanes(a.hidden - i);
      __m512 y = _mm512_mul_ps(load<T>(x, in + i, live), inverse);
      if constexpr (T != DType::kFloat32) y = avx512::round_to_bf16(y);
      store<T>(a.out, out + i, live, _mm512_mul_ps(load<T>(a.weight, i, live), y));
    }
  }
}

PYSERVE_AVX512_MATH inline __m512 silu(__m512 gate) {
  const __m512 one = _mm512_set1_ps(1.0f);
  // sigmoid(g) = 1 / (1 + e) for g ≥ 0 and e / (1 + e) below, e = exp(−|g|) ≤ 1: no overflow
  const __m512 e = avx512::exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gate)));
  const __mmask16 negative = _mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 numerator = _mm512_mask_blend_ps(negative, one, e);
  // 1 / (1 + e) by rcp14 and one Newton step (relative error ~1e-7): a division is much slower
  const __m512 denominator = _mm512_add_ps(one, e);
  __m512 reciprocal = _mm512_rcp14_ps(denominator);
  reciprocal =
      _mm512_mul_ps(reciprocal, _mm512_fnmadd_ps(denominator, reciprocal, _mm512_set1_ps(2.0f)));
  return _mm512_mul_ps(gate, _mm512_mul_ps(numerator, reciprocal));
}

// z = x·(kGeluZ + kGeluZCubed·x²) for 8 lanes, in double
PYSERVE_AVX512_MATH inline __m512d gelu_z(__m256 x) {
  const __m512d xd = _mm512_cvtps_pd(x);
  const __m512d square = _mm512_mul_pd(xd, xd);
  return _mm512_mul_pd(
      xd, _mm512_fmadd_pd(_mm512_set1_pd(kGeluZCubed), square, _mm512_set1_pd(kGeluZ)));
}

// 16 floats from two halves of 8
PYSERVE_AVX512_MATH inline __m512 join(__m256 low, __m256 high) {
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(low)), _mm256_castps_pd(high), 1));
}

// gelu_tanh(x) = x·sigmoid(z) as the scalar loop's (layer_ops.cpp). z in double, then as floats
// z_hi + z_lo, so that exp(−|z|) = exp(−|z_hi|)·(1 ∓ z_lo) keeps its float precision out to
// |z| = 87 (with z in float, an ulp of z is |z| ulps of exp(−|z|)); past it (x < −9.9) the
// result is −0 instead of |x|·1e-38 or less.
PYSERVE_AVX512_MATH inline __m512 gelu_tanh(__m512 x) {
  const __m256 x_low = _mm512_castps512_ps256(x);
  const __m256 x_high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
  const __m512d z_low = gelu_z(x_low), z_high = gelu_z(x_high);
  const __m256 hi_low = _mm512_cvtpd_ps(z_low), hi_high = _mm512_cvtpd_ps(z_high);
  const __m256 lo_low = _mm512_cvtpd_ps(_mm512_sub_pd(z_low, _mm512_cvtps_pd(hi_low)));
  const __m256 lo_high = _mm512_cvtpd_ps(_mm512_sub_pd(z_high, _mm512_cvtps_pd(hi_high)));
  const __m512 hi = join(hi_low, hi_high), lo = join(lo_low, lo_high);
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  const __mmask16 negative = _mm512_cmp_ps_mask(hi, zero, _CMP_LT_OQ);
  // −|z| = −|z_hi| − sign(z_hi)·z_lo
  const __m512 minus_lo = _mm512_mask_blend_ps(negative, _mm512_sub_ps(zero, lo), lo);
  const __m512 magnitude = _mm512_abs_ps(hi);
  __m512 e = avx512::exp_nonpositive(_mm512_sub_ps(zero, magnitude));
  e = _mm512_fmadd_ps(e, minus_lo, e);
  // past exp's clamp (z_lo is NaN for an infinite z): e ≤ 1.6e-38, taken as 0
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(87.0f), _CMP_GE_OQ), zero);
  // sigmoid(z) = 1 / (1 + e) for z ≥ 0 and e / (1 + e) below: no overflow
  const __m512 numerator = _mm512_mask_blend_ps(negative, one, e);
  return _mm512_div_ps(_mm512_mul_ps(x, numerator), _mm512_add_ps(one, e));
}

// what the dtype T holds of v: v itself in float32, v rounded to bf16 otherwise
template <DType T>
PYSERVE_AVX512_MATH inline __m512 as_dtype(__m512 v) {
  if constexpr (T == DType::kFloat32)
    return v;
  else
    return avx512::round_to_bf16(v);
}

// The scalar loop's clamped SwiGLU (layer_ops.cpp), its ops in the same order and rounded to T
// as it rounds them; sigmoid(z) = 1 / (1 + e) for z ≥ 0 and e / (1 + e) below, e = exp(−|z|) ≤ 1
// (no overflow), taken as 0 for z ≤ −87, where exp's clamp would leave ~1e-38 and torch's
// 1 / (1 + exp(−z)) gives 0 or a denormal. min / max return their second operand when one is
// NaN: a NaN gate or up stays NaN, as torch's clamp keeps it.
template <DType T>
PYSERVE_AVX512_MATH inline __m512 clamped_swiglu(__m512 gate, __m512 up, __m512 alpha,
                                                 __m512 limit) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  const __m512 g = as_dtype<T>(_mm512_min_ps(limit, gate));
  const __m512 u = as_dtype<T>(_mm512_min_ps(limit, _mm512_max_ps(_mm512_sub_ps(zero, limit), up)));
  const __m512 z = as_dtype<T>(_mm512_mul_ps(g, alpha));
  const __m512 magnitude = _mm512_abs_ps(z);
  __m512 e = avx512::exp_nonpositive(_mm512_sub_ps(zero, magnitude));
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(87.0f), _CMP_GE_OQ), zero);
  const __mmask16 negative = _mm512_cmp_ps_mask(z, zero, _CMP_LT_OQ);
  const __m512 numerator = _mm512_mask_blend_ps(negative, one, e);
  const __m512 sigmoid = as_dtype<T>(_mm512_div_ps(numerator, _mm512_add_ps(one, e)));
  const __m512 glu = as_dtype<T>(_mm512_mul_ps(g, sigmoid));
  return _mm512_mul_ps(as_dtype<T>(_mm512_add_ps(u, one)), glu);
}

template <DType T>
PYSERVE_AVX512_MATH void clamped_swiglu_rows_as(const SiluMulArgs& a, int row0, int row1) {
  const __m512 alpha = _mm512_set1_ps(a.alpha), limit = _mm512_set1_ps(a.limit);
  for (int r = row0; r < row1; ++r) {
    const int64_t in = r * a.input_stride, out = r * a.out_stride;
    for (int i = 0; i < a.width; i += 16) {
      const __mmask16 live = lanes(a.width - i);
      const __m512 gate = load<T>(a.input, in + i, live);
      const __m512 up = load<T>(a.input, in + a.width + i, live);
      store<T>(a.out, out + i, live, clamped_swiglu<T>(gate, up, alpha, limit));
    }
  }
}

template <DType T, GatedActivation A>
PYSERVE_AVX512_MATH void gated_mul_rows_as(const SiluMulArgs& a, int row0, int row1) {
  for (int r = row0; r < row1; ++r) {
    const int64_t in = r * a.input_stride, out = r * a.out_stride;
    for (int i = 0; i < a.width; i += 16) {
      const __mmask16 live = lanes(a.width - i);
      const __m512 gate = load<T>(a.input, in + i, live);
      __m512 act;
      if constexpr (A == GatedActivation::kSilu)
        act = silu(gate);
      else
        act = gelu_tanh(gate);
      if constexpr (T != DType::kFloat32) act = avx512::round_to_bf16(act);
      store<T>(a.out, out + i, live, _mm512_mul_ps(act, load<T>(a.input, in + a.width + i, live)));
    }
  }
}

// x·cos + swapped(x)·signed_sin, each product and the sum rounded (the explicit-rounding forms
// are never contracted into an FMA)
PYSERVE_AVX512_MATH inline __m512 rotate(__m512 x, __m512 c, __m512 swapped, __m512 sn) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return _mm512_add_round_ps(_mm512_mul_round_ps(x, c, kRound),
                             _mm512_mul_round_ps(swapped, sn, kRound), kRound);
}

template <DType C>
PYSERVE_AVX512_MATH inline void store_cache(void* base, int64_t i, __mmask16 live, __m512 v) {
  if constexpr (C == DType::kFloat32) {
    _mm512_mask_storeu_ps(static_cast<float*>(base) + i, live, v);
  } else if constexpr (C == DType::kBFloat16) {
    avx512::store_bf16(static_cast<uint16_t*>(base) + i, live, v);
  } else {
    const __m512 top = _mm512_set1_ps(kHalfMax);
    v = _mm512_max_ps(_mm512_min_ps(v, top), _mm512_sub_ps(_mm512_setzero_ps(), top));
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(base) + i, live,
                             _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// The first `rotary` dims of one head of the row rotated into `out` (may be `head` itself):
// element i of the first half pairs with i + half, so each pair of loads gives both halves'
// results.
PYSERVE_AVX512_MATH inline void rotate_head(const float* head, const float* c, const float* sn,
                                            int rotary, float* out) {
  const int half = rotary / 2;
  for (int i = 0; i < half; i += 16) {
    const __mmask16 live = lanes(half - i);
    const __m512 first = _mm512_maskz_loadu_ps(live, head + i);
    const __m512 second = _mm512_maskz_loadu_ps(live, head + half + i);
    _mm512_mask_storeu_ps(out + i, live,
                          rotate(first, _mm512_maskz_loadu_ps(live, c + i), second,
                                 _mm512_maskz_loadu_ps(live, sn + i)));
    _mm512_mask_storeu_ps(out + half + i, live,
                          rotate(second, _mm512_maskz_loadu_ps(live, c + half + i), first,
                                 _mm512_maskz_loadu_ps(live, sn + half + i)));
  }
}

// out[i] = from[i] for i in [begin, end)
PYSERVE_AVX512_MATH inline void copy_dims(const float* from, int begin, int end, float* out) {
  for (int i = begin; i < end; i += 16) {
    const __mmask16 live = lanes(end - i);
    _mm512_mask_storeu_ps(out + i, live, _mm512_maskz_loadu_ps(live, from + i));
  }
}

// out = w · (x · rsqrt(mean(x²) + eps)) over one head, as the scalar loop (two roundings)
PYSERVE_AVX512_MATH inline void norm_head(const float* x, const float* w, int dim, float eps,
                                          float* out) {
  __m512 squares = _mm512_setzero_ps();
  for (int i = 0; i < dim; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(lanes(dim - i), x + i);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(dim);
  const __m512 inverse = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int i = 0; i < dim; i += 16) {
    const __mmask16 live = lanes(dim - i);
    const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, x + i), inverse);
    _mm512_mask_storeu_ps(out + i, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, w + i), y));
  }
}

// EXTRAS: the q/k norm and partial rotary (as the arguments say); without, the whole-head rotation
// compiles as it did before them.
template <DType C, bool EXTRAS>
PYSERVE_AVX512_MATH void rope_kv_rows_as(const RopeKvArgs& a, int row0, int row1) {
  const int dim = a.head_dim, rotary = EXTRAS ? rotary_dims(a) : dim, bs = a.block_size;
  alignas(64) float rotated[kMaxRopeHeadDim];
  alignas(64) float normed[EXTRAS ? kMaxRopeHeadDim : 1];
  for (int r = row0; r < row1; ++r) {
    float* x = a.qkv + r * a.qkv_stride;
    const float* c = a.cos + static_cast<int64_t>(r) * rotary;
    const float* sn = a.sin + static_cast<int64_t>(r) * rotary;
    const int64_t block = a.slots[r] / bs, offset = a.slots[r] % bs;
    for (int h = 0; h < a.num_heads; ++h) {  // q: in place
      float* head = x + static_cast<int64_t>(h) * dim;
      const float* from = head;
      if constexpr (EXTRAS) {
        if (a.q_norm != nullptr) {
          norm_head(head, a.q_norm, dim, a.norm_eps, normed);
          from = normed;
          copy_dims(normed, rotary, dim, head);
        }
      }
      rotate_head(from, c, sn, rotary, head);
    }
    for (int h = 0; h < a.num_kv_heads; ++h) {
      const float* from = x + static_cast<int64_t>(a.num_heads + h) * dim;
      if constexpr (EXTRAS) {
        if (a.k_norm != nullptr) {
          norm_head(from, a.k_norm, dim, a.norm_eps, normed);
          from = normed;
        }
      }
      rotate_head(from, c, sn, rotary, rotated);
      if constexpr (EXTRAS) copy_dims(from, rotary, dim, rotated);
      if constexpr (C == DType::kInt8) {  // the scalar loop's quantization, group by group
        const int64_t token = (h * int64_t{a.num_blocks} + block) * bs + offset;
        const int64_t groups = int8_groups(dim);
        int8_t* k = static_cast<int8_t*>(a.k_cache) + (token - offset) * dim + offset;
        quantize_int8_head(rotated, dim, k, bs, a.k_scale + (token - offset) * groups + offset, bs);
        const float* v = x + static_cast<int64_t>(a.num_heads + a.num_kv_heads + h) * dim;
        quantize_int8_head(v, dim, static_cast<int8_t*>(a.v_cache) + token * dim, 1,
                           a.v_scale + token * groups, 1);
        continue;
      } else {
        // converted as a vector, then element by element into the block: K is dimension-major,
        // element i of this token is bs apart from i + 1
        using Element = std::conditional_t<C == DType::kFloat32, float, uint16_t>;
        alignas(64) Element converted[kMaxRopeHeadDim];
        for (int i = 0; i < dim; i += 16)
          store_cache<C>(converted, i, lanes(dim - i), _mm512_load_ps(rotated + i));
        Element* k =
            static_cast<Element*>(a.k_cache) + (h * int64_t{a.num_blocks} + block) * bs * dim;
        for (int i = 0; i < dim; ++i) k[i * bs + offset] = converted[i];
        const float* v = x + static_cast<int64_t>(a.num_heads + a.num_kv_heads + h) * dim;
        const int64_t v_base = ((h * int64_t{a.num_blocks} + block) * bs + offset) * dim;
        for (int i = 0; i < dim; i += 16) {
          const __mmask16 live = lanes(dim - i);
          store_cache<C>(a.v_cache, v_base + i, live, _mm512_maskz_loadu_ps(live, v + i));
        }
      }
    }
  }
}

template <bool EXTRAS>
void rope_kv_rows_for(const RopeKvArgs& a, int row0, int row1) {
  switch (a.cache_dtype) {
    case DType::kFloat32:
      return rope_kv_rows_as<DType::kFloat32, EXTRAS>(a, row0, row1);
    case DType::kBFloat16:
      return rope_kv_rows_as<DType::kBFloat16, EXTRAS>(a, row0, row1);
    case DType::kFloat16:
      return rope_kv_rows_as<DType::kFloat16, EXTRAS>(a, row0, row1);
    case DType::kInt8:
      return rope_kv_rows_as<DType::kInt8, EXTRAS>(a, row0, row1);
  }
}

void rope_kv_rows(const RopeKvArgs& a, int row0, int row1) {
  if (a.q_norm != nullptr || a.k_norm != nullptr || rotary_dims(a) != a.head_dim)
    return rope_kv_rows_for<true>(a, row0, row1);
  return rope_kv_rows_for<false>(a, row0, row1);
}

void rms_norm_rows(const RmsNormArgs& a, int row0, int row1) {
  if (a.dtype == DType::kFloat32) return rms_norm_rows_as<DType::kFloat32>(a, row0, row1);
  return rms_norm_rows_as<DType::kBFloat16>(a, row0, row1);
}

void silu_mul_rows(const SiluMulArgs& a, int row0, int row1) {
  constexpr auto kSilu = GatedActivation::kSilu, kGelu = GatedActivation::kGeluTanh;
  const bool f32 = a.dtype == DType::kFloat32;
  if (a.activation == GatedActivation::kClampedSwiglu)
    return f32 ? clamped_swiglu_rows_as<DType::kFloat32>(a, row0, row1)
               : clamped_swiglu_rows_as<DType::kBFloat16>(a, row0, row1);
  if (a.activation == kGelu)
    return f32 ? gated_mul_rows_as<DType::kFloat32, kGelu>(a, row0, row1)
               : gated_mul_rows_as<DType::kBFloat16, kGelu>(a, row0, row1);
  return f32 ? gated_mul_rows_as<DType::kFloat32, kSilu>(a, row0, row1)
             : gated_mul_rows_as<DType::kBFloat16, kSilu>(a, row0, row1);
}

}  // namespace

const LayerOpKernels& avx512_layer_ops() {
  static const LayerOpKernels table{"avx512", rms_norm_rows, silu_mul_rows, rope_kv_rows};
  return table;
}

}  // namespace pyserve_kernels

#else  // not x86-64 with GCC/Clang: never selected (the ISA check says no)

namespace pyserve_kernels {
const LayerOpKernels& avx512_layer_ops() { return scalar_layer_ops(); }
}  // namespace pyserve_kernels

#endif
