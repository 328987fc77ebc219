// A mixture of experts' bookkeeping around its grouped matmuls (dispatch.h's grouped_matmul):
// the step's routing choices grouped by expert, and each token's expert outputs summed back.
// torch needs ~8 small ops a layer for the same (argsort, bincount, gathers, index_add), each a
// dispatch that costs more than its arithmetic at decode sizes.
#pragma once

#include <cstdint>

namespace pyserve_kernels {

// The choices experts[t][j] (with their weights) of `tokens` tokens, top_k each, grouped by
// expert: a stable counting sort, so that within an expert the rows keep token order, as
// torch.argsort(stable=True) orders them. Writes each grouped row's token and weight
// ([tokens · top_k]) and each expert's row count ([num_experts]).
void moe_group(const int64_t* experts, const float* weights, int tokens, int top_k, int num_experts,
               int64_t* row_token, float* row_weight, int64_t* counts);

// out[t] = Σ weight[r] · y[r] over the grouped rows r of token t, in row order (the experts in
// ascending order: transformers' order of addition), every token's row of out written.
void moe_combine(const float* y, int64_t y_stride, const int64_t* row_token,
                 const float* row_weight, int rows, int hidden, float* out, int64_t out_stride,
                 int tokens);

}  // namespace pyserve_kernels
