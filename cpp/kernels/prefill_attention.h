// Paged prefill attention for the CPU worker: the chunks of several prompts (spans), each row
// attending causally to its request's cached tokens plus the chunk's own rows before it, with K
// and V read in place from the paged cache (written before the call, so a chunk sees exactly
// what later chunks and decodes read back). GQA, fp32 accumulation, online softmax; optionally a
// sliding window and soft-capped scores.
//
// Unlike decode, many query rows share every K/V row here, so the loops are a small GEMM: a work
// item is (span, kv head, 16 consecutive rows); its queries are held transposed ([dim][16] per
// query head), each key tile of ≤ 16 cache rows is converted to fp32 once for the whole GQA
// group, and scores, the softmax state and the output accumulate vectorized over the 16 rows
// (one AVX-512 register), with no horizontal reductions.
//
// Cache layout: as paged decode attention's (attention.h): K dimension-major within a block.
#pragma once

#include <cstdint>

#include "attention.h"

namespace pyserve_kernels {

struct PrefillAttentionArgs {
  const void* q;           // [num_rows][num_heads][head_dim], rows q_token_stride elements apart
  int64_t q_token_stride;  //
  DType q_dtype;           // also the output's
  int num_rows;            // rows of q and out
  int num_heads;
  const void* k_cache;  // [num_kv_heads][num_blocks][block_size][head_dim]
  const void* v_cache;
  DType cache_dtype;
  int num_kv_heads;
  int num_blocks;
  int block_size;
  int head_dim;
  const int64_t* spans;  // [num_spans][3]: first row in q, rows, cached tokens before them
  int num_spans;
  const void* block_tables;  // [num_spans][table_stride] block ids, int32 or int64
  int table_index_bytes;     // 4 or 8
  int64_t table_stride;
  float scale;
  void* out;  // [num_rows][num_heads][head_dim] in q_dtype; rows outside the spans untouched
  int64_t out_token_stride;
  // Row i of a span, at position p = start + i, sees positions [max(0, p − window + 1), p]
  // (Hugging Face's sliding window), 0: all; key tiles before every row's window are skipped.
  int window = 0;
  // Each score s (scale · q·k) becomes softcap · tanh(s / softcap) before the softmax; 0: none.
  float softcap = 0.0f;
  // [num_heads] float32: each head's sink logit, one more softmax column with no value
  // (gpt-oss); null: none.
  const float* sinks = nullptr;
  // An int8 cache's float16 scales, laid out as DecodeAttentionArgs' (attention.h); null otherwise.
  const uint16_t* k_scale = nullptr;
  const uint16_t* v_scale = nullptr;
};

// Checks the arguments (std::invalid_argument, block ids included) and computes the spans' rows.
void paged_prefill_attention(const PrefillAttentionArgs& args);

constexpr int kPrefillRows = 16;  // query rows of a work item: one float32 AVX-512 register

// One ISA's loops.
struct PrefillKernels {
  const char* name;
  // dst[i] = float(src[i]) for i < n (V rows)
  void (*to_float)(DType type, const void* src, int64_t n, float* dst);
  // dst[i·16 + t] = float(src[i·stride + t]) for i < dim, t < n ≤ 16, and 0 for t ≥ n: a K tile
  // of the cache's dimension-major blocks, as float32 [dim][16]
  void (*keys_to_float)(DType type, const void* src, int64_t stride, int dim, int n, float* dst);
  // qt [dim][16] = scale · the query rows, transposed: row j < rows at q + j·stride elements;
  // lanes of missing rows are 0
  void (*load_queries)(DType type, const void* q, int64_t stride, int rows, int dim, float scale,
                       float* qt);
  // row j < rows at out + j·stride elements = ot[·][j] / l[j], in the given type
  void (*store_output)(DType type, const float* ot, const float* l, int rows, int dim, void* out,
                       int64_t stride);
  // One key tile against the 16 rows of one query head. qt [dim][16]: the rows' queries,
  // pre-scaled, transposed; k [dim][16] and v [16][dim] float32 (keys ≥ tokens are ignored,
  // finite); row j may see key t only where t ≤ limit + j, and with a window > 0 only where
  // t > limit + j − window; softcap > 0 caps the scores (PrefillAttentionArgs). The state,
  // vectorized over the rows: m [16] running max, l [16] running sum, ot [dim][16] the output
  // so far (unnormalized, transposed).
  void (*tile)(const float* qt, const float* k, const float* v, int tokens, int dim, int limit,
               int window, float softcap, float* m, float* l, float* ot);
};

const PrefillKernels& scalar_prefill();
const PrefillKernels& avx512_prefill();

}  // namespace pyserve_kernels
