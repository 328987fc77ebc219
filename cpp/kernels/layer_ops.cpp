// The layer ops' entry points (argument checks, the split over threads) and the scalar loops,
// which any CPU runs and which the vector loops follow.
#include "layer_ops.h"
#include "arg_checks.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

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
    const int64_t in = r * a.x_stride, out = r * a.out_stride;
    float squares = 0.0f;
    for (int i = 0; i < a.hidden; ++i) {
      const float v = load_element(a.dtype, a.x, in + i);
      squares += v * v;
    }
    const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(a.hidden) + a.eps);
    for (int i = 0; i < a.hidden; ++i) {
      float y = load_element(a.dtype, a.x, in + i) * inverse;
      y = rounded(a.dtype, y);  // where HF rounds to the tensor's dtype
      store_element(a.dtype, a.out, out + i, load_element(a.dtype, a.weight, i) * y);
    }
  }
}

void silu_mul_rows_scalar(const SiluMulArgs& a, int row0, int row1) {
  for (int r = row0; r < row1; ++r) {
    const int64_t in = r * a.input_stride, out = r * a.out_stride;
    for (int i = 0; i < a.width; ++i) {
      const float gate = load_element(a.dtype, a.input, in + i);
      float silu = gate / (1.0f + std::exp(-gate));
      silu = rounded(a.dtype, silu);
      store_element(a.dtype, a.out, out + i,
                    silu * load_element(a.dtype, a.input, in + a.width + i));
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
  static const LayerOpKernels table{"scalar", rms_norm_rows_scalar, silu_mul_rows_scalar};
  return table;
}

void rms_norm(const RmsNormArgs& a) {
  check_common(a.dtype, a.rows, a.hidden, a.x_stride, a.hidden, a.out_stride, a.x, a.out);
  check(a.weight != nullptr, "null weight address");
  check(a.eps >= 0.0f, "eps must be >= 0");
  if (a.rows == 0) return;
  run_rows(a, kernels_for_isa().rms_norm_rows, a.hidden);
}

void silu_mul(const SiluMulArgs& a) {
  check_common(a.dtype, a.rows, a.width, a.input_stride, 2 * static_cast<int64_t>(a.width),
               a.out_stride, a.input, a.out);
  if (a.rows == 0) return;
  run_rows(a, kernels_for_isa().silu_mul_rows, a.width);
}

}  // namespace pyserve_kernels
