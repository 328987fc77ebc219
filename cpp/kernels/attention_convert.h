// Scalar element conversions for the attention kernel: bf16 and fp16 to and from float, rounding
// to nearest even as torch does (fp16 → float itself is half.h's); the scalar loops' tanh.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "arg_checks.h"
#include "attention.h"
#include "half.h"

namespace pyserve_kernels {

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline uint16_t float_to_half(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // nan
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (magnitude < 0x38800000u) {               // below the smallest normal: a subnormal or zero
    if (magnitude < 0x33000000u) return sign;  // under half the smallest subnormal
    const uint32_t exponent = magnitude >> 23;
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // value in units of 2^-24, in [14, 24]
    uint32_t value = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (value & 1u))) ++value;
    return static_cast<uint16_t>(sign | value);
  }
  uint32_t value = magnitude - (112u << 23);  // rebias the exponent
  value += 0xfffu + ((value >> 13) & 1u);     // round the 13 dropped bits to nearest even
  return static_cast<uint16_t>(sign | (value >> 13));
}

inline float load_element(DType type, const void* base, int64_t i) {
  switch (type) {
    case DType::kFloat32:
      return static_cast<const float*>(base)[i];
    case DType::kBFloat16:
      return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat16:
      return half_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kInt8:  // the raw value: its scale is applied by the caller
      return static_cast<float>(static_cast<const int8_t*>(base)[i]);
  }
  return 0.0f;
}

inline void store_element(DType type, void* base, int64_t i, float value) {
  switch (type) {
    case DType::kFloat32:
      static_cast<float*>(base)[i] = value;
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(base)[i] = float_to_bf16(value);
      return;
    case DType::kFloat16:
      static_cast<uint16_t*>(base)[i] = float_to_half(value);
      return;
    case DType::kInt8:  // never a q or output dtype; caches are written by quantize_int8_head
      return;
  }
}

inline int element_bytes(DType type) {
  return type == DType::kFloat32 ? 4 : type == DType::kInt8 ? 1 : 2;
}

// The checks of a cache's dtype code, and that its scales come with it exactly when it is int8.
inline void check_cache_dtype(DType cache, const void* k_scale, const void* v_scale) {
  check(cache == DType::kFloat32 || cache == DType::kBFloat16 || cache == DType::kFloat16 ||
            cache == DType::kInt8,
        "cache dtype codes: 0 float32, 1 bfloat16, 2 float16, 3 int8");
  check((cache == DType::kInt8) == (k_scale != nullptr && v_scale != nullptr),
        "an int8 cache comes with its K and V scales, and only an int8 cache");
}

// One head's values x[0..dim) as llama.cpp's q8_0, as pyserve/worker/kv_cache.py's
// quantize_int8 bit for bit: value i at out[i·stride], each group of kInt8Group values (the last
// one shorter) symmetric int8 with its float16 scale at scales[g·scale_stride]. The scale is
// max|x| / 127 in float32, clamped to float16's largest and rounded to nearest even; the values
// are x times the float32 reciprocal of the scale as stored, rounded to nearest even, clamped to
// ±127 (a scale of 0, all zeros or an underflow, gives values 0).
inline void quantize_int8_head(const float* x, int dim, int8_t* out, int64_t stride,
                               uint16_t* scales, int64_t scale_stride) {
  for (int g = 0, start = 0; start < dim; ++g, start += kInt8Group) {
    const int end = std::min(dim, start + kInt8Group);
    float top = 0.0f;
    for (int i = start; i < end; ++i) top = std::max(top, std::fabs(x[i]));
    const uint16_t scale = float_to_half(std::min(top / 127.0f, 65504.0f));
    scales[g * scale_stride] = scale;
    const float wide = half_to_float(scale);
    const float inverse = wide > 0.0f ? 1.0f / wide : 0.0f;
    for (int i = start; i < end; ++i) {
      const float q = std::nearbyint(x[i] * inverse);
      out[i * stride] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
    }
  }
}

// tanh rounded from double: the float tanhf of glibc is off by up to ~2 ulp, more than the
// vector loops' (avx512_math.h)
inline float tanh_float(float x) { return static_cast<float>(std::tanh(static_cast<double>(x))); }

}  // namespace pyserve_kernels
