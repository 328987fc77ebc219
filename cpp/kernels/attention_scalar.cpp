// The portable attention loops: any CPU, and the reference the vector paths follow.
#include <algorithm>
#include <cmath>
#include <limits>

#include "attention.h"
#include "attention_convert.h"

namespace pyserve_kernels {
namespace {

void score(DType cache, const float* q, int group, int dim, int64_t k_stride, const Tile* tiles,
           int count, const PrefetchSpan* ahead, int ahead_count, float* s, int stride,
           float* top) {
  prefetch_spans(ahead, ahead_count);
  for (int h = 0; h < group; ++h) top[h] = -std::numeric_limits<float>::infinity();
  for (int j = 0, offset = 0; j < count; offset += tiles[j++].tokens) {
    for (int h = 0; h < group; ++h) {
      for (int t = 0; t < tiles[j].tokens; ++t) {
        float sum = 0.0f;
        // int8: each group's dot product of the raw values times the group's scale
        const int step = cache == DType::kInt8 ? kInt8Group : dim;
        for (int start = 0; start < dim; start += step) {
          float part = 0.0f;
          for (int i = start; i < std::min(dim, start + step); ++i)
            part += q[h * dim + i] * load_element(cache, tiles[j].k, i * k_stride + t);
          sum += cache == DType::kInt8
                     ? part * half_to_float(tiles[j].k_scale[start / step * k_stride + t])
                     : part;
        }
        s[h * stride + offset + t] = sum;
        top[h] = std::max(top[h], sum);
      }
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

float softcap(float* s, int n, float cap) {
  const float inverse = 1.0f / cap;
  float top = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < n; ++t) {
    s[t] = cap * tanh_float(s[t] * inverse);
    top = std::max(top, s[t]);
  }
  return top;
}

void accumulate(DType cache, const float* p, int stride, int group, int dim, const Tile* tiles,
                int count, const PrefetchSpan* ahead, int ahead_count, float* acc) {
  prefetch_spans(ahead, ahead_count);
  const int groups = int8_groups(dim);
  for (int j = 0, offset = 0; j < count; offset += tiles[j++].tokens) {
    for (int t = 0; t < tiles[j].tokens; ++t) {
      const int64_t row = static_cast<int64_t>(t) * dim;
      for (int h = 0; h < group; ++h) {
        const float weight = p[h * stride + offset + t];
        for (int i = 0; i < dim; ++i) {
          // int8: the weight times the group's scale, then the raw values
          const float factor =
              cache == DType::kInt8
                  ? weight * half_to_float(tiles[j].v_scale[t * groups + i / kInt8Group])
                  : weight;
          acc[h * dim + i] += factor * load_element(cache, tiles[j].v, row + i);
        }
      }
    }
  }
}

}  // namespace

const AttentionKernels& scalar_attention() {
  static const AttentionKernels table{"scalar", score, exp_sum, softcap, accumulate};
  return table;
}

}  // namespace pyserve_kernels
