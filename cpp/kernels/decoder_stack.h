// The decoder layers of a model run back to back in C++ on the CPU kernels: per layer RMSNorm
// (adding the residual), the fused qkv matmul, [full-width q/k norms], RoPE + KV write (with the
// layer's rope table and, if the model has them, per-head q/k norms), paged prefill and decode
// attention (the layer's sliding window and sinks, the model's soft-cap), the o matmul, [RMSNorm],
// RMSNorm (adding the residual), the gate/up matmul, the gated activation (SiLU, GELU-tanh or
// gpt-oss's clamped SwiGLU), the down matmul, or in their place a mixture of experts (StackMoE),
// [RMSNorm]; the bracketed norms after the o and down matmuls are Gemma's sandwich. These are the
// calls, in the same order and on the same buffers' values, that the Python layer loop makes
// (DecoderLayer.forward in pyserve/worker/models/decoder.py over the CPU kernels backend), so the
// results are bit for bit its. What it removes is Python between the ~9 calls a layer (module
// calls, argument checks, tensor allocations: a visible share of a batch-32 decode step, while the
// kernels' pool waits).
//
// The stack holds pointers into tensors that Python owns (packed weights, norms, caches); the
// Python side (pyserve/worker/backends/cpu/stack.py) keeps them alive and checks every shape once.
#pragma once

#include <cstdint>
#include <vector>

#include "attention.h"
#include "layer_ops.h"
#include "qgemm.h"

namespace pyserve_kernels {

// Rows of a fused projection after its first segment's, packed at their own precision.
struct StackSegment {
  PackedWeights weights;
  const float* bias;  // this segment's [weights.n] or nullptr
};

struct StackLinear {
  PackedWeights weights;
  const float* bias;  // [n] or nullptr
  int activation_bits;
  // A fused projection whose parts a file holds at different precisions (q and k 4-bit, v 8-bit)
  // keeps them as row segments, each on its own kernel, rather than widening all of them: the
  // outputs are `weights`' rows, then each segment's, in order.
  std::vector<StackSegment> more = {};
  int n() const {
    int rows = weights.n;
    for (const auto& segment : more) rows += segment.weights.n;
    return rows;
  }
};

// A mixture of experts in place of a layer's dense MLP (SparseMoE, pyserve/worker/models/moe.py,
// as the CPU kernels backend runs it): the router (moe_route), the routing choices grouped by
// expert (moe_group), every active expert's gate/up and down as one grouped matmul each with the
// gated activation between, each token's outputs summed back in expert order (moe_combine), and
// where the model has one the shared expert, scaled by its sigmoid gate and added. gpt-oss's
// router adds a bias to its logits and takes the softmax of the top k alone, and its experts add
// a bias to each grouped row after each grouped matmul (as ExpertKernels.run in
// pyserve/worker/backends/cpu/experts.py).
struct StackMoE {
  const float* router = nullptr;  // [num_experts][hidden]
  int num_experts = 0;
  int top_k = 0;
  bool normalize = false;               // the k weights rescaled to sum to 1
  const float* router_bias = nullptr;   // [num_experts], or none
  bool softmax_after_top_k = false;     // moe_route's mode (MoeRouteArgs)
  const float* gate_up_bias = nullptr;  // [num_experts][2 · width], or none
  const float* down_bias = nullptr;     // [num_experts][hidden], or none
  int activation_bits = 16;
  std::vector<PackedWeights> gate_up;  // per expert: [2 · width][hidden]
  std::vector<PackedWeights> down;     // per expert: [hidden][width]
  // the shared expert (Qwen2-MoE), or none: its gate [hidden] and projections
  const float* shared_gate = nullptr;
  StackLinear shared_gate_up{}, shared_down{};
  int width() const { return down.empty() ? 0 : down[0].k; }
  int shared_width() const { return shared_gate == nullptr ? 0 : shared_down.weights.k; }
};

struct StackLayer {
  const float* input_norm;  // [hidden]
  const float* post_attention_norm;
  StackLinear qkv, o, gate_up, down;  // gate_up and down: the dense MLP's (unused with `moe`)
  void* k_cache;  // this layer's, [num_kv_heads][num_blocks][head_dim][block_size]
  void* v_cache;  // [num_kv_heads][num_blocks][block_size][head_dim]
  // both or neither: RMSNorm of every q and k head before RoPE (Qwen3, Gemma 3), [head_dim] each;
  // with full_width_qk_norm, of all q heads together and all k heads together (OLMoE), the
  // weights [num_heads · head_dim] and [num_kv_heads · head_dim]
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  bool full_width_qk_norm = false;
  // [hidden] each, or none: the o projection's output normalized (no residual) before it joins
  // the residual stream, and the down projection's likewise (Gemma 2/3's sandwich)
  const float* attn_out_norm = nullptr;
  const float* mlp_out_norm = nullptr;
  int rope_table = 0;            // which of the forward's cos/sin tables this layer rotates with
  int window = 0;                // attends to the last `window` positions (itself included); 0: all
  const float* sinks = nullptr;  // [num_heads]: each head's sink logit (gpt-oss), or none
  // an int8 cache's float16 scales, laid out as attention.h's DecodeAttentionArgs says; or none
  uint16_t* k_scale = nullptr;
  uint16_t* v_scale = nullptr;
  StackMoE moe = {};  // router set: this layer's MLP is a mixture of experts
  bool is_moe() const { return moe.router != nullptr; }
};

struct StackShape {
  int hidden;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int intermediate;
  float eps;  // every norm's, the q/k norms' included
  DType cache_dtype;
  int num_blocks;
  int block_size;
  GatedActivation activation = GatedActivation::kSilu;
  float swiglu_alpha = 0.0f;  // the clamped SwiGLU's (unused by the other activations)
  float swiglu_limit = 0.0f;
  float softcap = 0.0f;  // attention scores → softcap · tanh(s / softcap); 0: none
  // The rope tables' rotated dims (each even, in [2, head_dim]; < head_dim: partial rotary),
  // one per table: the forward receives each table's cos and sin, [T][rotary_dims[i]].
  std::vector<int> rotary_dims;
};

// One forward's rows (T of them) and attention metadata; all float32 / int64.
struct StackBatch {
  int rows;
  float* hidden;    // [T][hidden]: in, the embeddings; out, the last layer's MLP output
  float* residual;  // [T][hidden]: out, the residual stream the last MLP output adds to
  // per rope table (num_rope_tables of them, as the shape's rotary_dims): [T][rotary_dim] each
  const float* const* cos;
  const float* const* sin;  // negated in the first half of the rotated dims (rope.py's signed_sin)
  int num_rope_tables;
  const int64_t* slots;  // [T]: each row's cache slot
  const int64_t* spans;  // [num_spans][3]: prompt chunks (first row, rows, cached tokens before)
  int num_spans;
  const int64_t* span_tables;  // [num_spans][span_table_stride]
  int64_t span_table_stride;
  int num_decodes;               // single-token rows
  const int64_t* decode_rows;    // [num_decodes]: their rows in the batch
  const int64_t* decode_tables;  // [num_decodes][decode_table_stride]
  int64_t decode_table_stride;
  const int64_t* context_lens;  // [num_decodes]
  float scale;                  // attention's, head_dim^-0.5 unless the model says otherwise
  // [num_decodes]: each decode row's own position, where its window ends (DecodeAttentionArgs);
  // null: context − 1
  const int64_t* decode_positions = nullptr;
};

class DecoderStack {
 public:
  explicit DecoderStack(const StackShape& shape);  // no rotary_dims: one table of head_dim
  void add_layer(const StackLayer& layer);
  int num_layers() const { return static_cast<int>(layers_.size()); }
  int num_rope_tables() const { return static_cast<int>(shape_.rotary_dims.size()); }
  // Runs every layer over the batch (std::invalid_argument on inconsistent arguments).
  void forward(const StackBatch& batch) const;

 private:
  StackShape shape_;
  std::vector<StackLayer> layers_;
};

}  // namespace pyserve_kernels
