#include "moe.h"

#include <algorithm>
#include <vector>

#include "arg_checks.h"

namespace pyserve_kernels {

void moe_group(const int64_t* experts, const float* weights, int tokens, int top_k, int num_experts,
               int64_t* row_token, float* row_weight, int64_t* counts) {
  check(experts != nullptr && weights != nullptr && row_token != nullptr && row_weight != nullptr &&
            counts != nullptr,
        "null pointer");
  check(tokens >= 0 && top_k > 0 && num_experts > 0, "sizes must be positive");
  const int64_t choices = static_cast<int64_t>(tokens) * top_k;
  std::fill(counts, counts + num_experts, 0);
  for (int64_t c = 0; c < choices; ++c) {
    check(experts[c] >= 0 && experts[c] < num_experts, "an expert id out of range");
    ++counts[experts[c]];
  }
  thread_local std::vector<int64_t> next;
  next.assign(num_experts, 0);
  for (int e = 1; e < num_experts; ++e) next[e] = next[e - 1] + counts[e - 1];
  for (int64_t c = 0; c < choices; ++c) {
    const int64_t r = next[experts[c]]++;
    row_token[r] = c / top_k;
    row_weight[r] = weights[c];
  }
}

void moe_combine(const float* y, int64_t y_stride, const int64_t* row_token,
                 const float* row_weight, int rows, int hidden, float* out, int64_t out_stride,
                 int tokens) {
  check(y != nullptr && row_token != nullptr && row_weight != nullptr && out != nullptr,
        "null pointer");
  check(rows >= 0 && hidden > 0 && tokens >= 0, "sizes must be positive");
  check(y_stride >= hidden && out_stride >= hidden, "a row stride is shorter than its row");
  for (int t = 0; t < tokens; ++t)
    std::fill(out + t * out_stride, out + t * out_stride + hidden, 0.0f);
  for (int r = 0; r < rows; ++r) {
    const int64_t t = row_token[r];
    check(t >= 0 && t < tokens, "a row's token out of range");
    const float w = row_weight[r];
    const float* from = y + r * y_stride;
    float* to = out + t * out_stride;
    for (int i = 0; i < hidden; ++i) {
      const float product = w * from[i];  // rounded before the sum, as y · w then index_add_
      to[i] += product;
    }
  }
}

}  // namespace pyserve_kernels
