// llama.cpp's quantized blocks packed straight into the matmul kernels' tiles (qgemm.h), with no
// float in between: every group of 32 weights of the types below is already w = d·u + m with
// unsigned u and one scale and offset, so a load only moves bits.
//   Q4_0 d·(q − 8), Q4_1 d·q + m, Q5_0 d·(q − 16), Q5_1 d·q + m, Q8_0 d·q (q signed, u = q + 128):
//     d and m are the file's fp16 (m = −8d, −16d, −128d: exact), bit for bit.
//   Q4_K, Q5_K: super-blocks of 256 with a 6-bit scale sc and min mn per 32 (w = d·sc·q − dmin·mn):
//     d·sc and dmin·mn are exact in float32 and rounded once to fp16 (nearest even); or, with
//     `super_scales` (Q4_K into 4 bits, Q5_K into 5), d, −dmin, sc and mn kept as they are
//     (qgemm.h): bit for bit.
//   The 5-bit types go into 8-bit tiles, or 5-bit ones (qgemm.h: nibbles and a plane of high bits).
//   Q6_K d·sc·(q − 32), sc per 16 weights: into 6-bit tiles with `super_scales`, d, sc and q as
//     they are (qgemm.h): bit for bit. Into 8-bit tiles (fp16 scales per 32), its weights are
//     computed as llama.cpp dequantizes them and rounded exactly as
//     pyserve.worker.quant.quantize_weight rounds floats (within half an int8 step of each
//     group's largest weight / 127).
//   MXFP4 value·2^(e − 128), value an integer in [−12, 12]: into 4-bit tiles in its own form
//     (qgemm.h: the codes and exponent bytes as they are), or into 8-bit ones as u = value + 128,
//     d = 2^(e − 128), m = −128·d: bit for bit where fp16 holds d and m (e in [104, 136]), else
//     rounded as Q6_K's are.
// Other types (Q2_K/Q3_K, the IQ grids) are not this form; the loader dequantizes and quantizes
// those (pyserve/worker/weight_packing.py).
#pragma once

#include <cstdint>
#include <string>

namespace pyserve_kernels {

enum class GgmlType { kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kMXFP4 };

// Parses a GGML type name ("Q4_K"); throws std::invalid_argument for the others.
GgmlType ggml_type_named(const std::string& name);

// The largest u a type's groups hold (15: fits 4-bit tiles; 31: 5-bit ones; 255: 8-bit ones
// only; Q6_K's 63: 6-bit tiles, or rounded into 8-bit ones; MXFP4: its 8-bit form's 140).
int ggml_type_largest_u(GgmlType type);

// rows × k weights, row r's blocks at blocks + r·row_bytes, into the tiles of `bits`-bit weights:
// data [ceil(rows/16)][k/32][32·16·bits/8] and scales [ceil(rows/16)][k/32][32] (fp16 bits),
// padding rows zero. k must be a multiple of the type's block; throws std::invalid_argument if
// the type's u do not fit `bits` (4, 5, 6 or 8). `super_scales` (Q4_K into 4 bits, Q5_K into 5):
// the scales are
// [ceil(rows/16)][k/256][kSuperScaleHalves] in qgemm.h's super-block form, the file's D, −Dmin
// and 6-bit sc, mn as they are: every weight exactly the file's. Q6_K into 6 bits (with
// `super_scales` only): data [..][k/32][384], scales [..][k/256][kQ6ScaleHalves], qgemm.h's
// Q6_K form, every weight the file's. MXFP4 into 4 bits: data in the 4-bit layout holding its
// codes, scales [ceil(rows/16)][k/32][16] bytes: its exponents (qgemm.h), every weight the file's.
void repack_ggml(GgmlType type, const uint8_t* blocks, int64_t row_bytes, int rows, int k, int bits,
                 uint8_t* data, uint16_t* scales, bool super_scales = false);

}  // namespace pyserve_kernels
