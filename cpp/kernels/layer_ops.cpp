// The layer ops' entry points (argument checks, the split over threads) and the scalar loops,
// which any CPU runs and which the vector loops follow.
#include "layer_ops.h"
#include "arg_checks.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_convert.h"
#include "dispatch.h"
#include "thread_pool.h"

namespace pyserve_kernels {
namespace {

// Below this many elements a call runs on the calling thread: waking the pool costs more.
constexpr int64_t kParallelElements = 1 << 14;
// Elements per chunk claimed from the pool.
constexpr int64_t kChunkElements = 1 << 13;

// value as the tensor's dtype holds it
float rounded(DType dtype, float value) {
  return dtype == DType::kFloat32 ? value : bf16_to_float(float_to_bf16(value));
}

const LayerOpKernels& kernels_for_isa() {
  return current_isa() == "avx512_vnni" ? avx512_layer_ops() : scalar_layer_ops();
}

void rms_norm_rows_scalar(const RmsNormArgs& a, int row0, int row1) {
  for (int r = row0; r < row1; ++r) {
    int64_t in = r * a.x_stride;
    const int64_t out = r * a.out_stride;
    const void* x = a.x;
    if (a.residual != nullptr) {  // x + residual, kept in the residual rows and normalized
      const int64_t sum = r * a.residual_stride;
      for (int i = 0; i < a.hidden; ++i)
        store_element(
            a.dtype, a.residual, sum + i,
            load_element(a.dtype, a.x, in + i) + load_element(a.dtype, a.residual, sum + i));
      x = a.residual;
      in = sum;
    }
    float squares = 0.0f;
    for (int i = 0; i < a.hidden; ++i) {
      const float v = load_element(a.dtype, x, in + i);
      squares += v * v;
    }
    const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(a.hidden) + a.eps);
    for (int i = 0; i < a.hidden; ++i) {
      float y = load_element(a.dtype, x, in + i) * inverse;
      y = rounded(a.dtype, y);  // where HF rounds to the tensor's dtype
      store_element(a.dtype, a.out, out + i, load_element(a.dtype, a.weight, i) * y);
    }
  }
}

// gelu_tanh(x) = x·sigmoid(z), z = 2·√(2/π)·(x + 0.044715·x³), in double (the vector loops
// compute z in double too: an error in z is an error in exp(−z), growing with |z|)
float gelu_tanh(float gate) {
  const double x = gate;
  const double z = x * (kGeluZ + kGeluZCubed * x * x);
  return static_cast<float>(x / (1.0 + std::exp(-z)));
}

// transformers' GptOssExperts._apply_gate in torch's order of ops, each result rounded to the
// dtype as torch's ops round it (sigmoid as torch's: 1 / (1 + exp(−z))); the caller rounds the
// final product when it stores it. std::min / std::max keep a NaN gate or up NaN, as clamp does.
float clamped_swiglu(DType dtype, float gate, float up, float alpha, float limit) {
  const float g = rounded(dtype, std::min(gate, limit));
  const float u = rounded(dtype, std::min(std::max(up, -limit), limit));
  const float z = rounded(dtype, g * alpha);
  const float sigmoid = rounded(dtype, 1.0f / (1.0f + std::exp(-z)));
  const float glu = rounded(dtype, g * sigmoid);
  return rounded(dtype, u + 1.0f) * glu;
}

void silu_mul_rows_scalar(const SiluMulArgs& a, int row0, int row1) {
  const bool gelu = a.activation == GatedActivation::kGeluTanh;
  for (int r = row0; r < row1; ++r) {
    const int64_t in = r * a.input_stride, out = r * a.out_stride;
    if (a.activation == GatedActivation::kClampedSwiglu) {
      for (int i = 0; i < a.width; ++i)
        store_element(
            a.dtype, a.out, out + i,
            clamped_swiglu(a.dtype, load_element(a.dtype, a.input, in + i),
                           load_element(a.dtype, a.input, in + a.width + i), a.alpha, a.limit));
      continue;
    }
    for (int i = 0; i < a.width; ++i) {
      const float gate = load_element(a.dtype, a.input, in + i);
      float act = gelu ? gelu_tanh(gate) : gate / (1.0f + std::exp(-gate));
      act = rounded(a.dtype, act);
      store_element(a.dtype, a.out, out + i,
                    act * load_element(a.dtype, a.input, in + a.width + i));
    }
  }
}

// a·b + c·d with each product and the sum rounded to float (no FMA: volatile keeps the compiler
// from contracting), as torch's separate element-wise ops compute it
float sum_of_products(float a, float b, float c, float d) {
  volatile float first = a * b;
  volatile float second = c * d;
  return first + second;
}

float saturated(DType cache, float value) {
  return cache == DType::kFloat16 ? std::min(kHalfMax, std::max(-kHalfMax, value)) : value;
}

// out = w · (x · rsqrt(mean(x²) + eps)) over one head
void norm_head(const float* x, const float* w, int dim, float eps, float* out) {
  float squares = 0.0f;
  for (int i = 0; i < dim; ++i) squares += x[i] * x[i];
  const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
  for (int i = 0; i < dim; ++i) out[i] = w[i] * (x[i] * inverse);
}

void rope_kv_rows_scalar(const RopeKvArgs& a, int row0, int row1) {
  const int dim = a.head_dim, rotary = rotary_dims(a), half = rotary / 2, bs = a.block_size;
  const int64_t groups = int8_groups(dim);
  std::vector<float> rotated(dim), normed(dim);
  for (int r = row0; r < row1; ++r) {
    float* x = a.qkv + r * a.qkv_stride;
    const float* c = a.cos + static_cast<int64_t>(r) * rotary;
    const float* sn = a.sin + static_cast<int64_t>(r) * rotary;
    const int64_t block = a.slots[r] / bs, offset = a.slots[r] % bs;
    for (int h = 0; h < a.num_heads + a.num_kv_heads; ++h) {
      const float* head = x + static_cast<int64_t>(h) * dim;
      const float* weight = h < a.num_heads ? a.q_norm : a.k_norm;
      if (weight != nullptr) {
        norm_head(head, weight, dim, a.norm_eps, normed.data());
        head = normed.data();
      }
      for (int i = 0; i < half; ++i) {  // element i pairs with i + half
        rotated[i] = sum_of_products(head[i], c[i], head[i + half], sn[i]);
        rotated[i + half] = sum_of_products(head[i + half], c[i + half], head[i], sn[i + half]);
      }
      std::copy(head + rotary, head + dim, rotated.begin() + rotary);
      if (h < a.num_heads) {
        std::copy(rotated.begin(), rotated.end(), x + static_cast<int64_t>(h) * dim);
        continue;
      }
      const int64_t base = ((h - a.num_heads) * int64_t{a.num_blocks} + block) * bs * dim;
      if (a.cache_dtype == DType::kInt8) {  // group g's scale at g·bs + offset of the block's
        const int64_t token = ((h - a.num_heads) * int64_t{a.num_blocks} + block) * bs + offset;
        quantize_int8_head(rotated.data(), dim, static_cast<int8_t*>(a.k_cache) + base + offset, bs,
                           a.k_scale + (token - offset) * groups + offset, bs);
        continue;
      }
      for (int i = 0; i < dim; ++i)
        store_element(a.cache_dtype, a.k_cache, base + i * bs + offset,
                      saturated(a.cache_dtype, rotated[i]));
    }
    const float* v = x + static_cast<int64_t>(a.num_heads + a.num_kv_heads) * dim;
    for (int h = 0; h < a.num_kv_heads; ++h) {
      const int64_t base = ((h * int64_t{a.num_blocks} + block) * bs + offset) * dim;
      if (a.cache_dtype == DType::kInt8) {
        quantize_int8_head(v + h * dim, dim, static_cast<int8_t*>(a.v_cache) + base, 1,
                           a.v_scale + base / dim * groups, 1);
        continue;
      }
      for (int i = 0; i < dim; ++i)
        store_element(a.cache_dtype, a.v_cache, base + i, saturated(a.cache_dtype, v[h * dim + i]));
    }
  }
}

template <class Args>
struct RowJob {
  const Args* args;
  void (*rows)(const Args&, int, int);
  int rows_per_chunk;
  int total_rows;
};

template <class Args>
void row_chunk(void* context, int chunk) {
  const auto& job = *static_cast<const RowJob<Args>*>(context);
  const int row0 = chunk * job.rows_per_chunk;
  job.rows(*job.args, row0, std::min(job.total_rows, row0 + job.rows_per_chunk));
}

template <class Args>
void run_rows(const Args& args, void (*rows)(const Args&, int, int), int width) {
  const int64_t elements = static_cast<int64_t>(args.rows) * width;
  ThreadPool& pool = ThreadPool::instance();
  if (elements < kParallelElements || pool.size() == 1 || args.rows < 2) {
    rows(args, 0, args.rows);
    return;
  }
  const int per_chunk = static_cast<int>(std::max<int64_t>(1, kChunkElements / width));
  RowJob<Args> job{&args, rows, per_chunk, args.rows};
  pool.run(row_chunk<Args>, &job, (args.rows + per_chunk - 1) / per_chunk);
}

void check_common(DType dtype, int rows, int width, int64_t in_stride, int64_t in_width,
                  int64_t out_stride, const void* in, const void* out) {
  check(dtype == DType::kFloat32 || dtype == DType::kBFloat16,
        "layer ops take float32 or bfloat16 tensors");
  check(rows >= 0 && width > 0, "rows must be >= 0 and the row width > 0");
  check(in_stride >= in_width && out_stride >= width, "a row stride is shorter than the row");
  check(rows == 0 || (in != nullptr && out != nullptr), "null tensor address");
}

}  // namespace

const LayerOpKernels& scalar_layer_ops() {
  static const LayerOpKernels table{"scalar", rms_norm_rows_scalar, silu_mul_rows_scalar,
                                    rope_kv_rows_scalar};
  return table;
}

void rms_norm(const RmsNormArgs& a) {
  check_common(a.dtype, a.rows, a.hidden, a.x_stride, a.hidden, a.out_stride, a.x, a.out);
  check(a.weight != nullptr, "null weight address");
  check(a.eps >= 0.0f, "eps must be >= 0");
  check(a.residual == nullptr || a.residual_stride >= a.hidden,
        "the residual row stride is shorter than the row");
  if (a.rows == 0) return;
  run_rows(a, kernels_for_isa().rms_norm_rows, a.hidden);
}

void rope_write_kv(const RopeKvArgs& a) {
  check(a.rows >= 0 && a.num_heads >= 1 && a.num_kv_heads >= 1 && a.num_blocks >= 1 &&
            a.block_size >= 1,
        "rows, heads and the cache geometry must be positive");
  check(a.head_dim >= 2 && a.head_dim % 2 == 0 && a.head_dim <= kMaxRopeHeadDim,
        "head_dim must be even, at most 1024");
  check_cache_dtype(a.cache_dtype, a.k_scale, a.v_scale);
  check(a.qkv_stride >= static_cast<int64_t>(a.num_heads + 2 * a.num_kv_heads) * a.head_dim,
        "the qkv row stride is shorter than a row");
  check(a.rotary_dim == 0 ||
            (a.rotary_dim >= 2 && a.rotary_dim % 2 == 0 && a.rotary_dim <= a.head_dim),
        "rotary_dim must be 0 (all) or even, in [2, head_dim]");
  check(std::isfinite(a.norm_eps) && a.norm_eps >= 0.0f, "eps must be finite and >= 0");
  if (a.rows == 0) return;
  check(a.qkv != nullptr && a.cos != nullptr && a.sin != nullptr && a.slots != nullptr &&
            a.k_cache != nullptr && a.v_cache != nullptr,
        "null tensor address");
  const int64_t slots = static_cast<int64_t>(a.num_blocks) * a.block_size;
  for (int r = 0; r < a.rows; ++r)
    check(a.slots[r] >= 0 && a.slots[r] < slots, [&] {
      return "row " + std::to_string(r) + ": slot " + std::to_string(a.slots[r]) +
             " is out of range";
    });
  run_rows(a, kernels_for_isa().rope_kv_rows, (a.num_heads + 3 * a.num_kv_heads) * a.head_dim);
}

void silu_mul(const SiluMulArgs& a) {
  check_common(a.dtype, a.rows, a.width, a.input_stride, 2 * static_cast<int64_t>(a.width),
               a.out_stride, a.input, a.out);
  check(a.activation == GatedActivation::kSilu || a.activation == GatedActivation::kGeluTanh ||
            a.activation == GatedActivation::kClampedSwiglu,
        "unknown gated activation");
  check(a.activation != GatedActivation::kClampedSwiglu ||
            (std::isfinite(a.alpha) && std::isfinite(a.limit) && a.limit > 0.0f),
        "the clamped SwiGLU's alpha and limit must be finite, the limit > 0");
  if (a.rows == 0) return;
  run_rows(a, kernels_for_isa().silu_mul_rows, a.width);
}

}  // namespace pyserve_kernels
