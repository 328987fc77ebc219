// The portable attention loops: any CPU, and the reference the vector paths follow.
#include <algorithm>
#include <cmath>
#include <limits>

#include "attention.h"
#include "attention_convert.h"

namespace pyserve_kernels {
namespace {

void score(DType cache, const float* q, int group, int dim, const void* k, int64_t k_stride,
           int tokens, float* s, int stride, float* top) {
  for (int h = 0; h < group; ++h) {
    top[h] = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < tokens; ++t) {
      float sum = 0.0f;
      for (int i = 0; i < dim; ++i)
        sum += q[h * dim + i] * load_element(cache, k, i * k_stride + t);
      s[h * stride + t] = sum;
      top[h] = std::max(top[h], sum);
    }
  }
}

float exp_sum(float* s, int n, float shift) {
  float sum = 0.0f;
  for (int t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - shift);
    sum += s[t];
  }
  return sum;
}

void accumulate(DType cache, const float* p, int stride, int group, int dim, const void* v,
                int tokens, float* acc) {
  for (int t = 0; t < tokens; ++t) {
    const int64_t row = static_cast<int64_t>(t) * dim;
    for (int h = 0; h < group; ++h) {
      const float weight = p[h * stride + t];
      for (int i = 0; i < dim; ++i) acc[h * dim + i] += weight * load_element(cache, v, row + i);
    }
  }
}

}  // namespace

const AttentionKernels& scalar_attention() {
  static const AttentionKernels table{"scalar", score, exp_sum, accumulate};
  return table;
}

}  // namespace pyserve_kernels
