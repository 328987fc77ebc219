// The entry points behind `pyserve._kernels`: pick an ISA at run time, quantize the activations
// and split the output tiles over the thread pool.
#pragma once

#include <cstdint>
#include <string>

#include "qgemm.h"

namespace pyserve_kernels {

// "avx512_vnni", "avx2" or "scalar": the ISA in use (the best one here unless set_isa chose).
std::string current_isa();
// Switches to `name`; std::invalid_argument when it is unknown or this CPU lacks it.
void set_isa(const std::string& name);

// Whether int8 activations on many rows run on AMX tiles (with the avx512_vnni ISA only; off
// until set_amx(true)), and why they cannot ("" where they can: the CPU has AMX-INT8, Linux
// granted the tile state and a probe process ran the instructions; asked once per process).
bool amx_enabled();
// Turns AMX on (std::invalid_argument when it cannot run here) or off (the VNNI path for all).
void set_amx(bool on);
const std::string& amx_status();

// out[rows, w.n] = x[rows, w.k] · Wᵀ (+ bias), x quantized to `activation_bits` (8 or 16).
// Checks its arguments (std::invalid_argument).
void quantized_matmul(const float* x, int64_t x_stride, int rows, int activation_bits,
                      const PackedWeights& w, const float* bias, float* out, int64_t out_stride);

// A mixture of experts' grouped matmul: rows [r_e, r_e + counts[e]) of x times weights[e] into
// the same rows of out, r_e the sum of the counts before e (the rows grouped by expert). The
// experts share k and n; each is computed as quantized_matmul computes it, bit for bit.
void grouped_matmul(const float* x, int64_t x_stride, int activation_bits,
                    const PackedWeights* weights, const int64_t* counts, int experts, float* out,
                    int64_t out_stride);

// Quantizes rows as quantized_matmul does for `weight_bits` weights, for tests: q (int8 or
// int16) [rows][k_padded], and each group's scale 2^e and Σq [rows][groups].
void quantize_activations(const float* x, int64_t x_stride, int rows, int k, int group, int bits,
                          int weight_bits, void* q, float* scale, int32_t* sum);

}  // namespace pyserve_kernels
