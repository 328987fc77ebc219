// A mixture of experts' bookkeeping around its grouped matmuls (dispatch.h's grouped_matmul):
// the router's choices (moe_route.cpp), the step's routing choices grouped by expert, and each
// token's expert outputs summed back.
// torch needs ~8 small ops a layer for the same (argsort, bincount, gathers, index_add), each a
// dispatch that costs more than its arithmetic at decode sizes.
#pragma once

#include <cstdint>

namespace pyserve_kernels {

// A mixture's router and its shared expert's gate (SparseMoE.route and its gate in
// pyserve/worker/models/moe.py), all in float32: logits = x · routerᵀ, a softmax over every
// expert, the top_k largest probabilities in torch.topk's order (its tie order too), rescaled to
// sum to 1 where `normalize`; shared_weight[t] = sigmoid(x_t · shared_gate). With a bias, each
// logit is x · router[e] + bias[e]; with softmax_after_top_k (gpt-oss) the top_k largest logits
// are picked first (torch.topk's order) and the weights are a softmax over those k alone
// (`normalize` unused). Each dot product sums in one fixed order on every ISA and thread count,
// so a token's route never depends on which of them ran it.
struct MoeRouteArgs {
  const float* x;  // [tokens][x_stride]
  int64_t x_stride;
  int tokens;
  int hidden;
  const float* router;  // [num_experts][hidden]
  int num_experts;
  int top_k;
  bool normalize;
  float* weights;                      // [tokens][top_k]: out
  int64_t* experts;                    // [tokens][top_k]: out
  const float* shared_gate = nullptr;  // [hidden], or none
  float* shared_weight = nullptr;      // [tokens]: out, with shared_gate
  const float* bias = nullptr;         // [num_experts], or none
  bool softmax_after_top_k = false;
};
void moe_route(const MoeRouteArgs& args);

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
