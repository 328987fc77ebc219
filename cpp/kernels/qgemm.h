// Small-batch quantized matrix multiply: out[M, N] = x[M, K] · W[N, K]ᵀ (+ bias) with W stored
// as 8- or 4-bit integers in groups along K, for the decode steps of a CPU worker.
//
// Weights. Every group of `group` consecutive inputs of one output row holds unsigned integers
// u (0..255 for 8 bits, 0..15 for 4 bits) and two fp16 numbers, a scale d and an offset m:
// w = d·u + m. Symmetric int8 (llama.cpp's Q8_0) is u = q + 128, m = −128·d; asymmetric 4-bit
// (Q4_1) is its min/max form. Outputs come in tiles of 16 rows and each tile's groups lie one
// after another, so a thread streams its tiles front to back (see cpp/kernels/README.md):
//   data   [tiles][groups][group·16·bits/8 bytes]   8 bits: blocks of 64 bytes, byte 4n+i =
//          u[n][4j+i] of the group's j-th quad; 4 bits: block p packs quad 2p in the low
//          nibbles and quad 2p+1 in the high nibbles of the same bytes.
//   scales [tiles][groups][32] fp16: d of the tile's 16 rows, then m of the same rows.
// Rows past N and inputs past K are padding (u = 0, d = m = 0).
//
// Activations are quantized per row and group: a = s·q with s = max|a|/Q and q rounded to
// nearest even, Q = 127 (int8, llama.cpp's Q8_1) or Q = 32767 (int16, ~256× less rounding), and
// Σq kept beside s. A group then adds s·(d·Σu·q + m·Σq) to the output. The integer dot product
// Σu·q takes one VNNI instruction per 16 rows and 4 inputs (`vpdpbusd`, unsigned bytes × signed
// bytes) or 2 inputs (`vpdpwssd`, words × words); the rest is float work once per group.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyserve_kernels {

constexpr int kTileRows = 16;   // outputs per tile: one AVX-512 register of int32 or float
constexpr int kMaxGroup = 256;  // keeps Σu·q of a group inside int32 with int16 activations

struct PackedWeights {
  const uint8_t* data;
  const uint16_t* scales;  // fp16 bits
  int n;                   // output rows (unpadded)
  int k;                   // inputs (unpadded)
  int bits;                // 8 or 4
  int group;               // inputs per group, a multiple of 32
  int tiles() const { return (n + kTileRows - 1) / kTileRows; }
  int groups() const { return (k + group - 1) / group; }
  int k_padded() const { return groups() * group; }
  size_t group_bytes() const { return static_cast<size_t>(group) * kTileRows * bits / 8; }
};

// Rows of activations quantized per group (row-major, `groups` entries per row).
struct QuantizedRows {
  const void* q;            // int8_t or int16_t [rows][k_padded]
  int bits;                 // 8 or 16: the type of q
  const float* scale;       // [rows][groups] s
  const float* scaled_sum;  // [rows][groups] s·Σq
  const int32_t* sum;       // [rows][groups] Σq
  int k_padded;
  int groups;
};

// One ISA's implementation. `quantize_rows` writes `bits`-bit q (padded to whole groups with
// zeros); `tiles` computes rows [row0, row0 + rows) of the outputs in tiles [tile0, tile1),
// rows ≤ max_rows.
struct KernelTable {
  const char* name;
  int max_rows;
  void (*quantize_rows)(const float* x, int64_t x_stride, int rows, int k, int group, int bits,
                        void* q, float* scale, float* scaled_sum, int32_t* sum);
  void (*tiles)(const PackedWeights& w, const QuantizedRows& a, int row0, int rows, int tile0,
                int tile1, const float* bias, float* out, int64_t out_stride);
};

const KernelTable& scalar_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();

}  // namespace pyserve_kernels
