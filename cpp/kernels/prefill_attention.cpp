// paged_prefill_attention: argument checks, the work items, the per-item loop over key tiles, and
// the portable loops (any CPU, and the reference the AVX-512 path follows).
#include "prefill_attention.h"
#include "arg_checks.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_convert.h"
#include "dispatch.h"
#include "thread_pool.h"

namespace pyserve_kernels {
namespace {

constexpr int kKeyTile = 16;  // cache rows converted and scored at a time (fewer at block ends)

const PrefillKernels& kernels_for_isa() {
  return current_isa() == "avx512_vnni" ? avx512_prefill() : scalar_prefill();
}

struct Span {
  int64_t first_row;
  int rows;
  int start;
};

Span span_at(const PrefillAttentionArgs& a, int s) {
  const int64_t* row = a.spans + 3 * static_cast<int64_t>(s);
  return {row[0], static_cast<int>(row[1]), static_cast<int>(row[2])};
}

// The first key a row at this position sees.
int first_key(const PrefillAttentionArgs& a, int position) {
  return a.window > 0 ? std::max(0, position - a.window + 1) : 0;
}

// Rows [row0, row0 + rows) of one span against one kv head's cache, all query heads of its group.
struct WorkItem {
  int span;
  int kv_head;
  int row0;
};

struct Job {
  const PrefillAttentionArgs* args;
  const PrefillKernels* kernels;
  const WorkItem* items;
  int group;
};

void attend(void* context, int index) {
  const Job& job = *static_cast<const Job*>(context);
  const PrefillAttentionArgs& a = *job.args;
  const PrefillKernels& kernels = *job.kernels;
  const WorkItem& item = job.items[index];
  const Span span = span_at(a, item.span);
  const int group = job.group, dim = a.head_dim, bs = a.block_size;
  const int rows = std::min(kPrefillRows, span.rows - item.row0);
  const int64_t per_head = static_cast<int64_t>(dim) * kPrefillRows;

  thread_local std::vector<float> qt, ot, m, l, k, v, k_factors, v_factors;
  qt.resize(group * per_head);
  ot.assign(group * per_head, 0.0f);
  m.assign(group * kPrefillRows, -std::numeric_limits<float>::infinity());
  l.assign(group * kPrefillRows, 0.0f);
  k.assign(static_cast<size_t>(kKeyTile) * dim, 0.0f);
  v.assign(static_cast<size_t>(kKeyTile) * dim, 0.0f);

  const int first_head = item.kv_head * group;
  const int64_t q_bytes = element_bytes(a.q_dtype);
  const int64_t first_row = span.first_row + item.row0;
  for (int h = 0; h < group; ++h) {
    const int64_t at = (first_row * a.q_token_stride + (first_head + h) * dim) * q_bytes;
    kernels.load_queries(a.q_dtype, static_cast<const char*>(a.q) + at, a.q_token_stride, rows, dim,
                         a.scale, qt.data() + h * per_head);
  }

  const int64_t element = element_bytes(a.cache_dtype);
  const int64_t block_elements = static_cast<int64_t>(bs) * dim;
  const int64_t head_offset = static_cast<int64_t>(item.kv_head) * a.num_blocks * bs * dim;
  const char* k_head = static_cast<const char*>(a.k_cache) + head_offset * element;
  const char* v_head = static_cast<const char*>(a.v_cache) + head_offset * element;
  const int64_t table_row = item.span * a.table_stride;
  // an int8 cache's scales: bs·groups a block, group g of token t at g·bs + t in K's, at
  // t·groups + g in V's
  const int groups = int8_groups(dim);
  const int64_t block_scales = static_cast<int64_t>(bs) * groups;
  const int64_t head_scales = static_cast<int64_t>(item.kv_head) * a.num_blocks * block_scales;
  k_factors.resize(static_cast<size_t>(groups) * kPrefillRows);
  v_factors.resize(static_cast<size_t>(groups) * kPrefillRows);
  const int first_query = span.start + item.row0;  // the first row's own position
  const int end = first_query + rows;              // keys [begin, end) are visible to some row
  const int begin = first_key(a, first_query);
  for (int pos = begin; pos < end;) {
    const int64_t block = index_at(a.block_tables, a.table_index_bytes, table_row + pos / bs);
    const int offset = pos % bs;
    const int n = std::min({end - pos, bs - offset, kKeyTile});
    const int64_t block_at = block * block_elements * element;
    kernels.keys_to_float(a.cache_dtype, k_head + block_at + offset * element, bs, dim, n,
                          k.data());
    kernels.to_float(a.cache_dtype, v_head + block_at + offset * dim * element,
                     static_cast<int64_t>(n) * dim, v.data());
    if (a.cache_dtype == DType::kInt8) {  // the raw values times their group's scale
      const int64_t at = head_scales + block * block_scales;
      const uint16_t* k_scales = a.k_scale + at + offset;
      const uint16_t* v_scales = a.v_scale + at + static_cast<int64_t>(offset) * groups;
      for (int g = 0; g < groups; ++g)  // as floats, K's [groups][16] and V's [16][groups]
        for (int t = 0; t < n; ++t) {
          k_factors[g * kPrefillRows + t] = half_to_float(k_scales[g * bs + t]);
          v_factors[t * groups + g] = half_to_float(v_scales[t * groups + g]);
        }
      for (int i = 0; i < dim; ++i)
        for (int t = 0; t < n; ++t)
          k[i * kPrefillRows + t] *= k_factors[i / kInt8Group * kPrefillRows + t];
      for (int t = 0; t < n; ++t)
        for (int i = 0; i < dim; ++i) v[t * dim + i] *= v_factors[t * groups + i / kInt8Group];
    }
    for (int h = 0; h < group; ++h)
      kernels.tile(qt.data() + h * per_head, k.data(), v.data(), n, dim, first_query - pos,
                   a.window, a.softcap, m.data() + h * kPrefillRows, l.data() + h * kPrefillRows,
                   ot.data() + h * per_head);
    pos += n;
  }

  if (a.sinks != nullptr)  // one more column in each row's sum: exp(sink − the row's maximum)
    for (int h = 0; h < group; ++h)
      for (int j = 0; j < rows; ++j)
        l[h * kPrefillRows + j] += std::exp(a.sinks[first_head + h] - m[h * kPrefillRows + j]);
  for (int h = 0; h < group; ++h) {
    const int64_t at = (first_row * a.out_token_stride + (first_head + h) * dim) * q_bytes;
    kernels.store_output(a.q_dtype, ot.data() + h * per_head, l.data() + h * kPrefillRows, rows,
                         dim, static_cast<char*>(a.out) + at, a.out_token_stride);
  }
}

void check_args(const PrefillAttentionArgs& a) {
  check(a.q != nullptr && a.k_cache != nullptr && a.v_cache != nullptr && a.out != nullptr &&
            (a.num_spans == 0 || (a.spans != nullptr && a.block_tables != nullptr)),
        "null pointer");
  check(
      a.q_dtype == DType::kFloat32 || a.q_dtype == DType::kBFloat16 || a.q_dtype == DType::kFloat16,
      "q dtype codes: 0 float32, 1 bfloat16, 2 float16");
  check_cache_dtype(a.cache_dtype, a.k_scale, a.v_scale);
  check(a.num_rows >= 0 && a.num_spans >= 0, "num_rows and num_spans must be >= 0");
  check(a.num_heads >= 1 && a.num_kv_heads >= 1 && a.num_heads % a.num_kv_heads == 0,
        "num_heads must be a positive multiple of num_kv_heads");
  check(a.head_dim >= 1 && a.block_size >= 1 && a.num_blocks >= 1,
        "head_dim, block_size and num_blocks must be >= 1");
  check(a.table_index_bytes == 4 || a.table_index_bytes == 8, "block ids must be int32 or int64");
  const int64_t row = static_cast<int64_t>(a.num_heads) * a.head_dim;
  check(a.q_token_stride >= row && a.out_token_stride >= row, "a token stride is too short");
  check(a.table_stride >= 1, "table_stride must be >= 1");
  check(a.window >= 0, "window must be >= 0");
  check(std::isfinite(a.softcap) && a.softcap >= 0.0f, "softcap must be finite and >= 0");
  if (a.sinks != nullptr)
    for (int h = 0; h < a.num_heads; ++h) check(std::isfinite(a.sinks[h]), "a sink is not finite");
  for (int s = 0; s < a.num_spans; ++s) {
    const Span span = span_at(a, s);
    const auto name = [s] { return "span " + std::to_string(s); };
    check(span.rows >= 1 && span.start >= 0,
          [&] { return name() + ": rows must be >= 1 and start >= 0"; });
    check(span.first_row >= 0 && span.first_row + span.rows <= a.num_rows,
          [&] { return name() + ": rows outside q"; });
    const int64_t context = int64_t{span.start} + span.rows;
    check(context <= a.table_stride * a.block_size, [&] {
      return name() + ": " + std::to_string(context) + " tokens, more than its block table covers";
    });
    const int64_t blocks = (context + a.block_size - 1) / a.block_size;
    for (int64_t b = first_key(a, span.start) / a.block_size; b < blocks; ++b) {
      const int64_t id = index_at(a.block_tables, a.table_index_bytes, s * a.table_stride + b);
      check(id >= 0 && id < a.num_blocks,
            [&] { return name() + ": block id " + std::to_string(id) + " is out of range"; });
    }
  }
}

// ------------------------------------------------------------------ the portable loops

void to_float_scalar(DType type, const void* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_element(type, src, i);
}

void keys_to_float_scalar(DType type, const void* src, int64_t stride, int dim, int n, float* dst) {
  for (int i = 0; i < dim; ++i)
    for (int t = 0; t < kPrefillRows; ++t)
      dst[i * kPrefillRows + t] = t < n ? load_element(type, src, i * stride + t) : 0.0f;
}

void load_queries_scalar(DType type, const void* q, int64_t stride, int rows, int dim, float scale,
                         float* qt) {
  for (int j = 0; j < kPrefillRows; ++j)
    for (int i = 0; i < dim; ++i)
      qt[i * kPrefillRows + j] = j < rows ? load_element(type, q, j * stride + i) * scale : 0.0f;
}

void store_output_scalar(DType type, const float* ot, const float* l, int rows, int dim, void* out,
                         int64_t stride) {
  for (int j = 0; j < rows; ++j) {
    const float inverse = 1.0f / l[j];
    for (int i = 0; i < dim; ++i)
      store_element(type, out, j * stride + i, ot[i * kPrefillRows + j] * inverse);
  }
}

void tile_scalar(const float* qt, const float* k, const float* v, int tokens, int dim, int limit,
                 int window, float softcap, float* m, float* l, float* ot) {
  const float inverse_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
  for (int j = 0; j < kPrefillRows; ++j) {
    const int visible = std::min(tokens, limit + j + 1);  // keys [first, visible) of this tile
    const int first = window > 0 ? std::max(0, limit + j - window + 1) : 0;
    if (visible <= first) continue;
    float s[kPrefillRows];
    float top = m[j];
    for (int t = first; t < visible; ++t) {
      float sum = 0.0f;
      for (int i = 0; i < dim; ++i) sum += qt[i * kPrefillRows + j] * k[i * kPrefillRows + t];
      if (softcap > 0.0f) sum = softcap * tanh_float(sum * inverse_cap);
      s[t] = sum;
      top = std::max(top, sum);
    }
    const float factor = std::exp(m[j] - top);  // 0 when nothing was seen yet (m = -inf)
    m[j] = top;
    l[j] *= factor;
    for (int i = 0; i < dim; ++i) ot[i * kPrefillRows + j] *= factor;
    for (int t = first; t < visible; ++t) {
      const float p = std::exp(s[t] - top);
      l[j] += p;
      for (int i = 0; i < dim; ++i) ot[i * kPrefillRows + j] += p * v[t * dim + i];
    }
  }
}

}  // namespace

const PrefillKernels& scalar_prefill() {
  static const PrefillKernels table{
      "scalar",   to_float_scalar, keys_to_float_scalar, load_queries_scalar, store_output_scalar,
      tile_scalar};
  return table;
}

void paged_prefill_attention(const PrefillAttentionArgs& args) {
  check_args(args);
  thread_local std::vector<WorkItem> items;
  items.clear();
  for (int s = 0; s < args.num_spans; ++s) {
    const Span span = span_at(args, s);
    for (int row0 = 0; row0 < span.rows; row0 += kPrefillRows)
      for (int g = 0; g < args.num_kv_heads; ++g) items.push_back({s, g, row0});
  }
  if (items.empty()) return;
  // The longest items first (an item's cost grows with the keys it sees), so the threads that
  // claim them one at a time finish close together.
  const auto keys = [&](const WorkItem& item) {
    const int first_query = span_at(args, item.span).start + item.row0;
    return first_query - first_key(args, first_query);
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const WorkItem& x, const WorkItem& y) { return keys(x) > keys(y); });
  Job job{&args, &kernels_for_isa(), items.data(), args.num_heads / args.num_kv_heads};
  ThreadPool::instance().run(attend, &job, static_cast<int>(items.size()));
}

}  // namespace pyserve_kernels
