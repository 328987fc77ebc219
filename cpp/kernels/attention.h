// Paged decode attention for the CPU worker: D single-token queries, each attending to its own
// request's K/V read in place from the paged cache (no gather copy), GQA, fp32 accumulation with
// an online softmax, work split over (request, kv head, context partition) and the partitions
// merged at the end (flash-decoding). Optionally a sliding window (only its blocks are read) and
// soft-capped scores.
//
// Cache layout per layer (pyserve/worker/kv_cache.py), contiguous: V is
// [num_kv_heads][num_blocks][block_size][head_dim], K is [num_kv_heads][num_blocks][head_dim]
// [block_size]: within a block, one dimension of its tokens is one vector, so scoring the block's
// tokens against a query head is FMAs of a broadcast query element with K vectors, with no
// per-token horizontal sums. Query head h reads kv head h / (num_heads / num_kv_heads).
#pragma once

#include <cstdint>

namespace pyserve_kernels {

// Element types of q, the cache and the output (the codes cross the Python boundary). kInt8: a
// cache of symmetric int8 values as llama.cpp's q8_0 (pyserve/worker/kv_cache.py): each run of
// kInt8Group values of a token's head (the last one shorter where head_dim is not a multiple)
// has a float16 scale beside it, element i of a token's head is value[i] · scale[i / kInt8Group].
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt8 = 3 };

constexpr int kInt8Group = 32;
// An int8 cache's scales per (token, kv head).
constexpr int int8_groups(int head_dim) { return (head_dim + kInt8Group - 1) / kInt8Group; }

struct DecodeAttentionArgs {
  const void* q;           // [num_queries][num_heads][head_dim], rows num_heads·head_dim apart…
  int64_t q_token_stride;  // …or this many elements apart
  DType q_dtype;           // also the output's
  int num_queries;         // D
  int num_heads;           // H
  const void* k_cache;     // [num_kv_heads][num_blocks][head_dim][block_size]
  const void* v_cache;     // [num_kv_heads][num_blocks][block_size][head_dim]
  DType cache_dtype;
  int num_kv_heads;
  int num_blocks;
  int block_size;
  int head_dim;
  const void* block_tables;  // [num_queries][table_stride] block ids, int32 or int64
  int table_index_bytes;     // 4 or 8
  int64_t table_stride;
  const void* context_lens;  // [num_queries] tokens to attend to, int32 or int64
  int context_index_bytes;   // 4 or 8
  float scale;
  void* out;  // [num_queries][num_heads][head_dim], q_dtype
  int64_t out_token_stride;
  int partition_tokens;  // context tokens per work item; 0: chosen from the load and threads
  // A query at position p = context − 1 sees positions [max(0, p − window + 1), p] (the last
  // `window`, Hugging Face's sliding window), 0: all; the blocks before are never read.
  int window = 0;
  // Each score s (scale · q·k) becomes softcap · tanh(s / softcap) before the softmax; 0: none.
  float softcap = 0.0f;
  // [num_heads] float32: each head's sink logit, one more softmax column with no value
  // (gpt-oss); null: none.
  const float* sinks = nullptr;
  // [num_queries], context_index_bytes wide: each query's own position p, where its window ends
  // (it sees [max(0, p − window + 1), context)); null: p = context − 1. A query of a run of
  // positions that attend to each other both ways (Gemma 3's images) reads past itself.
  const void* positions = nullptr;
  // An int8 cache's float16 scales (their bits), laid out as K and V are with a group in place of
  // kInt8Group dimensions: K's [num_kv_heads][num_blocks][groups][block_size], V's
  // [num_kv_heads][num_blocks][block_size][groups]; null otherwise.
  const uint16_t* k_scale = nullptr;
  const uint16_t* v_scale = nullptr;
};

// Checks the arguments (std::invalid_argument, block ids included) and computes the output.
void paged_decode_attention(const DecodeAttentionArgs& args);

// s[i] = cap · tanh(s[i] / cap) for i < n with the current ISA's loops; returns the largest.
float attention_softcap(float* s, int n, float cap);

// The tokens per partition that `partition_tokens = 0` picks for these contexts.
int auto_partition_tokens(int64_t total_context_tokens, int num_kv_heads, int threads);

// One ISA's inner loops over a chunk of a work item: up to kChunkTiles tiles, each ≤ kTileTokens
// consecutive tokens of one block and kv head. A chunk is scored, softmaxed and accumulated as
// one piece (one maximum and one exp pass per head a chunk, the sums in registers across its
// tiles), and the loops prefetch the next chunk's cache lines into L2 while they compute, a few
// lines an iteration: the blocks lie anywhere in the cache, out of the hardware prefetcher's
// sight, and a burst of prefetches stalls on the core's few miss buffers.
constexpr int kTileTokens = 32;
constexpr int kChunkTiles = 4;
constexpr int kChunkTokens = kTileTokens * kChunkTiles;
constexpr int kChunkSpans = 2 * kChunkTiles;

struct Tile {
  const void* k;  // its first token's element 0 in K: element i of token t at k[i·k_stride + t]
  const void* v;  // its first token's row in V: element i of token t at v[t·dim + i]
  int tokens;
  // An int8 cache's float16 scales of the tile's tokens, null otherwise: group g of token t at
  // k_scale[g·k_stride + t] (dimension-major as K) and at v_scale[t·groups + g] (token-major as
  // V). The ISA loops multiply each group's dot product of raw int8 values by its K scale and add
  // it to the token's score; and add each group of a V row times its softmax weight · V scale.
  const uint16_t* k_scale = nullptr;
  const uint16_t* v_scale = nullptr;
};

// Cache bytes to prefetch: [begin, begin + bytes). A chunk's spans: a tile's K block (or V rows)
// and, in an int8 cache, its scales.
struct PrefetchSpan {
  const char* begin;
  int64_t bytes;
};

struct AttentionKernels {
  const char* name;
  // s[h·stride + o_j + t] = q[h] · key t of tile j, o_j the tokens of the tiles before j, for
  // h < group; top[h] = the largest of them. Prefetches `ahead` (the next chunk's K) meanwhile.
  void (*score)(DType cache, const float* q, int group, int dim, int64_t k_stride,
                const Tile* tiles, int count, const PrefetchSpan* ahead, int ahead_count, float* s,
                int stride, float* top);
  // s[t] = exp(s[t] − shift) for t < n; returns Σ s[t]
  float (*exp_sum)(float* s, int n, float shift);
  // s[t] = cap · tanh(s[t] / cap) for t < n (n ≥ 1); returns the largest
  float (*softcap)(float* s, int n, float cap);
  // acc[h·dim + i] += Σ_t p[h·stride + o_j + t] · (element i of V token t of tile j), over the
  // tiles; prefetches `ahead` (the next chunk's V rows) meanwhile.
  void (*accumulate)(DType cache, const float* p, int stride, int group, int dim, const Tile* tiles,
                     int count, const PrefetchSpan* ahead, int ahead_count, float* acc);
};

// Prefetches whole spans into L2 at once: the portable and AVX2 loops' way.
inline void prefetch_spans(const PrefetchSpan* spans, int count) {
  for (int i = 0; i < count; ++i)
    for (int64_t byte = 0; byte < spans[i].bytes; byte += 64)
      __builtin_prefetch(spans[i].begin + byte, 0, 2);
}

const AttentionKernels& scalar_attention();
const AttentionKernels& avx2_attention();
const AttentionKernels& avx512_attention();

}  // namespace pyserve_kernels
