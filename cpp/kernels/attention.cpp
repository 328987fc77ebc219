// paged_decode_attention: argument checks, the split into work items, the online softmax over a
// work item's tiles, and the merge of a request's partitions.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "arg_checks.h"
#include "attention.h"
#include "attention_convert.h"
#include "dispatch.h"
#include "thread_pool.h"

namespace pyserve_kernels {
namespace {

// Contexts shorter than this are never split: a partition's merge and its item's setup (q
// conversion, a partial written and read back) cost about as much as this many tokens.
constexpr int kMinPartitionTokens = 256;
// With the automatic choice, the work is cut into about this many items per thread, so that
// threads claiming items one at a time finish close together.
constexpr int kItemsPerThread = 8;
const AttentionKernels& kernels_for_isa() {
  const std::string isa = current_isa();  // set_isa picks the attention loops too
  if (isa == "avx512_vnni") return avx512_attention();
  if (isa == "avx2") return avx2_attention();
  return scalar_attention();
}

// One (request, kv head, context range) of the work; `partial` < 0 when the range is the
// request's whole context and the item writes the output itself.
struct WorkItem {
  int query;
  int kv_head;
  int begin;
  int end;
  int64_t partial;
};

// The partitions of one (request, kv head): items [first, first + count).
struct Merge {
  int first;
  int count;
};

struct Job {
  const DecodeAttentionArgs* args;
  const AttentionKernels* kernels;
  const WorkItem* items;
  const Merge* merges;
  float* partials;  // per partial: m [group], l [group], acc [group][head_dim]
  int group;
};

int64_t partial_floats(int group, int dim) { return static_cast<int64_t>(group) * (dim + 2); }

// The first position query d, with this context, sees.
int64_t first_visible(const DecodeAttentionArgs& a, int d, int64_t context) {
  if (a.window <= 0) return 0;
  const int64_t position =
      a.positions != nullptr ? index_at(a.positions, a.context_index_bytes, d) : context - 1;
  return std::max<int64_t>(0, position - a.window + 1);
}

// acc / l, each head's sums relative to its maximum m; a sink adds exp(sink − m) to the sum.
void write_output(const DecodeAttentionArgs& a, const WorkItem& item, int group, const float* acc,
                  const float* l, const float* m) {
  const int dim = a.head_dim;
  const int64_t row =
      item.query * a.out_token_stride + static_cast<int64_t>(item.kv_head) * group * dim;
  for (int h = 0; h < group; ++h) {
    float sum = l[h];
    if (a.sinks != nullptr) sum += std::exp(a.sinks[item.kv_head * group + h] - m[h]);
    const float inverse = 1.0f / sum;
    for (int i = 0; i < dim; ++i)
      store_element(a.q_dtype, a.out, row + h * dim + i, acc[h * dim + i] * inverse);
  }
}

void attend(void* context, int chunk) {
  const Job& job = *static_cast<const Job*>(context);
  const DecodeAttentionArgs& a = *job.args;
  const AttentionKernels& kernels = *job.kernels;
  const WorkItem& item = job.items[chunk];
  const int group = job.group, dim = a.head_dim, bs = a.block_size;

  thread_local std::vector<float> q, scores, acc, m, l, top;
  q.resize(static_cast<size_t>(group) * dim);
  top.resize(group);
  scores.resize(static_cast<size_t>(group) * kChunkTokens);
  acc.assign(static_cast<size_t>(group) * dim, 0.0f);
  m.assign(group, -std::numeric_limits<float>::infinity());
  l.assign(group, 0.0f);

  const int64_t q_row =
      item.query * a.q_token_stride + static_cast<int64_t>(item.kv_head) * group * dim;
  for (int i = 0; i < group * dim; ++i) q[i] = load_element(a.q_dtype, a.q, q_row + i) * a.scale;

  const int64_t element = element_bytes(a.cache_dtype);
  const int64_t head_offset = static_cast<int64_t>(item.kv_head) * a.num_blocks * bs * dim;
  const char* k_head = static_cast<const char*>(a.k_cache) + head_offset * element;
  const char* v_head = static_cast<const char*>(a.v_cache) + head_offset * element;
  const int64_t table_row = item.query * a.table_stride;
  const int64_t block_bytes = static_cast<int64_t>(bs) * dim * element;
  const bool quantized = a.cache_dtype == DType::kInt8;
  // an int8 cache's scales: a block's are bs·groups in both layouts, token t's (and group 0's) at
  // t in K's, at t·groups in V's
  const int groups = int8_groups(dim);
  const int64_t block_scales = static_cast<int64_t>(bs) * groups;
  const int64_t head_scales = static_cast<int64_t>(item.kv_head) * a.num_blocks * block_scales;

  // The item's tiles, a chunk at a time: a tile never crosses a block; a block is bs·dim
  // elements in both caches, its token t at t in K (dimension-major), at t·dim in V. Each
  // chunk's cache lines (K's whole blocks, V's rows, and their scales) are prefetched while the
  // chunk before it is computed; the first chunk's at once.
  struct Chunk {
    Tile tiles[kChunkTiles];
    PrefetchSpan k_lines[kChunkSpans];
    PrefetchSpan v_lines[kChunkSpans];
    int count = 0;
    int spans = 0;
    int tokens = 0;
  };
  int pos = item.begin;
  const auto next_chunk = [&](Chunk& chunk) {
    chunk.count = chunk.spans = chunk.tokens = 0;
    while (chunk.count < kChunkTiles && pos < item.end) {
      const int64_t block = index_at(a.block_tables, a.table_index_bytes, table_row + pos / bs);
      const int offset = pos % bs;
      const int tokens = std::min({item.end - pos, bs - offset, kTileTokens});
      const char* k = k_head + block * block_bytes;
      const char* v = v_head + block * block_bytes + offset * dim * element;
      Tile& tile = chunk.tiles[chunk.count];
      tile = {k + offset * element, v, tokens};
      chunk.k_lines[chunk.spans] = {k, block_bytes};
      chunk.v_lines[chunk.spans] = {v, tokens * dim * element};
      ++chunk.spans;
      if (quantized) {
        const uint16_t* k_scales = a.k_scale + head_scales + block * block_scales;
        const uint16_t* v_scales = a.v_scale + head_scales + block * block_scales;
        tile.k_scale = k_scales + offset;
        tile.v_scale = v_scales + static_cast<int64_t>(offset) * groups;
        constexpr int64_t kHalf = sizeof(uint16_t);
        chunk.k_lines[chunk.spans] = {reinterpret_cast<const char*>(k_scales),
                                      block_scales * kHalf};
        chunk.v_lines[chunk.spans] = {reinterpret_cast<const char*>(tile.v_scale),
                                      static_cast<int64_t>(tokens) * groups * kHalf};
        ++chunk.spans;
      }
      ++chunk.count;
      chunk.tokens += tokens;
      pos += tokens;
    }
  };
  Chunk chunks[2];
  next_chunk(chunks[0]);
  prefetch_spans(chunks[0].k_lines, chunks[0].spans);
  prefetch_spans(chunks[0].v_lines, chunks[0].spans);
  for (int c = 0; chunks[c].count > 0; c ^= 1) {
    const Chunk& now = chunks[c];
    Chunk& ahead = chunks[c ^ 1];
    next_chunk(ahead);
    kernels.score(a.cache_dtype, q.data(), group, dim, bs, now.tiles, now.count, ahead.k_lines,
                  ahead.spans, scores.data(), kChunkTokens, top.data());
    if (a.softcap > 0.0f)
      for (int h = 0; h < group; ++h)
        top[h] = kernels.softcap(scores.data() + h * kChunkTokens, now.tokens, a.softcap);
    for (int h = 0; h < group; ++h) {
      float* s = scores.data() + h * kChunkTokens;
      if (top[h] > m[h]) {  // rescale what was summed so far to the new maximum
        const float factor = std::exp(m[h] - top[h]);
        for (int i = 0; i < dim; ++i) acc[h * dim + i] *= factor;
        l[h] *= factor;
        m[h] = top[h];
      }
      l[h] += kernels.exp_sum(s, now.tokens, m[h]);
    }
    kernels.accumulate(a.cache_dtype, scores.data(), kChunkTokens, group, dim, now.tiles, now.count,
                       ahead.v_lines, ahead.spans, acc.data());
  }

  if (item.partial < 0) {
    write_output(a, item, group, acc.data(), l.data(), m.data());
    return;
  }
  float* out = job.partials + item.partial * partial_floats(group, dim);
  std::copy(m.begin(), m.end(), out);
  std::copy(l.begin(), l.end(), out + group);
  std::copy(acc.begin(), acc.end(), out + 2 * group);
}

// Rescales each partition's sums to the largest of their maxima and adds them up.
void merge(void* context, int chunk) {
  const Job& job = *static_cast<const Job*>(context);
  const Merge& merge = job.merges[chunk];
  const int group = job.group, dim = job.args->head_dim;
  const int64_t stride = partial_floats(group, dim);
  thread_local std::vector<float> acc, l, tops;
  acc.assign(static_cast<size_t>(group) * dim, 0.0f);
  l.assign(group, 0.0f);
  tops.assign(group, -std::numeric_limits<float>::infinity());
  for (int h = 0; h < group; ++h) {
    float& top = tops[h];
    for (int p = 0; p < merge.count; ++p) {
      const float* part = job.partials + job.items[merge.first + p].partial * stride;
      top = std::max(top, part[h]);
    }
    for (int p = 0; p < merge.count; ++p) {
      const float* part = job.partials + job.items[merge.first + p].partial * stride;
      const float weight = std::exp(part[h] - top);
      l[h] += part[group + h] * weight;
      const float* part_acc = part + 2 * group + h * dim;
      for (int i = 0; i < dim; ++i) acc[h * dim + i] += part_acc[i] * weight;
    }
  }
  write_output(*job.args, job.items[merge.first], group, acc.data(), l.data(), tops.data());
}

void check_args(const DecodeAttentionArgs& a) {
  check(a.q != nullptr && a.k_cache != nullptr && a.v_cache != nullptr && a.out != nullptr &&
            a.block_tables != nullptr && a.context_lens != nullptr,
        "null pointer");
  check(
      a.q_dtype == DType::kFloat32 || a.q_dtype == DType::kBFloat16 || a.q_dtype == DType::kFloat16,
      "q dtype codes: 0 float32, 1 bfloat16, 2 float16");
  check_cache_dtype(a.cache_dtype, a.k_scale, a.v_scale);
  check(a.num_queries >= 0, "num_queries must be >= 0");
  check(a.num_heads >= 1 && a.num_kv_heads >= 1 && a.num_heads % a.num_kv_heads == 0,
        "num_heads must be a positive multiple of num_kv_heads");
  check(a.head_dim >= 1 && a.block_size >= 1 && a.num_blocks >= 1,
        "head_dim, block_size and num_blocks must be >= 1");
  check(a.table_index_bytes == 4 || a.table_index_bytes == 8, "block ids must be int32 or int64");
  check(a.context_index_bytes == 4 || a.context_index_bytes == 8,
        "context lengths must be int32 or int64");
  const int64_t row = static_cast<int64_t>(a.num_heads) * a.head_dim;
  check(a.q_token_stride >= row && a.out_token_stride >= row, "a token stride is too short");
  check(a.table_stride >= 1, "table_stride must be >= 1");
  check(a.partition_tokens >= 0, "partition_tokens must be >= 0");
  check(a.window >= 0, "window must be >= 0");
  check(std::isfinite(a.softcap) && a.softcap >= 0.0f, "softcap must be finite and >= 0");
  if (a.sinks != nullptr)
    for (int h = 0; h < a.num_heads; ++h) check(std::isfinite(a.sinks[h]), "a sink is not finite");
  for (int d = 0; d < a.num_queries; ++d) {
    const int64_t context = index_at(a.context_lens, a.context_index_bytes, d);
    check(context >= 1 && context <= a.table_stride * a.block_size, [&] {
      return "query " + std::to_string(d) + ": context length " + std::to_string(context) +
             " is not in [1, table width * block_size]";
    });
    if (a.positions != nullptr) {
      const int64_t position = index_at(a.positions, a.context_index_bytes, d);
      check(position >= 0 && position < context, [&] {
        return "query " + std::to_string(d) + ": position " + std::to_string(position) +
               " is not inside its context of " + std::to_string(context);
      });
    }
    const int64_t blocks = (context + a.block_size - 1) / a.block_size;
    for (int64_t b = first_visible(a, d, context) / a.block_size; b < blocks; ++b) {
      const int64_t id = index_at(a.block_tables, a.table_index_bytes, d * a.table_stride + b);
      check(id >= 0 && id < a.num_blocks, [&] {
        return "query " + std::to_string(d) + ": block id " + std::to_string(id) +
               " is out of range";
      });
    }
  }
}

}  // namespace

int auto_partition_tokens(int64_t total_context_tokens, int num_kv_heads, int threads) {
  if (threads <= 1) return std::numeric_limits<int>::max();
  const int64_t work = total_context_tokens * num_kv_heads;
  const int64_t items = static_cast<int64_t>(kItemsPerThread) * threads;
  const int64_t per_item = (work + items - 1) / items;
  const int64_t rounded = (per_item + kTileTokens - 1) / kTileTokens * kTileTokens;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(kMinPartitionTokens, rounded),
                                            std::numeric_limits<int>::max()));
}

float attention_softcap(float* s, int n, float cap) { return kernels_for_isa().softcap(s, n, cap); }

void paged_decode_attention(const DecodeAttentionArgs& args) {
  check_args(args);
  if (args.num_queries == 0) return;
  ThreadPool& pool = ThreadPool::instance();
  int64_t total = 0;
  for (int d = 0; d < args.num_queries; ++d) {
    const int64_t context = index_at(args.context_lens, args.context_index_bytes, d);
    total += context - first_visible(args, d, context);
  }
  const int partition = args.partition_tokens > 0
                            ? args.partition_tokens
                            : auto_partition_tokens(total, args.num_kv_heads, pool.size());

  thread_local std::vector<WorkItem> items;
  thread_local std::vector<Merge> merges;
  thread_local std::vector<float> partials;
  items.clear();
  merges.clear();
  int64_t num_partials = 0;
  for (int d = 0; d < args.num_queries; ++d) {
    const auto context = static_cast<int>(index_at(args.context_lens, args.context_index_bytes, d));
    const auto first = static_cast<int>(first_visible(args, d, context));
    const int parts = static_cast<int>((context - first + int64_t{partition} - 1) / partition);
    for (int g = 0; g < args.num_kv_heads; ++g) {
      if (parts > 1) merges.push_back({static_cast<int>(items.size()), parts});
      for (int p = 0; p < parts; ++p) {
        const int begin = static_cast<int>(first + int64_t{p} * partition);
        const int end = static_cast<int>(std::min<int64_t>(context, int64_t{begin} + partition));
        items.push_back({d, g, begin, end, parts > 1 ? num_partials++ : -1});
      }
    }
  }
  const int group = args.num_heads / args.num_kv_heads;
  partials.resize(static_cast<size_t>(num_partials * partial_floats(group, args.head_dim)));
  Job job{&args, &kernels_for_isa(), items.data(), merges.data(), partials.data(), group};
  pool.run(attend, &job, static_cast<int>(items.size()));
  if (!merges.empty()) pool.run(merge, &job, static_cast<int>(merges.size()));
}

}  // namespace pyserve_kernels
