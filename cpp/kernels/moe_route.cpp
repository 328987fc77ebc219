// moe_route: a mixture's router (logits, softmax, top-k, renormalization) and its shared expert's
// sigmoid gate in float32, for the layer loop and the decoder stack alike, so that the two route
// every token the same way to the bit.
//
// The dot products x · w sum in one order on every ISA: lane j (of 16) accumulates the products
// of inputs i ≡ j (mod 16) with a fused multiply-add, the last block's missing inputs counting as
// 0 · 0, and the 16 lanes are added as a fixed tree. The AVX-512 loop holds the 16 lanes in one
// register, the AVX2 loop in two, the portable one in an array (std::fma): the same roundings,
// so a route does not change with the ISA or the number of threads.
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "arg_checks.h"
#include "dispatch.h"
#include "moe.h"
#include "thread_pool.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define PYSERVE_ROUTE_X86 1
#define PYSERVE_ROUTE_AVX512 __attribute__((target("avx512f,fma")))
#define PYSERVE_ROUTE_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace pyserve_kernels {
namespace {

constexpr int kLanes = 16;

// The fixed tree over the 16 lanes: halves, quarters, eighths, then the last pair.
inline float reduce_lanes(const float* lanes) {
  float half[8], quarter[4];
  for (int j = 0; j < 8; ++j) half[j] = lanes[j] + lanes[j + 8];
  for (int j = 0; j < 4; ++j) quarter[j] = half[j] + half[j + 4];
  const float first = quarter[0] + quarter[2];
  const float second = quarter[1] + quarter[3];
  return first + second;
}

// out[r] = x · w[r] for rows r of w ([rows][hidden], contiguous)
using DotRows = void (*)(const float* x, const float* w, int rows, int hidden, float* out);

void dot_rows_scalar(const float* x, const float* w, int rows, int hidden, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* row = w + static_cast<int64_t>(r) * hidden;
    float lanes[kLanes] = {};
    for (int i = 0; i < hidden; i += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const bool live = i + j < hidden;
        lanes[j] = std::fma(live ? x[i + j] : 0.0f, live ? row[i + j] : 0.0f, lanes[j]);
      }
    out[r] = reduce_lanes(lanes);
  }
}

#ifdef PYSERVE_ROUTE_X86

// Four rows at a time: four independent chains of fused multiply-adds
PYSERVE_ROUTE_AVX512 void dot_rows_avx512(const float* x, const float* w, int rows, int hidden,
                                          float* out) {
  alignas(64) float lanes[kLanes];
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    const float* row = w + static_cast<int64_t>(r) * hidden;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (int i = 0; i < hidden; i += kLanes) {
      const int left = hidden - i;
      const __mmask16 live = left >= kLanes ? static_cast<__mmask16>(0xffff)
                                            : static_cast<__mmask16>((1u << left) - 1u);
      const __m512 xv = _mm512_maskz_loadu_ps(live, x + i);
      for (int q = 0; q < 4; ++q)
        acc[q] = _mm512_fmadd_ps(
            xv, _mm512_maskz_loadu_ps(live, row + static_cast<int64_t>(q) * hidden + i), acc[q]);
    }
    for (int q = 0; q < 4; ++q) {
      _mm512_store_ps(lanes, acc[q]);
      out[r + q] = reduce_lanes(lanes);
    }
  }
  for (; r < rows; ++r) {
    const float* row = w + static_cast<int64_t>(r) * hidden;
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < hidden; i += kLanes) {
      const int left = hidden - i;
      const __mmask16 live = left >= kLanes ? static_cast<__mmask16>(0xffff)
                                            : static_cast<__mmask16>((1u << left) - 1u);
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, x + i),
                            _mm512_maskz_loadu_ps(live, row + i), acc);
    }
    _mm512_store_ps(lanes, acc);
    out[r] = reduce_lanes(lanes);
  }
}

// A 16-lane block as two 8-lane halves; lanes past `left` load as 0
PYSERVE_ROUTE_AVX2 inline void load_block(const float* p, int left, __m256& low, __m256& high) {
  if (left >= kLanes) {
    low = _mm256_loadu_ps(p);
    high = _mm256_loadu_ps(p + 8);
    return;
  }
  alignas(32) float block[kLanes] = {};
  std::copy(p, p + left, block);
  low = _mm256_load_ps(block);
  high = _mm256_load_ps(block + 8);
}

PYSERVE_ROUTE_AVX2 void dot_rows_avx2(const float* x, const float* w, int rows, int hidden,
                                      float* out) {
  alignas(32) float lanes[kLanes];
  int r = 0;
  for (; r + 2 <= rows; r += 2) {
    const float* row = w + static_cast<int64_t>(r) * hidden;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int i = 0; i < hidden; i += kLanes) {
      __m256 x_low, x_high, w_low, w_high;
      load_block(x + i, hidden - i, x_low, x_high);
      for (int q = 0; q < 2; ++q) {
        load_block(row + static_cast<int64_t>(q) * hidden + i, hidden - i, w_low, w_high);
        acc[2 * q] = _mm256_fmadd_ps(x_low, w_low, acc[2 * q]);
        acc[2 * q + 1] = _mm256_fmadd_ps(x_high, w_high, acc[2 * q + 1]);
      }
    }
    for (int q = 0; q < 2; ++q) {
      _mm256_store_ps(lanes, acc[2 * q]);
      _mm256_store_ps(lanes + 8, acc[2 * q + 1]);
      out[r + q] = reduce_lanes(lanes);
    }
  }
  for (; r < rows; ++r) {
    const float* row = w + static_cast<int64_t>(r) * hidden;
    __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
    for (int i = 0; i < hidden; i += kLanes) {
      __m256 x_low, x_high, w_low, w_high;
      load_block(x + i, hidden - i, x_low, x_high);
      load_block(row + i, hidden - i, w_low, w_high);
      low = _mm256_fmadd_ps(x_low, w_low, low);
      high = _mm256_fmadd_ps(x_high, w_high, high);
    }
    _mm256_store_ps(lanes, low);
    _mm256_store_ps(lanes + 8, high);
    out[r] = reduce_lanes(lanes);
  }
}

#endif  // PYSERVE_ROUTE_X86

DotRows dot_rows_for_isa() {
#ifdef PYSERVE_ROUTE_X86
  const std::string isa = current_isa();
  if (isa == "avx512_vnni") return dot_rows_avx512;
  if (isa == "avx2") return dot_rows_avx2;
#endif
  return dot_rows_scalar;
}

// Work units: (a block of tokens, a block of experts) for the logits; a block of tokens for the
// softmax and the choice.
constexpr int kTokenBlock = 8;
constexpr int kExpertBlock = 16;
constexpr int64_t kParallelMacs = int64_t{1} << 16;  // below this, one thread does it all

struct RouteJob {
  const MoeRouteArgs* a;
  DotRows dots;
  float* logits;  // [tokens][num_experts + (shared gate ? 1 : 0)]
  int columns;
  int expert_blocks;
};

void logits_chunk(void* context, int chunk) {
  const RouteJob& job = *static_cast<const RouteJob*>(context);
  const MoeRouteArgs& a = *job.a;
  const int token0 = (chunk / job.expert_blocks) * kTokenBlock;
  const int expert0 = (chunk % job.expert_blocks) * kExpertBlock;
  const int token1 = std::min(a.tokens, token0 + kTokenBlock);
  const int experts = std::min(a.num_experts, expert0 + kExpertBlock) - expert0;
  for (int t = token0; t < token1; ++t) {
    const float* x = a.x + t * a.x_stride;
    float* row = job.logits + static_cast<int64_t>(t) * job.columns;
    job.dots(x, a.router + static_cast<int64_t>(expert0) * a.hidden, experts, a.hidden,
             row + expert0);
    if (a.shared_gate != nullptr && expert0 == 0)
      job.dots(x, a.shared_gate, 1, a.hidden, row + a.num_experts);
  }
}

// torch.topk's comparison (aten/src/ATen/native/TopKImpl.h): NaN above everything
using Choice = std::pair<float, int64_t>;
bool ranks_above(const Choice& x, const Choice& y) {
  return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
}

// values[0..n) ← softmax(values) in place, as torch's softmax computes it: the largest, exp of
// each minus it, their sum in order, one reciprocal, then products
void softmax(float* values, int n) {
  float largest = values[0];
  for (int e = 1; e < n; ++e) largest = std::max(largest, values[e]);
  float sum = 0.0f;
  for (int e = 0; e < n; ++e) {
    values[e] = std::exp(values[e] - largest);
    sum += values[e];
  }
  const float inverse = 1.0f / sum;
  for (int e = 0; e < n; ++e) values[e] *= inverse;
}

// The first k of queue in torch.topk(sorted=True)'s order as it picks them on the CPU
// (std::partial_sort where k · 64 ≤ n, else std::nth_element and std::sort of the first k − 1,
// with its comparison): equal values come out in the order those algorithms leave them, which is
// what a tie between experts resolves to in torch.
void top_k(std::vector<Choice>& queue, int k) {
  if (static_cast<int64_t>(k) * 64 <= static_cast<int64_t>(queue.size())) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), ranks_above);
  } else {
    std::nth_element(queue.begin(), queue.begin() + (k - 1), queue.end(), ranks_above);
    std::sort(queue.begin(), queue.begin() + (k - 1), ranks_above);
  }
}

// One token: its logits (+ the bias), then either a softmax over them, the top k and the
// renormalization, or (softmax_after_top_k) the top k logits and a softmax over those k.
void choose(const MoeRouteArgs& a, float* logits, std::vector<Choice>& queue, int t) {
  const int n = a.num_experts, k = a.top_k;
  if (a.bias != nullptr)
    for (int e = 0; e < n; ++e) logits[e] += a.bias[e];
  if (!a.softmax_after_top_k) softmax(logits, n);
  queue.resize(static_cast<size_t>(n));
  for (int e = 0; e < n; ++e) queue[static_cast<size_t>(e)] = {logits[e], e};
  top_k(queue, k);
  float* weights = a.weights + static_cast<int64_t>(t) * k;
  int64_t* experts = a.experts + static_cast<int64_t>(t) * k;
  for (int j = 0; j < k; ++j) {
    weights[j] = queue[static_cast<size_t>(j)].first;
    experts[j] = queue[static_cast<size_t>(j)].second;
  }
  if (a.softmax_after_top_k) {
    softmax(weights, k);
  } else if (a.normalize) {
    float total = 0.0f;
    for (int j = 0; j < k; ++j) total += weights[j];
    for (int j = 0; j < k; ++j) weights[j] = weights[j] / total;
  }
  if (a.shared_gate != nullptr) a.shared_weight[t] = 1.0f / (1.0f + std::exp(-logits[n]));
}

void choose_chunk(void* context, int chunk) {
  const RouteJob& job = *static_cast<const RouteJob*>(context);
  thread_local std::vector<Choice> queue;
  const int token0 = chunk * kTokenBlock;
  const int token1 = std::min(job.a->tokens, token0 + kTokenBlock);
  for (int t = token0; t < token1; ++t)
    choose(*job.a, job.logits + static_cast<int64_t>(t) * job.columns, queue, t);
}

}  // namespace

void moe_route(const MoeRouteArgs& a) {
  check(a.tokens >= 0 && a.hidden > 0 && a.num_experts > 0, "sizes must be positive");
  check(a.top_k >= 1 && a.top_k <= a.num_experts, [&] {
    return "top-" + std::to_string(a.top_k) + " of " + std::to_string(a.num_experts) +
           " experts: k must be in [1, experts]";
  });
  check(a.x_stride >= a.hidden, "the row stride is shorter than the row");
  check((a.shared_gate == nullptr) == (a.shared_weight == nullptr),
        "a shared gate needs its output, and an output its gate");
  if (a.tokens == 0) return;  // (an empty tensor's address may be null)
  check(a.x != nullptr && a.router != nullptr && a.weights != nullptr && a.experts != nullptr,
        "null pointer");
  thread_local std::vector<float> logits;
  const int columns = a.num_experts + (a.shared_gate != nullptr ? 1 : 0);
  logits.resize(static_cast<size_t>(a.tokens) * columns);
  const int expert_blocks = (a.num_experts + kExpertBlock - 1) / kExpertBlock;
  const int token_blocks = (a.tokens + kTokenBlock - 1) / kTokenBlock;
  RouteJob job{&a, dot_rows_for_isa(), logits.data(), columns, expert_blocks};
  ThreadPool& pool = ThreadPool::instance();
  const int64_t macs = static_cast<int64_t>(a.tokens) * columns * a.hidden;
  if (macs < kParallelMacs || pool.size() == 1) {
    for (int c = 0; c < token_blocks * expert_blocks; ++c) logits_chunk(&job, c);
    for (int c = 0; c < token_blocks; ++c) choose_chunk(&job, c);
    return;
  }
  pool.run(logits_chunk, &job, token_blocks * expert_blocks);
  if (a.tokens >= 4 * kTokenBlock)
    pool.run(choose_chunk, &job, token_blocks);
  else
    for (int c = 0; c < token_blocks; ++c) choose_chunk(&job, c);
}

}  // namespace pyserve_kernels
