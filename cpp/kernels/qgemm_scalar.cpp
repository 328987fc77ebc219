// The portable path: plain C++ over the packed layout, for any CPU. It is also the reference
// the vector paths are tested against, so it follows the same order of float operations.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "half.h"
#include "qgemm.h"

namespace pyserve_kernels {
namespace {

template <class Q>
void quantize_rows_as(const float* x, int64_t x_stride, int rows, int k, int group, int headroom,
                      Q* q, float* scale, int32_t* shift, float* unit_sum, int32_t* sum,
                      float* unit) {
  const float top = sizeof(Q) == 2 ? 32767.0f : 127.0f;
  const int groups = (k + group - 1) / group;
  const int k_padded = groups * group;
  std::vector<float> amax(groups), inverse(groups);
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    Q* qr = q + static_cast<int64_t>(r) * k_padded;
    const int64_t row = static_cast<int64_t>(r) * groups;
    for (int g = 0; g < groups; ++g) {
      amax[g] = 0.0f;
      for (int i = g * group; i < std::min(k, (g + 1) * group); ++i)  // a NaN sticks
        amax[g] = std::isnan(xr[i]) || std::isnan(amax[g]) ? std::numeric_limits<float>::quiet_NaN()
                                                           : std::max(amax[g], std::fabs(xr[i]));
    }
    row_scales(amax.data(), groups, 8 * sizeof(Q), headroom, scale + row, shift + row,
               inverse.data(), unit + r);
    for (int g = 0; g < groups; ++g) {
      const int begin = g * group, end = std::min(k, begin + group);
      int32_t total = 0;
      for (int i = begin; i < begin + group; ++i) {
        float v = i < end ? std::nearbyint(xr[i] * inverse[g]) : 0.0f;
        if (std::isnan(v)) v = 0.0f;  // its row's outputs are NaN through the scale anyway
        const auto qi = static_cast<int32_t>(std::clamp(v, -top, top));
        qr[i] = static_cast<Q>(qi);
        total += qi;
      }
      sum[row + g] = total;
      unit_sum[row + g] = scale[row + g] * static_cast<float>(total);
    }
  }
}

void quantize_rows_scalar(const float* x, int64_t x_stride, int rows, int k, int group, int bits,
                          int headroom, void* q, float* scale, int32_t* shift, float* unit_sum,
                          int32_t* sum, float* unit) {
  if (bits == 16)
    quantize_rows_as(x, x_stride, rows, k, group, headroom, static_cast<int16_t*>(q), scale, shift,
                     unit_sum, sum, unit);
  else
    quantize_rows_as(x, x_stride, rows, k, group, headroom, static_cast<int8_t*>(q), scale, shift,
                     unit_sum, sum, unit);
}

// Unsigned weight of row n (0..15) and input i (0..group-1) inside one group's packed bytes.
inline int unpack(const uint8_t* block, int bits, int n, int i) {
  if (bits == 8) return block[(i / 4) * 64 + n * 4 + i % 4];
  const int quad = i / 4, byte = (quad / 2) * 64 + n * 4 + i % 4;
  const int low = quad % 2 == 0 ? block[byte] & 0x0f : block[byte] >> 4;
  if (bits == 4) return low;
  if (bits == 5) return low | (block[kHighPlaneOffset + n * 4 + i % 4] >> quad & 1) << 4;
  // 6 bits: the high pair from the group's planes after its 256 bytes of nibbles (qgemm.h)
  const int pair = block[256 + (quad / 4) * 64 + n * 4 + i % 4] >> (2 * (quad % 4)) & 3;
  return low | pair << 4;
}

// One tile's 6-bit groups (qgemm.h's Q6_K form) for activation row r, into acc[16].
template <class Q>
void q6_groups(const PackedWeights& w, const QuantizedRows& a, int t, int r, float* acc) {
  const int groups = w.groups();
  const Q* q = static_cast<const Q*>(a.q);
  const int halves = a.k_padded / 16;
  for (int g = 0; g < groups; ++g) {
    const size_t cell = static_cast<size_t>(t) * groups + g;
    const uint8_t* block = w.data + cell * w.group_bytes();
    const uint16_t* from = q6_block_at(w, t, g);
    const int8_t* sc = q6_sc_at(from, g);
    const Q* qa = q + static_cast<int64_t>(r) * a.k_padded + g * 32;
    const int64_t at = static_cast<int64_t>(r) * groups + g;
    for (int h = 0; h < 2; ++h) {
      const int32_t centre = a.centre[static_cast<int64_t>(r) * halves + 2 * g + h];
      for (int n = 0; n < kTileRows; ++n) {
        int32_t dot = centre;  // Σ(u − 32)·q
        for (int i = 16 * h; i < 16 * h + 16; ++i) dot += unpack(block, 6, n, i) * qa[i];
        const float d = half_to_float(from[n]) * static_cast<float>(sc[h * kTileRows + n]);
        if constexpr (sizeof(Q) == 2) {  // a left shift within the headroom (unsigned: defined)
          const auto shifted = static_cast<int32_t>(static_cast<uint32_t>(dot) << a.shift[at]);
          acc[n] = std::fma(static_cast<float>(shifted), d, acc[n]);
        } else {
          acc[n] = std::fma(static_cast<float>(dot) * a.scale[at], d, acc[n]);
        }
      }
    }
  }
}

// One tile's MXFP4 groups (qgemm.h) for activation row r, into acc[16]: Σ value·q per group
// (u = value + 12, the sum started at −12·Σq), scaled by the group's 2^(e − 128).
template <class Q>
void mxfp4_groups(const PackedWeights& w, const QuantizedRows& a, int t, int r, float* acc) {
  const int groups = w.groups();
  const Q* q = static_cast<const Q*>(a.q);
  for (int g = 0; g < groups; ++g) {
    const size_t cell = static_cast<size_t>(t) * groups + g;
    const uint8_t* block = w.data + cell * w.group_bytes();
    const uint8_t* exponents = mxfp4_exponents_at(w, t, g);
    const Q* qa = q + static_cast<int64_t>(r) * a.k_padded + g * 32;
    const int64_t at = static_cast<int64_t>(r) * groups + g;
    for (int n = 0; n < kTileRows; ++n) {
      int32_t dot = -kMxfp4Offset * a.sum[at];
      for (int i = 0; i < 32; ++i) dot += kMxfp4Codes[unpack(block, 4, n, i)] * qa[i];
      const float d = e8m0_half(exponents[n]);
      if constexpr (sizeof(Q) == 2) {  // a left shift within the headroom (unsigned: defined)
        const auto shifted = static_cast<int32_t>(static_cast<uint32_t>(dot) << a.shift[at]);
        acc[n] = std::fma(static_cast<float>(shifted), d, acc[n]);
      } else {
        acc[n] = std::fma(static_cast<float>(dot) * a.scale[at], d, acc[n]);
      }
    }
  }
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
      if (w.bits == 6) q6_groups<Q>(w, a, t, r, acc);
      if (w.mxfp4) mxfp4_groups<Q>(w, a, t, r, acc);
      for (int g = 0; g < groups && w.bits != 6 && !w.mxfp4; ++g) {
        const size_t cell = static_cast<size_t>(t) * groups + g;
        const uint8_t* block = w.data + cell * group_bytes;
        const uint16_t* sc =
            w.super_scales ? super_block_at(w, t, g) : w.scales + cell * 2 * kTileRows;
        const uint8_t* sc8 = w.super_scales ? super_sc_at(sc, g) : nullptr;
        const Q* qa = q + static_cast<int64_t>(r) * a.k_padded + g * w.group;
        const int64_t at = static_cast<int64_t>(r) * groups + g;
        for (int n = 0; n < kTileRows; ++n) {
          int32_t dot = 0;
          for (int i = 0; i < w.group; ++i) dot += unpack(block, w.bits, n, i) * qa[i];
          float d = half_to_float(sc[n]), m = half_to_float(sc[kTileRows + n]);
          if (sc8 != nullptr) {  // D·sc and −Dmin·mn: exact
            d *= static_cast<float>(sc8[n]);
            m *= static_cast<float>(sc8[kSuperMinOffset + n]);
          }
          if constexpr (sizeof(Q) == 2) {  // a left shift within the headroom (unsigned: defined)
            const auto shifted = static_cast<int32_t>(static_cast<uint32_t>(dot) << a.shift[at]);
            acc[n] = std::fma(static_cast<float>(shifted), d, acc[n]);
          } else {
            acc[n] = std::fma(static_cast<float>(dot) * a.scale[at], d, acc[n]);
          }
          acc[n] = std::fma(m, a.unit_sum[at], acc[n]);
        }
      }
      float* o = out + static_cast<int64_t>(r) * out_stride + t * kTileRows;
      for (int n = 0; n < valid; ++n)
        o[n] = std::fma(acc[n], a.unit[r], bias ? bias[t * kTileRows + n] : 0.0f);
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
  static const KernelTable table{"scalar", 8, 0, quantize_rows_scalar, tiles_scalar};
  return table;
}

}  // namespace pyserve_kernels
