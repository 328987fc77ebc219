// Row-wise layer ops of a decoder block, fused: RMSNorm, SiLU(gate)·up, and RoPE with the KV-cache
// write. torch runs each as a
// chain of element-wise ops (RMSNorm: pow, mean, add, rsqrt, mul, mul), every one a pass over
// memory and a dispatch; a decode step makes ~90 of these calls, so at small batches their fixed
// cost is a large part of a layer.
//
// Semantics follow Hugging Face's modules in float32 and bfloat16 (the reference the worker's
// tests compare with):
//   rms_norm: y = x · rsqrt(mean(x²) + eps), in float32; bf16: y rounded to bf16, then w · y
//             rounded again (HF's `weight * hidden.to(input_dtype)`); float32: w · y. With a
//             residual: x ← x + residual first (rounded to the dtype, as HF's `residual +
//             hidden_states`), stored back into the residual rows, then normalized.
//   silu_mul: out = act(gate) · up, gate and up the two halves of each row, act SiLU or GELU's
//             tanh approximation (F.gelu(approximate="tanh"), Gemma's MLP); bf16: act rounded to
//             bf16 before the product, as F.silu's and F.gelu's bf16 outputs are. Or gpt-oss's
//             clamped SwiGLU (transformers' GptOssExperts._apply_gate): g = min(gate, limit),
//             u = clamp(up, ±limit), out = (u + 1) · (g · sigmoid(g · alpha)), each op rounded
//             as torch's (in bf16: every op's result rounded to bf16, as torch's bf16 ops are).
//   rope_write_kv (float32): the q and k heads of a fused qkv projection row rotated (rotate-half
//             layout, x·cos + swapped(x)·signed_sin with the products and the sum each rounded,
//             as torch's three ops and HF's apply_rotary_pos_emb are: no FMA), q in place; k and
//             v then stored at the row's cache slot, converted to the cache's dtype (float16
//             saturates at ±65504, as kv_cache.py's clamp): K dimension-major within a block.
//             Optionally each q and k head is RMS-normalized first (Qwen3's q_norm / k_norm:
//             w · (x · rsqrt(mean(x²) + eps)), two roundings, as HF's Qwen3RMSNorm in float32),
//             and only a head's first rotary_dim dims rotate (rotate-half within them, HF's
//             partial rotary), the rest passing through.
// Rows may be strided; the elements of a row are contiguous.
#pragma once

#include <cstdint>

#include "attention.h"  // DType

namespace pyserve_kernels {

struct RmsNormArgs {
  DType dtype;  // float32 or bfloat16: x, weight and out alike
  const void* x;
  int64_t x_stride;  // elements between rows
  int rows;
  int hidden;
  const void* weight;  // [hidden]
  float eps;
  void* out;
  int64_t out_stride;
  void* residual = nullptr;  // [rows][hidden], or none: updated in place to x + residual
  int64_t residual_stride = 0;
};

// The activation of a gated MLP's gate.
enum class GatedActivation : int {
  kSilu = 0,
  // 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), computed as x·sigmoid(2·that tanh's argument),
  // the same function without 1 + tanh's cancellation for negative x
  kGeluTanh = 1,
  // gpt-oss's: (clamp(up, ±limit) + 1) · g·sigmoid(alpha·g), g = min(gate, limit)
  kClampedSwiglu = 2,
};

struct SiluMulArgs {
  DType dtype;        // float32 or bfloat16
  const void* input;  // [rows][2·width]: gate, then up
  int64_t input_stride;
  int rows;
  int width;
  void* out;  // [rows][width]
  int64_t out_stride;
  GatedActivation activation = GatedActivation::kSilu;
  float alpha = 0.0f;  // kClampedSwiglu's sigmoid scale and clamp limit (unused otherwise)
  float limit = 0.0f;
};

// gelu_tanh's z = x·(kGeluZ + kGeluZCubed·x²): 2·√(2/π) and that times 0.044715
constexpr double kGeluZ = 1.5957691216057308;
constexpr double kGeluZCubed = 0.07135481627260025;

constexpr int kMaxRopeHeadDim = 1024;  // the vector loops rotate a head in a stack buffer
constexpr float kHalfMax = 65504.0f;   // a float16 cache saturates here instead of storing inf

struct RopeKvArgs {
  float* qkv;  // [rows][(num_heads + 2·num_kv_heads)·head_dim]: q heads, k heads, v heads
  int64_t qkv_stride;
  int rows;
  int num_heads;
  int num_kv_heads;
  int head_dim;          // even
  const float* cos;      // [rows][rotary_dim]
  const float* sin;      // [rows][rotary_dim], negated in the first half (signed_sin of rope.py)
  const int64_t* slots;  // [rows]: block · block_size + offset
  void* k_cache;         // [num_kv_heads][num_blocks][head_dim][block_size]
  void* v_cache;         // [num_kv_heads][num_blocks][block_size][head_dim]
  DType cache_dtype;
  int num_blocks;
  int block_size;
  // The dims of a head that rotate, the first ones (even; 0: all head_dim); i pairs with
  // i + rotary_dim / 2, and dims from rotary_dim on pass through.
  int rotary_dim = 0;
  // [head_dim] float32 RMSNorm weights of every q head and every k head, applied before the
  // rotation (v untouched); null: no norm.
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float norm_eps = 1e-6f;
  // An int8 cache's float16 scales (each token's K and V per kv head quantized in groups of 32,
  // laid out as attention.h's DecodeAttentionArgs says); null otherwise.
  uint16_t* k_scale = nullptr;
  uint16_t* v_scale = nullptr;
};

inline int rotary_dims(const RopeKvArgs& a) { return a.rotary_dim > 0 ? a.rotary_dim : a.head_dim; }

// Per-ISA row loops: rows [row0, row1).
struct LayerOpKernels {
  const char* name;
  void (*rms_norm_rows)(const RmsNormArgs& a, int row0, int row1);
  void (*silu_mul_rows)(const SiluMulArgs& a, int row0, int row1);
  void (*rope_kv_rows)(const RopeKvArgs& a, int row0, int row1);
};

const LayerOpKernels& scalar_layer_ops();
const LayerOpKernels& avx512_layer_ops();

// Check their arguments (std::invalid_argument), then split the rows over the thread pool when
// there are enough elements to pay for it.
void rms_norm(const RmsNormArgs& args);
void silu_mul(const SiluMulArgs& args);      // args.activation's gate · up
void rope_write_kv(const RopeKvArgs& args);  // checks slots against the cache too

}  // namespace pyserve_kernels
