// Small-batch quantized matrix multiply: out[M, N] = x[M, K] · W[N, K]ᵀ (+ bias) with W stored
// as 8- or 4-bit integers in groups along K, for the decode steps of a CPU worker.
//
// Weights. Every group of `group` consecutive inputs of one output row holds unsigned integers
// u (0..255 for 8 bits, 0..15 for 4 bits) and two fp16 numbers, a scale d and an offset m:
// w = d·u + m. Symmetric int8 (llama.cpp's Q8_0) is u = q + 128, m = −128·d; asymmetric 4-bit
// (Q4_1) is its min/max form. 5 bits (llama.cpp's Q5_0, Q5_1, Q5_K) is the 4-bit layout plus a
// plane of high bits (below); 6 bits is llama.cpp's Q6_K as it is (below). Outputs come in tiles of
// 16 rows and each tile's groups lie one after another, so a thread streams its tiles front to back
// (see cpp/kernels/README.md):
//   data   [tiles][groups][group·16·bits/8 bytes]   8 bits: blocks of 64 bytes, byte 4n+i =
//          u[n][4j+i] of the group's j-th quad; 4 bits: block p packs quad 2p in the low
//          nibbles and quad 2p+1 in the high nibbles of the same bytes.
//   scales [tiles][groups][32] fp16: d of the tile's 16 rows, then m of the same rows.
// Rows past N and inputs past K are padding (u = 0, d = m = 0).
//
// Activations are quantized per row and group, a = s·q with q rounded to nearest even and
// |q| ≤ Q, and Σq kept beside them. Each row sums its groups in a unit of its own:
// - int8 (Q = 127, llama.cpp's Q8_1): s = max|a|/Q and the unit is 1; a group adds
//   s·d·Σu·q + m·s·Σq (a multiply and two FMAs per group and row).
// - int16 (Q = 32767, ~256× less rounding): s is a power of two, 2^e, the smallest e with
//   max|a|·2^−e ≤ Q, raised where needed to at least U = (the row's largest e) − H, and the unit
//   is 2^U. H is the headroom: how many bits the largest possible Σu·q of a group can be shifted
//   left inside int32. A group adds d·(Σu·q ≪ (e − U)) + m·(Σq ≪ (e − U)), two FMAs: no
//   multiply for a float scale in this innermost loop. The power of two costs up to
//   one bit of q, and a group over 2^H times smaller than its row's largest is rounded on the
//   coarser grid 2^U (H = 7 for 4-bit weights and groups of 32: a grid 128× finer than the
//   largest group's).
// The sum is multiplied by the unit once at the end. The integer dot product Σu·q takes one VNNI
// instruction per 16 rows and 4 inputs (`vpdpbusd`, unsigned bytes × signed bytes) or 2 inputs
// (`vpdpwssd`, words × words).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

namespace pyserve_kernels {

constexpr int kTileRows = 16;   // outputs per tile: one AVX-512 register of int32 or float
constexpr int kMaxGroup = 256;  // keeps Σu·q of a group inside int32 with int16 activations

struct PackedWeights {
  const uint8_t* data;
  const uint16_t* scales;  // fp16 bits
  int n;                   // output rows (unpadded)
  int k;                   // inputs (unpadded)
  int bits;                // 8, 6, 5 or 4
  int group;               // inputs per group, a multiple of 32
  // Scales per tile and 256 inputs in llama.cpp's Q4_K form (below) instead of fp16 d and m per
  // group: 4-bit weights, groups of 32, k padded to a multiple of 256. 6-bit weights always
  // have super-block scales, in Q6_K's form (below).
  bool super_scales = false;
  // MXFP4 (below): 4-bit weights whose nibbles are e2m1 codes and whose scales are one E8M0
  // exponent byte per group and row; groups of 32.
  bool mxfp4 = false;
  int tiles() const { return (n + kTileRows - 1) / kTileRows; }
  int groups() const { return (k + group - 1) / group; }
  int k_padded() const { return groups() * group; }
  size_t group_bytes() const { return static_cast<size_t>(group) * kTileRows * bits / 8; }
};

// Super-block scales (PackedWeights::super_scales): per tile and super-block of 8 groups (256
// inputs), kSuperScaleHalves halves: the 16 rows' fp16 D, their fp16 −Dmin, then 8 × 16 unsigned
// bytes sc (group-major, the 16 rows within), then 8 × 16 bytes mn. A group's d = D·sc and
// m = −Dmin·mn, exact in float32 (11-bit by 6-bit products): a Q4_K weight is exactly the file's.
// 320 bytes for 4096 weights beside their 2048 bytes of nibbles: 4.625 bits a weight, against 5
// with fp16 d and m per group.
constexpr int kSuperGroups = 8;
constexpr int kSuperScaleHalves = 2 * kTileRows + kSuperGroups * kTileRows;
// The super-block scales of (tile, group), and the group's 16 sc bytes (its mn 128 bytes on).
inline const uint16_t* super_block_at(const PackedWeights& w, int tile, int group) {
  const size_t blocks = static_cast<size_t>(w.groups() / kSuperGroups);
  return w.scales + (tile * blocks + group / kSuperGroups) * kSuperScaleHalves;
}
inline const uint8_t* super_sc_at(const uint16_t* block, int group) {
  return reinterpret_cast<const uint8_t*>(block + 2 * kTileRows) + group % kSuperGroups * kTileRows;
}
constexpr int kSuperMinOffset = kSuperGroups * kTileRows;  // from a group's sc to its mn

// 5-bit weights: each 32 inputs of a tile are 256 bytes of low nibbles in the 4-bit layout, then
// one 64-byte block whose byte 4n + i holds in bit j the high bit (bit 4) of u[n][4j + i]; the
// scales are either form of the 4-bit weights' (fp16 d and m per group, or Q4_K's super-block
// form for Q5_K, whose blocks carry the same scales).
constexpr int kHighPlaneOffset = 256;  // bytes of nibbles before a 32-input block's high bits

// 6-bit weights (llama.cpp's Q6_K, 6.5625 bits a weight, every weight the file's): groups of 32
// and super-block scales. A (tile, group)'s 384 bytes are its low nibbles in the 4-bit layout
// (256 bytes), then two 64-byte blocks of high bit pairs: byte 4n + i of block h holds, in bits
// 2j and 2j + 1, the high bits of u[n][4·(4h + j) + i] (quads 4h..4h + 3). Per tile and 256
// inputs, kQ6ScaleHalves halves: the 16 rows' fp16 D, then 16 × 16 signed bytes sc (sub-block
// of 16 inputs major, the rows within). w = D·sc·(u − 32), u in 0..63: the kernels add
// D·sc·(Σu·q − 32·Σq) per 16 inputs, the integer sum started at QuantizedRows::centre.
constexpr int kQ6Halves = 16;  // sub-blocks of 16 inputs in a super-block
constexpr int kQ6ScaleHalves = kTileRows + kQ6Halves * kTileRows / 2;
constexpr int kQ6Offset = 32;
// The Q6_K scales of (tile, group): the rows' D, and the group's two sub-blocks' 16 sc each.
inline const uint16_t* q6_block_at(const PackedWeights& w, int tile, int group) {
  const size_t blocks = static_cast<size_t>(w.groups() / kSuperGroups);
  return w.scales + (tile * blocks + group / kSuperGroups) * kQ6ScaleHalves;
}
inline const int8_t* q6_sc_at(const uint16_t* block, int group) {
  return reinterpret_cast<const int8_t*>(block + kTileRows) + group % kSuperGroups * 2 * kTileRows;
}

// MXFP4 (the OCP microscaling format as llama.cpp stores it, 4.25 bits a weight, every weight the
// file's): w = kMxfp4Values[code] · 2^(e − 128) per 32 inputs, the e2m1 values doubled so that
// they are integers. The nibbles are codes in the 4-bit layout; the scales are bytes, not fp16:
// per (tile, group) the 16 rows' exponents e. The loops look each code up as
// u = kMxfp4Values[code] + kMxfp4Offset (0..24, an unsigned byte as the other formats' u),
// start each group's integer sum at −kMxfp4Offset·Σq, so that it is Σ value·q exactly, and
// scale it by 2^(e − 128): no offset term. |Σ value·q| ≤ 12·Q·32 stays within the 4-bit
// weights' headroom.
constexpr int kMxfp4Offset = 12;
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr uint8_t kMxfp4Codes[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
// 2^(e − 128) as ggml's GGML_E8M0_TO_FP32_HALF computes it (e < 2: subnormal).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// The 16 exponent bytes of (tile, group) of an MXFP4 weight.
inline const uint8_t* mxfp4_exponents_at(const PackedWeights& w, int tile, int group) {
  return reinterpret_cast<const uint8_t*>(w.scales) +
         (static_cast<size_t>(tile) * w.groups() + group) * kTileRows;
}

// Exponents below this are raised to it: 2^−e and 2^(e − H) stay normal floats.
constexpr int kMinExponent = -100;

// H above: the left shift that the largest possible |Σu·q| of a group stands inside int32 (for
// 6 bits, of Σ(u − 32)·q over 16 inputs, which is what those kernels shift).
inline int shift_headroom(int weight_bits, int activation_bits, int group) {
  const int64_t top = (int64_t{1} << (activation_bits - 1)) - 1;
  const int64_t most =
      weight_bits == 6 ? kQ6Offset * top * 16 : ((int64_t{1} << weight_bits) - 1) * top * group;
  int headroom = 0;
  while ((most << (headroom + 1)) <= std::numeric_limits<int32_t>::max()) ++headroom;
  return headroom;
}

// 2^e as a float; e in [−126, 127].
inline float power_of_two(int e) {
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The smallest e with amax·2^−e ≤ top, at least kMinExponent (a zero group: kMinExponent), from
// the bits: with amax = a·2^A and top = t·2^T (a, t in [1, 2)), e = A − T, or A − T + 1 when
// a > t. A library frexp per group was a visible cost in a small matmul.
inline int group_exponent(float amax, float top) {
  if (!(amax >= std::numeric_limits<float>::min()) || !(amax <= std::numeric_limits<float>::max()))
    return kMinExponent;  // zero, subnormal (q would round to 0 anyway), or not finite
  uint32_t a = 0, t = 0;
  std::memcpy(&a, &amax, sizeof a);
  std::memcpy(&t, &top, sizeof t);
  constexpr uint32_t mantissa = (1u << 23) - 1;
  const int e = static_cast<int>(a >> 23) - static_cast<int>(t >> 23) +
                ((a & mantissa) > (t & mantissa) ? 1 : 0);
  return std::max(e, kMinExponent);
}

// One row's scales from its groups' largest magnitudes amax[g], for `bits`-bit q (U, e and H as
// above): writes each group's s / unit, shift (e − U; 0 for int8) and 1/s
// (`inverse`, exactly 2^−e for int16), and the row's unit (1, or 2^U; NaN when a magnitude is
// not finite: the row's outputs are NaN then).
inline void row_scales(const float* amax, int groups, int bits, int headroom, float* scale,
                       int32_t* shift, float* inverse, float* unit) {
  const float top = bits == 16 ? 32767.0f : 127.0f;
  if (bits == 8) {  // float scales, unit 1
    for (int g = 0; g < groups; ++g) {
      scale[g] = amax[g] / top;
      inverse[g] = amax[g] > 0.0f ? top / amax[g] : 0.0f;
      shift[g] = 0;
    }
    *unit = 1.0f;
    return;
  }
  int largest = kMinExponent;
  bool finite = true;
  for (int g = 0; g < groups; ++g) {
    shift[g] = group_exponent(amax[g], top);
    largest = std::max(largest, static_cast<int>(shift[g]));
    finite = finite && std::isfinite(amax[g]);
  }
  const int exponent = largest - headroom;
  for (int g = 0; g < groups; ++g) {
    shift[g] = std::max(static_cast<int>(shift[g]), exponent) - exponent;
    scale[g] = power_of_two(shift[g]);
    inverse[g] = power_of_two(-(exponent + shift[g]));
  }
  *unit = finite ? power_of_two(exponent) : std::numeric_limits<float>::quiet_NaN();
}

// Where item i (a word of q, or a group's cell) of row r lies among rows of `per_row` items each,
// in panels of P rows (below; P = 0: row-major).
inline int64_t panel_index(int r, int64_t i, int64_t per_row, int P) {
  if (P == 0) return r * per_row + i;
  return (r / P * per_row + i) * P + r % P;
}

// Rows of activations quantized per group, row-major or in panels (`panel_rows` > 0): a panel
// holds P = panel_rows consecutive rows interleaved by 4-byte word, so that a kernel reading R
// rows at one input position reads one run of bytes through one pointer:
//   q        word j (2 int16 or 4 int8 inputs) of row r at [r / P][j][r % P]
//   per cell (row r, group g) at [r / P][g][r % P]
// The row count is rounded up to whole panels; the rows past the last are never read.
struct QuantizedRows {
  const void* q;          // int8_t or int16_t: [rows][k_padded] or panels
  int bits;               // 8 or 16: the type of q
  const float* scale;     // per cell: s / unit: s (int8), 2^(e − U) (int16)
  const int32_t* shift;   // per cell: e − U (int16; 0 for int8)
  const float* unit_sum;  // per cell: Σq·s / unit: the group's Σq in its row's unit
  const int32_t* sum;     // per cell: Σq
  const float* unit;      // [rows] 1 (int8) or 2^U (int16), always row-major
  // [rows][k_padded / 16] −32·Σq per 16 inputs, row-major: for 6-bit weights (null otherwise)
  const int32_t* centre;
  int k_padded;
  int groups;
  int panel_rows;  // 0: row-major
  int64_t words() const { return static_cast<int64_t>(k_padded) * bits / 32; }
  // Index of row r's word j of q, and of its cell (r, g).
  int64_t word_at(int r, int64_t j) const { return panel_index(r, j, words(), panel_rows); }
  int64_t cell_at(int r, int g) const { return panel_index(r, g, groups, panel_rows); }
};

// Calls f(std::integral_constant<int, BITS>, Q{}) for a weight's bits (4, 5, 6 or 8) and the
// activations' integer type Q (int16_t or int8_t): the one place a kernel table's `tiles` picks
// its template instance.
template <class F>
void with_weight_and_activation_types(int weight_bits, int activation_bits, F&& f) {
  auto with_q = [&](auto bits) {
    if (activation_bits == 16)
      f(bits, int16_t{});
    else
      f(bits, int8_t{});
  };
  switch (weight_bits) {
    case 4:
      return with_q(std::integral_constant<int, 4>{});
    case 5:
      return with_q(std::integral_constant<int, 5>{});
    case 6:
      return with_q(std::integral_constant<int, 6>{});
    default:
      return with_q(std::integral_constant<int, 8>{});
  }
}

// One ISA's implementation. `quantize_rows` writes `bits`-bit q (padded to whole groups with
// zeros) and the scales (for int16, with the headroom H) in its own layout (`panel_rows`; when
// it is P, every call starts at a panel's first row); `tiles` computes rows [row0, row0 + rows)
// of the outputs in tiles [tile0, tile1), rows ≤ max_rows, row0 a multiple of max_rows.
struct KernelTable {
  const char* name;
  int max_rows;
  int panel_rows;  // QuantizedRows::panel_rows of what quantize_rows writes
  void (*quantize_rows)(const float* x, int64_t x_stride, int rows, int k, int group, int bits,
                        int headroom, void* q, float* scale, int32_t* shift, float* unit_sum,
                        int32_t* sum, float* unit);
  void (*tiles)(const PackedWeights& w, const QuantizedRows& a, int row0, int rows, int tile0,
                int tile1, const float* bias, float* out, int64_t out_stride);
};

const KernelTable& scalar_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();
// AMX-INT8 tiles for int8 activations on many rows (qgemm_amx.cpp): the dispatcher uses it when
// switched on, where amx_problem() is empty (otherwise why not: no AMX, Linux refused the tile
// state, ...).
const KernelTable& amx_kernels();
const std::string& amx_problem();

}  // namespace pyserve_kernels
