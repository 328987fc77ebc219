// The decoder layers of a Llama-family model run back to back in C++ on the CPU kernels: per
// layer RMSNorm (adding the residual), the fused qkv matmul, RoPE + KV write, paged prefill and
// decode attention, the o matmul, RMSNorm (adding the residual), the gate/up matmul, SiLU·up and
// the down matmul: the same calls, in the same order and on the same buffers' values, as the
// Python modules make (pyserve/worker/models/llama.py), so the results are bit for bit theirs.
// What it removes is Python between the ~9 calls a layer (module calls, argument checks, tensor
// allocations: ~9% of a batch-32 decode step's time, when the kernels' thread pool waits).
//
// The stack holds pointers into tensors that Python owns (packed weights, norms, caches); the
// Python side (pyserve/worker/cpu_decoder.py) keeps them alive and checks every shape once.
#pragma once

#include <cstdint>
#include <vector>

#include "attention.h"
#include "qgemm.h"

namespace pyserve_kernels {

struct StackLinear {
  PackedWeights weights;
  const float* bias;  // [n] or nullptr
  int activation_bits;
};

struct StackLayer {
  const float* input_norm;  // [hidden]
  const float* post_attention_norm;
  StackLinear qkv, o, gate_up, down;
  void* k_cache;  // this layer's, [num_kv_heads][num_blocks][head_dim][block_size]
  void* v_cache;  // [num_kv_heads][num_blocks][block_size][head_dim]
};

struct StackShape {
  int hidden;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int intermediate;
  float eps;
  DType cache_dtype;
  int num_blocks;
  int block_size;
};

// One forward's rows (T of them) and attention metadata; all float32 / int64.
struct StackBatch {
  int rows;
  float* hidden;         // [T][hidden]: in, the embeddings; out, the last layer's MLP output
  float* residual;       // [T][hidden]: out, the residual stream the last MLP output adds to
  const float* cos;      // [T][head_dim]
  const float* sin;      // [T][head_dim], negated in the first half (rope.py's signed_sin)
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
};

class DecoderStack {
 public:
  explicit DecoderStack(const StackShape& shape);
  void add_layer(const StackLayer& layer);
  int num_layers() const { return static_cast<int>(layers_.size()); }
  // Runs every layer over the batch (std::invalid_argument on inconsistent arguments).
  void forward(const StackBatch& batch) const;

 private:
  StackShape shape_;
  std::vector<StackLayer> layers_;
};

}  // namespace pyserve_kernels
