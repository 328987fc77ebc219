// The portable path: plain C++ over the packed layout, for any CPU. It is also the reference
// the vector paths are tested against, so it follows the same order of float operations.
#include <algorithm>
#include <cmath>

#include "half.h"
#include "qgemm.h"

namespace pyserve_kernels {
namespace {

template <class Q>
void quantize_rows_as(const float* x, int64_t x_stride, int rows, int k, int group, Q* q,
                      float* scale, float* scaled_sum, int32_t* sum) {
  const float top = static_cast<float>((1 << (8 * sizeof(Q) - 1)) - 1);  // 127 or 32767
  const int groups = (k + group - 1) / group;
  const int k_padded = groups * group;
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    Q* qr = q + static_cast<int64_t>(r) * k_padded;
    for (int g = 0; g < groups; ++g) {
      const int begin = g * group, end = std::min(k, begin + group);
      float amax = 0.0f;
      for (int i = begin; i < end; ++i) amax = std::max(amax, std::fabs(xr[i]));
      const float s = amax / top;
      const float inverse = amax > 0.0f ? top / amax : 0.0f;
      int32_t total = 0;
      for (int i = begin; i < begin + group; ++i) {
        const float v = i < end ? std::nearbyint(xr[i] * inverse) : 0.0f;
        const auto qi = static_cast<int32_t>(std::clamp(v, -top, top));
        qr[i] = static_cast<Q>(qi);
        total += qi;
      }
      const int64_t at = static_cast<int64_t>(r) * groups + g;
      scale[at] = s;
      sum[at] = total;
      scaled_sum[at] = s * static_cast<float>(total);
    }
  }
}

void quantize_rows_scalar(const float* x, int64_t x_stride, int rows, int k, int group, int bits,
                          void* q, float* scale, float* scaled_sum, int32_t* sum) {
  if (bits == 16)
    quantize_rows_as(x, x_stride, rows, k, group, static_cast<int16_t*>(q), scale, scaled_sum, sum);
  else
    quantize_rows_as(x, x_stride, rows, k, group, static_cast<int8_t*>(q), scale, scaled_sum, sum);
}

// Unsigned weight of row n (0..15) and input i (0..group-1) inside one group's packed bytes.
inline int unpack(const uint8_t* block, int bits, int n, int i) {
  if (bits == 8) return block[(i / 4) * 64 + n * 4 + i % 4];
  const int quad = i / 4, byte = (quad / 2) * 64 + n * 4 + i % 4;
  return quad % 2 == 0 ? block[byte] & 0x0f : block[byte] >> 4;
}

template <class Q>
void tiles_as(const PackedWeights& w, const QuantizedRows& a, int row0, int rows, int tile0,
              int tile1, const float* bias, float* out, int64_t out_stride) {
  const int groups = w.groups();
  const size_t group_bytes = w.group_bytes();
  const Q* q = static_cast<const Q*>(a.q);
  for (int t = tile0; t < tile1; ++t) {
    const int valid = std::min(kTileRows, w.n - t * kTileRows);
    for (int r = row0; r < row0 + rows; ++r) {
      float acc[kTileRows] = {};
      for (int g = 0; g < groups; ++g) {
        const size_t at = static_cast<size_t>(t) * groups + g;
        const uint8_t* block = w.data + at * group_bytes;
        const uint16_t* sc = w.scales + at * 2 * kTileRows;
        const Q* qa = q + static_cast<int64_t>(r) * a.k_padded + g * w.group;
        const float s = a.scale[static_cast<int64_t>(r) * groups + g];
        const float ss = a.scaled_sum[static_cast<int64_t>(r) * groups + g];
        for (int n = 0; n < kTileRows; ++n) {
          int32_t dot = 0;
          for (int i = 0; i < w.group; ++i) dot += unpack(block, w.bits, n, i) * qa[i];
          const float d = half_to_float(sc[n]), m = half_to_float(sc[kTileRows + n]);
          acc[n] += static_cast<float>(dot) * s * d;
          acc[n] += m * ss;
        }
      }
      float* o = out + static_cast<int64_t>(r) * out_stride + t * kTileRows;
      for (int n = 0; n < valid; ++n) o[n] = acc[n] + (bias ? bias[t * kTileRows + n] : 0.0f);
    }
  }
}

void tiles_scalar(const PackedWeights& w, const QuantizedRows& a, int row0, int rows, int tile0,
                  int tile1, const float* bias, float* out, int64_t out_stride) {
  if (a.bits == 16)
    tiles_as<int16_t>(w, a, row0, rows, tile0, tile1, bias, out, out_stride);
  else
    tiles_as<int8_t>(w, a, row0, rows, tile0, tile1, bias, out, out_stride);
}

}  // namespace

const KernelTable& scalar_kernels() {
  static const KernelTable table{"scalar", 8, quantize_rows_scalar, tiles_scalar};
  return table;
}

}  // namespace pyserve_kernels
