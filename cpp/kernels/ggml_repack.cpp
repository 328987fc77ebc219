#include "ggml_repack.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "attention_convert.h"
#include "half.h"
#include "qgemm.h"
#include "thread_pool.h"

namespace pyserve_kernels {
namespace {

constexpr int kGroup = 32;
constexpr float kRoundMagic = 12582912.0f;  // 1.5 · 2^23

uint16_t load_half(const uint8_t* at) {
  uint16_t h;
  std::memcpy(&h, at, sizeof h);
  return h;
}

uint16_t scaled_half(uint16_t d, float factor) { return float_to_half(half_to_float(d) * factor); }

// 16 bytes → 32 weights: low nibbles are weights 0-15, high nibbles 16-31.
void nibbles(const uint8_t* qs, uint8_t* u) {
  for (int j = 0; j < 16; ++j) {
    u[j] = qs[j] & 0x0f;
    u[j + 16] = qs[j] >> 4;
  }
}

void high_bits(const uint8_t* qh, uint8_t* u) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof bits);
  for (int j = 0; j < 32; ++j) u[j] |= static_cast<uint8_t>(((bits >> j) & 1u) << 4);
}

// llama.cpp's get_scale_min_k4: the 6-bit scale and min of sub-block j from 12 packed bytes.
void k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void k_group_scales(const uint8_t* block, int sub, uint16_t* d, uint16_t* m) {
  int sc, mn;
  k_scale_min(block + 4, sub, &sc, &mn);
  *d = float_to_half(half_to_float(load_half(block)) * static_cast<float>(sc));
  *m = float_to_half(-(half_to_float(load_half(block + 2)) * static_cast<float>(mn)));
}

uint16_t next_half_up(uint16_t h) {  // the next fp16 above a finite h >= 0
  return static_cast<uint16_t>(h + 1);
}

// Q6_K (210 bytes per 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales per
// 16 weights, d): group j's 32 weights as llama.cpp dequantizes them, (d·sc)·(q − 32) in float32.
// Group j's 32 unsigned 6-bit integers u (w = d·sc·(u − 32)), and the scale index of its two
// halves of 16 (sc[first], sc[first + 1] of the 16 at byte 192).
int q6_k_group_u(const uint8_t* b, int j, uint8_t* u) {
  const int half = j / 4, t = j % 4;
  const uint8_t* ql = b + 64 * half;
  const uint8_t* qh = b + 128 + 32 * half;
  for (int l = 0; l < 32; ++l) {
    const int low = (t % 2 ? ql[l + 32] : ql[l]) >> (t / 2 * 4) & 0x0f;
    const int high = (qh[l] >> (2 * t)) & 3;
    u[l] = static_cast<uint8_t>(low | (high << 4));
  }
  return 8 * half + 2 * t;
}

void q6_k_group(const uint8_t* b, int j, float* w) {
  uint8_t u[kGroup];
  const int first = q6_k_group_u(b, j, u);
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(load_half(b + 208));
  for (int l = 0; l < 32; ++l) {
    const float scale = d * static_cast<float>(sc[first + l / 16]);
    w[l] = scale * static_cast<float>(u[l] - 32);
  }
}

// 32 floats as pyserve.worker.quant.quantize_weight rounds them to int8: d = fp16(max|w| / 127),
// one fp16 step up if that leaves the largest off the grid, q = round-half-even(w / d) in
// [−127, 127], u = q + 128, m = −128·d. A weight that is not finite makes d nan.
void int8_group(const float* w, uint8_t* u, uint16_t* d, uint16_t* m) {
  float amax = 0.0f;
  bool finite = true;
  for (int l = 0; l < 32; ++l) {
    finite = finite && std::isfinite(w[l]);
    amax = std::max(amax, std::fabs(w[l]));
  }
  uint16_t dh = float_to_half(amax / 127.0f);
  if (half_to_float(dh) * 127.0f < amax) dh = next_half_up(dh);
  const float step = half_to_float(dh) == 0.0f ? 1.0f : half_to_float(dh);
  for (int l = 0; l < 32; ++l) {
    // round half to even as torch.round does: adding and taking back 1.5·2^23 leaves the
    // float's integer part rounded by the FPU's own mode (|w / step| ≤ 127.x ≪ 2^22); a libm
    // nearbyint call per weight took most of this loop's time
    const float shifted = w[l] / step + kRoundMagic;
    const float q = std::min(127.0f, std::max(-127.0f, shifted - kRoundMagic));
    u[l] = static_cast<uint8_t>(static_cast<int>(q) + 128);
  }
  *d = finite ? dh : static_cast<uint16_t>(0x7e00);
  *m = scaled_half(*d, -128.0f);
}

// MXFP4 (17 bytes per 32: an E8M0 exponent e, then 16 bytes of e2m1 codes, qgemm.h) into the
// 8-bit form: w = value·2^(e − 128) with value an integer in [−12, 12], so u = value + 128 with
// d = 2^(e − 128) and m = −128·d is every weight exactly, where fp16 holds d and m (2^−24 ≤ d,
// 128·d ≤ 2^15). Beyond, the weights are rounded as quantize_weight rounds floats.
constexpr int kMxfp4HalfLowest = 128 - 24, kMxfp4HalfHighest = 128 + 15 - 7;

void mxfp4_int8_group(const uint8_t* b, uint8_t* u, uint16_t* d, uint16_t* m) {
  uint8_t codes[kGroup];
  nibbles(b + 1, codes);
  const int e = b[0];
  if (e >= kMxfp4HalfLowest && e <= kMxfp4HalfHighest) {
    *d = float_to_half(e8m0_half(b[0]));  // a power of two fp16 holds: exact
    *m = scaled_half(*d, -128.0f);
    for (int j = 0; j < kGroup; ++j) u[j] = static_cast<uint8_t>(kMxfp4Values[codes[j]] + 128);
    return;
  }
  float w[kGroup];
  for (int j = 0; j < kGroup; ++j)
    w[j] = static_cast<float>(kMxfp4Values[codes[j]]) * e8m0_half(b[0]);
  int8_group(w, u, d, m);
}

// Group g (32 weights) of one row: u, d, m.
void decode_group(GgmlType type, const uint8_t* row, int g, uint8_t* u, uint16_t* d, uint16_t* m) {
  switch (type) {
    case GgmlType::kQ4_0: {
      const uint8_t* b = row + static_cast<int64_t>(g) * 18;
      *d = load_half(b);
      *m = scaled_half(*d, -8.0f);
      nibbles(b + 2, u);
      return;
    }
    case GgmlType::kQ4_1: {
      const uint8_t* b = row + static_cast<int64_t>(g) * 20;
      *d = load_half(b);
      *m = load_half(b + 2);
      nibbles(b + 4, u);
      return;
    }
    case GgmlType::kQ5_0: {
      const uint8_t* b = row + static_cast<int64_t>(g) * 22;
      *d = load_half(b);
      *m = scaled_half(*d, -16.0f);
      nibbles(b + 6, u);
      high_bits(b + 2, u);
      return;
    }
    case GgmlType::kQ5_1: {
      const uint8_t* b = row + static_cast<int64_t>(g) * 24;
      *d = load_half(b);
      *m = load_half(b + 2);
      nibbles(b + 8, u);
      high_bits(b + 4, u);
      return;
    }
    case GgmlType::kQ8_0: {
      const uint8_t* b = row + static_cast<int64_t>(g) * 34;
      *d = load_half(b);
      *m = scaled_half(*d, -128.0f);
      for (int j = 0; j < 32; ++j) u[j] = static_cast<uint8_t>(static_cast<int8_t>(b[2 + j]) + 128);
      return;
    }
    case GgmlType::kQ4_K: {  // 144 bytes: d, dmin, 12 scale bytes, 128 bytes of nibbles
      const int sub = g % 8;
      const uint8_t* b = row + static_cast<int64_t>(g / 8) * 144;
      k_group_scales(b, sub, d, m);
      const uint8_t* qs = b + 16 + (sub / 2) * 32;  // chunk of 64: low nibbles, then high
      for (int l = 0; l < 32; ++l) u[l] = (sub % 2) ? (qs[l] >> 4) : (qs[l] & 0x0f);
      return;
    }
    case GgmlType::kQ6_K: {
      float w[kGroup];
      q6_k_group(row + static_cast<int64_t>(g / 8) * 210, g % 8, w);
      int8_group(w, u, d, m);
      return;
    }
    case GgmlType::kMXFP4:
      mxfp4_int8_group(row + static_cast<int64_t>(g) * 17, u, d, m);
      return;
    case GgmlType::kQ5_K: {  // 176 bytes: d, dmin, 12 scale bytes, 32 bytes of high bits, nibbles
      const int sub = g % 8;
      const uint8_t* b = row + static_cast<int64_t>(g / 8) * 176;
      k_group_scales(b, sub, d, m);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + 48 + (sub / 2) * 32;
      for (int l = 0; l < 32; ++l) {
        const int low = (sub % 2) ? (qs[l] >> 4) : (qs[l] & 0x0f);
        u[l] = static_cast<uint8_t>(low | (((qh[l] >> sub) & 1) << 4));
      }
      return;
    }
  }
}

int block_weights(GgmlType type) {
  const bool k_quant =
      type == GgmlType::kQ4_K || type == GgmlType::kQ5_K || type == GgmlType::kQ6_K;
  return k_quant ? 256 : 32;
}

struct RepackJob {
  GgmlType type;
  const uint8_t* blocks;
  int64_t row_bytes;
  int rows, k, bits;
  uint8_t* data;
  uint16_t* scales;
  bool super_scales;
};

// Row r's super-block scales (qgemm.h) of a Q4_K or Q5_K row (blocks of `block_bytes`, both
// starting with d, dmin and the 12 bytes of 6-bit scales) into its tile's: D, −Dmin, sc, mn.
void k_super_scales(const uint8_t* row, int64_t block_bytes, int r, int blocks,
                    uint16_t* tile_scales) {
  for (int s = 0; s < blocks; ++s) {
    const uint8_t* b = row + s * block_bytes;
    uint16_t* at = tile_scales + static_cast<size_t>(s) * kSuperScaleHalves;
    at[r] = load_half(b);
    at[kTileRows + r] = static_cast<uint16_t>(load_half(b + 2) ^ 0x8000u);  // −Dmin, exact
    auto* bytes = reinterpret_cast<uint8_t*>(at + 2 * kTileRows);
    for (int j = 0; j < kSuperGroups; ++j) {
      int sc, mn;
      k_scale_min(b + 4, j, &sc, &mn);
      bytes[j * kTileRows + r] = static_cast<uint8_t>(sc);
      bytes[kSuperMinOffset + j * kTileRows + r] = static_cast<uint8_t>(mn);
    }
  }
}

// Row r of a tile from Q6_K rows: its D and sc into the tile's scales (qgemm.h's Q6_K form), its
// u into the groups' nibbles and high bit pairs. The row's lanes of every byte are its own.
void q6_k_row(const uint8_t* row, int r, int groups, size_t group_bytes, uint8_t* tile_data,
              uint16_t* tile_scales) {
  uint8_t u[kGroup];
  for (int g = 0; g < groups; ++g) {
    const uint8_t* b = row + static_cast<int64_t>(g / kSuperGroups) * 210;
    uint16_t* at = tile_scales + static_cast<size_t>(g / kSuperGroups) * kQ6ScaleHalves;
    at[r] = load_half(b + 208);
    const int first = q6_k_group_u(b, g % kSuperGroups, u);
    auto* sc = reinterpret_cast<uint8_t*>(at + kTileRows) + g % kSuperGroups * 2 * kTileRows;
    sc[r] = b[192 + first];
    sc[kTileRows + r] = b[192 + first + 1];
    uint8_t* block = tile_data + static_cast<size_t>(g) * group_bytes + r * 4;
    for (int p = 0; p < kGroup / 8; ++p) {
      for (int i = 0; i < 4; ++i)
        block[p * 64 + i] = static_cast<uint8_t>((u[8 * p + i] & 0x0f) | (u[8 * p + 4 + i] << 4));
    }
    for (int h = 0; h < 2; ++h) {  // quads 4h..4h + 3: bits 2j of byte i
      for (int i = 0; i < 4; ++i) {
        int pairs = 0;
        for (int j = 0; j < 4; ++j) pairs |= (u[4 * (4 * h + j) + i] >> 4) << (2 * j);
        block[256 + h * 64 + i] = static_cast<uint8_t>(pairs);
      }
    }
  }
}

// Row r of a tile from MXFP4 rows in their own 4-bit form (qgemm.h): the codes into the groups'
// nibbles as they are, the exponent bytes into the tile's scales.
void mxfp4_row(const uint8_t* row, int r, int groups, size_t group_bytes, uint8_t* tile_data,
               uint8_t* tile_exponents) {
  uint8_t codes[kGroup];
  for (int g = 0; g < groups; ++g) {
    const uint8_t* b = row + static_cast<int64_t>(g) * 17;
    tile_exponents[static_cast<size_t>(g) * kTileRows + r] = b[0];
    nibbles(b + 1, codes);
    uint8_t* block = tile_data + static_cast<size_t>(g) * group_bytes + r * 4;
    for (int p = 0; p < kGroup / 8; ++p) {
      for (int i = 0; i < 4; ++i)
        block[p * 64 + i] = static_cast<uint8_t>(codes[8 * p + i] | (codes[8 * p + 4 + i] << 4));
    }
  }
}

// One tile: its 16 rows' groups, in the layout qgemm.h describes. Each row is written whole
// (its lanes of every group); rows past the weight's end stay zero.
void repack_tile(void* context, int tile) {
  const auto& job = *static_cast<const RepackJob*>(context);
  const int groups = job.k / kGroup;
  const size_t group_bytes = static_cast<size_t>(kGroup) * kTileRows * job.bits / 8;
  uint8_t* tile_data = job.data + static_cast<size_t>(tile) * groups * group_bytes;
  const bool mxfp4 = job.type == GgmlType::kMXFP4 && job.bits == 4;
  const size_t scale_halves =
      mxfp4              ? static_cast<size_t>(groups) * kTileRows / 2
      : job.bits == 6    ? static_cast<size_t>(groups / kSuperGroups) * kQ6ScaleHalves
      : job.super_scales ? static_cast<size_t>(groups / kSuperGroups) * kSuperScaleHalves
                         : static_cast<size_t>(groups) * 2 * kTileRows;
  uint16_t* tile_scales = job.scales + static_cast<size_t>(tile) * scale_halves;
  const int rows = std::min(kTileRows, job.rows - tile * kTileRows);
  if (rows < kTileRows) {
    std::memset(tile_data, 0, static_cast<size_t>(groups) * group_bytes);
    std::memset(tile_scales, 0, scale_halves * sizeof(uint16_t));
  }
  uint8_t u[kGroup];
  for (int r = 0; r < rows; ++r) {
    const int64_t row = static_cast<int64_t>(tile) * kTileRows + r;
    const uint8_t* source = job.blocks + row * job.row_bytes;
    if (job.bits == 6) {
      q6_k_row(source, r, groups, group_bytes, tile_data, tile_scales);
      continue;
    }
    if (mxfp4) {
      mxfp4_row(source, r, groups, group_bytes, tile_data, reinterpret_cast<uint8_t*>(tile_scales));
      continue;
    }
    if (job.super_scales)
      k_super_scales(source, job.type == GgmlType::kQ5_K ? 176 : 144, r, groups / kSuperGroups,
                     tile_scales);
    for (int g = 0; g < groups; ++g) {
      uint16_t d, m;
      decode_group(job.type, source, g, u, &d, &m);
      uint8_t* block = tile_data + static_cast<size_t>(g) * group_bytes + r * 4;
      if (!job.super_scales) {
        uint16_t* sc = tile_scales + static_cast<size_t>(g) * 2 * kTileRows;
        sc[r] = d;
        sc[kTileRows + r] = m;
      }
      if (job.bits == 8) {  // quad q (inputs 4q..4q+3) at bytes 64q + 4r
        for (int q = 0; q < kGroup / 4; ++q) std::memcpy(block + q * 64, u + 4 * q, 4);
      } else {  // block p: quad 2p in the low nibbles, quad 2p + 1 in the high ones
        for (int p = 0; p < kGroup / 8; ++p) {
          for (int i = 0; i < 4; ++i) {
            block[p * 64 + i] =
                static_cast<uint8_t>((u[8 * p + i] & 0x0f) | (u[8 * p + 4 + i] << 4));
          }
        }
        if (job.bits == 5) {  // the high plane: bit j of byte i is quad j's
          for (int i = 0; i < 4; ++i) {
            int bits = 0;
            for (int j = 0; j < 8; ++j) bits |= (u[4 * j + i] >> 4) << j;
            block[kHighPlaneOffset + i] = static_cast<uint8_t>(bits);
          }
        }
      }
    }
  }
}

}  // namespace

GgmlType ggml_type_named(const std::string& name) {
  if (name == "Q4_0") return GgmlType::kQ4_0;
  if (name == "Q4_1") return GgmlType::kQ4_1;
  if (name == "Q5_0") return GgmlType::kQ5_0;
  if (name == "Q5_1") return GgmlType::kQ5_1;
  if (name == "Q8_0") return GgmlType::kQ8_0;
  if (name == "Q4_K") return GgmlType::kQ4_K;
  if (name == "Q5_K") return GgmlType::kQ5_K;
  if (name == "Q6_K") return GgmlType::kQ6_K;
  if (name == "MXFP4") return GgmlType::kMXFP4;
  throw std::invalid_argument("GGML type " + name + " is not packed straight into tiles");
}

int ggml_type_largest_u(GgmlType type) {
  switch (type) {
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ4_K:
      return 15;
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ5_K:
      return 31;
    case GgmlType::kQ6_K:
      return 63;
    case GgmlType::kMXFP4:
      return 128 + 12;  // in the 8-bit form; the 4-bit one holds codes (qgemm.h)
    case GgmlType::kQ8_0:
      return 255;
  }
  return 255;
}

void repack_ggml(GgmlType type, const uint8_t* blocks, int64_t row_bytes, int rows, int k, int bits,
                 uint8_t* data, uint16_t* scales, bool super_scales) {
  if (bits == 6 && (type != GgmlType::kQ6_K || !super_scales)) {
    throw std::invalid_argument("6-bit tiles hold Q6_K blocks with their super-block scales only");
  }
  if (super_scales && !(type == GgmlType::kQ4_K && bits == 4) &&
      !(type == GgmlType::kQ5_K && bits == 5) && bits != 6) {
    throw std::invalid_argument(
        "super-block scales hold Q4_K blocks in 4-bit tiles, Q5_K in 5-bit and Q6_K in 6-bit "
        "ones only");
  }
  if (bits != 4 && bits != 5 && bits != 6 && bits != 8)
    throw std::invalid_argument("bits must be 4, 5, 6 or 8");
  const bool mxfp4_codes = type == GgmlType::kMXFP4 && bits == 4;
  if (mxfp4_codes && super_scales)
    throw std::invalid_argument("MXFP4 blocks keep their own exponents, not super-block scales");
  if (!mxfp4_codes && ggml_type_largest_u(type) >= (1 << bits)) {
    throw std::invalid_argument("the type's integers do not fit the tiles' bits");
  }
  if (rows <= 0 || k <= 0 || k % block_weights(type)) {
    throw std::invalid_argument("k must be a positive multiple of the type's block");
  }
  RepackJob job{type, blocks, row_bytes, rows, k, bits, data, scales, super_scales};
  const int tiles = (rows + kTileRows - 1) / kTileRows;
  ThreadPool::instance().run(repack_tile, &job, tiles);
}

}  // namespace pyserve_kernels
