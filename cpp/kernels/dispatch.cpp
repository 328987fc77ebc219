#include "dispatch.h"
#include "arg_checks.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "thread_pool.h"

namespace pyserve_kernels {

namespace {

// Weight bytes in one chunk of tiles that a thread claims: long runs of memory for the hardware
// prefetchers (RESULTS.md, "Kernels": 32 KiB chunks left a 1-row decode slower), small enough
// that the chunk stays in L2 while every group of rows (M > a kernel's max_rows) walks it. A
// weight is cut into at least kChunksPerThread chunks a thread, so that threads finish close
// together; claiming one (a compare-and-swap) costs nothing.
constexpr size_t kChunkBytes = 256 * 1024;
constexpr int kChunksPerThread = 4;
// From this many rows on, the threads quantize the activations too, this many rows a chunk
// (single-threaded, quantizing was a visible share of a batch-32 step; the bound sits below 32
// because a decode batch shrinks under 32 as its requests finish).
constexpr int kParallelQuantizeRows = 16;
constexpr int kQuantizeChunkRows = 8;
// From this many rows on, int8 activations go to the AMX tiles when they are on (set_amx): a
// pass covers 16 rows, and fewer passes leave the tiles' fixed costs (the configuration, the
// 4-bit unpacking) on too few rows.
constexpr int kAmxMinRows = 32;

bool cpu_has(const std::string& isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (isa == "avx512_vnni")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == "avx2")
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
  (void)isa;
#endif
  return false;
}

const KernelTable* table_for(const std::string& name) {
  if (name == "avx512_vnni") return &avx512_kernels();
  if (name == "avx2") return &avx2_kernels();
  if (name == "scalar") return &scalar_kernels();
  return nullptr;
}

const KernelTable* best_table() {
  if (cpu_has("avx512_vnni")) return &avx512_kernels();
  if (cpu_has("avx2")) return &avx2_kernels();
  return &scalar_kernels();
}

std::atomic<const KernelTable*> selected{nullptr};

// Off until asked for: on the machine measured, the tiles were no faster than the VNNI loops
// (benchmarks/RESULTS.md, "AMX").
std::atomic<bool> amx_on{false};

const KernelTable& kernels() {
  const KernelTable* table = selected.load(std::memory_order_acquire);
  if (table == nullptr) {
    table = best_table();
    selected.store(table, std::memory_order_release);
  }
  return *table;
}

void check_group(int group) {
  check(group > 0 && group % 32 == 0 && group <= kMaxGroup,
        "group must be a multiple of 32, at most 256");
}

struct Scratch {
  std::vector<int16_t> q;  // int8 or int16 values, whichever the activations use
  std::vector<int32_t> shift, sum, centre;
  std::vector<float> scale, unit_sum, unit;
  QuantizedRows rows(int bits, int groups, int group, int panel_rows, bool centres) const {
    return {q.data(),        bits,       scale.data(), shift.data(),
            unit_sum.data(), sum.data(), unit.data(),  centres ? centre.data() : nullptr,
            groups * group,  groups,     panel_rows};
  }
};

struct QuantizeJob {
  const KernelTable* table;
  const float* x;
  int64_t x_stride;
  int rows, k, group, bits, headroom;
  bool centres;  // −32·Σq per 16 inputs too (6-bit weights)
  Scratch* scratch;
};

// −32·Σq per 16 inputs of rows [begin, end) (qgemm.h's 6-bit weights), from the q just written
// (in the table's layout), into s.centre [rows][k_padded / 16].
template <class Q>
void q6_centres(Scratch& s, int begin, int end, int k_padded, int panel_rows) {
  constexpr int per_word = 4 / sizeof(Q);
  const int64_t words = static_cast<int64_t>(k_padded) / per_word;
  const int halves = k_padded / 16;
  const auto* q = reinterpret_cast<const int32_t*>(s.q.data());
  for (int r = begin; r < end; ++r) {
    int32_t* out = s.centre.data() + static_cast<int64_t>(r) * halves;
    for (int h = 0; h < halves; ++h) {
      int32_t total = 0;
      for (int j = h * 16 / per_word; j < (h + 1) * 16 / per_word; ++j) {
        const Q* v = reinterpret_cast<const Q*>(q + panel_index(r, j, words, panel_rows));
        for (int e = 0; e < per_word; ++e) total += v[e];
      }
      out[h] = -kQ6Offset * total;
    }
  }
}

void quantize_chunk(void* context, int chunk) {
  const auto& job = *static_cast<QuantizeJob*>(context);
  const int begin = chunk * kQuantizeChunkRows;
  const int end = std::min(job.rows, begin + kQuantizeChunkRows);
  const int groups = (job.k + job.group - 1) / job.group;
  const int64_t q_bytes = static_cast<int64_t>(begin) * groups * job.group * job.bits / 8;
  const int64_t g_at = static_cast<int64_t>(begin) * groups;
  Scratch& s = *job.scratch;
  job.table->quantize_rows(
      job.x + begin * job.x_stride, job.x_stride, end - begin, job.k, job.group, job.bits,
      job.headroom, reinterpret_cast<int8_t*>(s.q.data()) + q_bytes, s.scale.data() + g_at,
      s.shift.data() + g_at, s.unit_sum.data() + g_at, s.sum.data() + g_at, s.unit.data() + begin);
  if (!job.centres) return;
  if (job.bits == 16)
    q6_centres<int16_t>(s, begin, end, groups * job.group, job.table->panel_rows);
  else
    q6_centres<int8_t>(s, begin, end, groups * job.group, job.table->panel_rows);
}

// `parallel`: many rows are split over the pool (false inside a pool task: runs do not nest).
void quantize_into(const KernelTable& table, const float* x, int64_t x_stride, int rows, int k,
                   int group, int bits, int headroom, bool centres, Scratch& scratch,
                   bool parallel = true) {
  const int groups = (k + group - 1) / group;
  // whole panels (qgemm.h): a chunk of rows starts at a panel's first row
  const int panel = std::max(table.panel_rows, 1);
  check(kQuantizeChunkRows % panel == 0, "quantize chunks must be whole panels");
  const size_t cells = static_cast<size_t>((rows + panel - 1) / panel * panel) * groups;
  scratch.q.resize(cells * group);  // int16 elements: room for either width
  scratch.scale.resize(cells);
  scratch.shift.resize(cells);
  scratch.unit_sum.resize(cells);
  scratch.sum.resize(cells);
  scratch.unit.resize(rows);
  if (centres) scratch.centre.resize(static_cast<size_t>(rows) * groups * group / 16);
  QuantizeJob job{&table, x, x_stride, rows, k, group, bits, headroom, centres, &scratch};
  const int chunks = (rows + kQuantizeChunkRows - 1) / kQuantizeChunkRows;
  if (parallel && rows >= kParallelQuantizeRows) {
    ThreadPool::instance().run(quantize_chunk, &job, chunks);
  } else {
    for (int chunk = 0; chunk < chunks; ++chunk) quantize_chunk(&job, chunk);
  }
}

struct MatmulJob {
  const KernelTable* table;
  const PackedWeights* w;
  const QuantizedRows* a;
  int rows;
  const float* bias;
  float* out;
  int64_t out_stride;
  int tiles_per_chunk;
};

void matmul_chunk(void* context, int chunk) {
  const auto& job = *static_cast<MatmulJob*>(context);
  const int begin = chunk * job.tiles_per_chunk;
  const int end = std::min(job.w->tiles(), begin + job.tiles_per_chunk);
  const int step = job.table->max_rows;
  for (int r = 0; r < job.rows; r += step)
    job.table->tiles(*job.w, *job.a, r, std::min(step, job.rows - r), begin, end, job.bias, job.out,
                     job.out_stride);
}

void check_weights(const PackedWeights& w, int activation_bits) {
  check(w.data != nullptr && w.scales != nullptr, "null pointer");
  check(w.bits == 8 || w.bits == 6 || w.bits == 5 || w.bits == 4,
        "weight bits must be 8, 6, 5 or 4");
  check(activation_bits == 8 || activation_bits == 16, "activation bits must be 8 or 16");
  check_group(w.group);
  check(!w.super_scales || (w.bits != 8 && w.group == 32 && w.k % (kSuperGroups * 32) == 0),
        "super-block scales need 4-, 5- or 6-bit weights, groups of 32 and k a multiple of 256");
  check(w.bits != 5 || w.group == 32, "5-bit weights come in groups of 32");
  check(w.bits != 6 || w.super_scales, "6-bit weights (Q6_K) come with their super-block scales");
  check(!w.mxfp4 || (w.bits == 4 && w.group == 32 && !w.super_scales),
        "MXFP4 weights are 4-bit codes in groups of 32 with their own exponents");
  check(w.n > 0 && w.k > 0, "sizes must be positive");
}

// The kernels for `rows` rows of activations on w: AMX tiles when they are on and apply.
const KernelTable& table_for_rows(int rows, int activation_bits, const PackedWeights& w) {
  const bool amx = activation_bits == 8 && rows >= kAmxMinRows && (w.bits == 8 || w.bits == 4) &&
                   !w.super_scales && !w.mxfp4 && &kernels() == &avx512_kernels() && amx_enabled();
  return amx ? amx_kernels() : kernels();
}

// Quantizes rows of x for w's tiles (the headroom and the 6-bit centres w needs) into scratch.
QuantizedRows quantize_for(const KernelTable& table, const float* x, int64_t x_stride, int rows,
                           int activation_bits, const PackedWeights& w, Scratch& scratch,
                           bool parallel = true) {
  const bool centres = w.bits == 6;
  quantize_into(table, x, x_stride, rows, w.k, w.group, activation_bits,
                shift_headroom(w.bits, activation_bits, w.group), centres, scratch, parallel);
  return scratch.rows(activation_bits, w.groups(), w.group, table.panel_rows, centres);
}

// Tiles of w a thread claims at once, when `total_tiles` tiles (w's, or all the experts' of a
// grouped matmul) are shared by the pool.
int chunk_tiles(const PackedWeights& w, int total_tiles) {
  const size_t tile_bytes = w.groups() * (w.group_bytes() + 4 * kTileRows);
  const int most = total_tiles / (kChunksPerThread * ThreadPool::instance().size());
  return std::max<int>(1, std::min<int>(most, static_cast<int>(kChunkBytes / tile_bytes)));
}

// A grouped matmul: expert e's rows of x times its weights. Each expert's rows are quantized
// by one task (they are few: a token group), then every expert's tile chunks are claimed from
// one list, so that the pool runs the experts side by side instead of one after another.
struct ExpertWork {
  const PackedWeights* w;
  const KernelTable* table;
  const float* x;
  float* out;
  int rows;
  Scratch* scratch;
  QuantizedRows a;
};

struct GroupedJob {
  const float* x;
  int64_t x_stride, out_stride;
  int activation_bits;
  std::vector<ExpertWork>* experts;
  std::vector<std::array<int, 3>> chunks;  // (expert, first tile, end tile)
};

void quantize_expert(void* context, int e) {
  auto& job = *static_cast<GroupedJob*>(context);
  ExpertWork& work = (*job.experts)[e];
  work.a = quantize_for(*work.table, work.x, job.x_stride, work.rows, job.activation_bits, *work.w,
                        *work.scratch, /*parallel=*/false);
}

void grouped_chunk(void* context, int chunk) {
  const auto& job = *static_cast<GroupedJob*>(context);
  const auto [e, begin, end] = job.chunks[chunk];
  const ExpertWork& work = (*job.experts)[e];
  const int step = work.table->max_rows;
  for (int r = 0; r < work.rows; r += step)
    work.table->tiles(*work.w, work.a, r, std::min(step, work.rows - r), begin, end, nullptr,
                      work.out, job.out_stride);
}

}  // namespace

void grouped_matmul(const float* x, int64_t x_stride, int activation_bits,
                    const PackedWeights* weights, const int64_t* counts, int experts, float* out,
                    int64_t out_stride) {
  check(x != nullptr && out != nullptr && weights != nullptr && counts != nullptr, "null pointer");
  check(experts >= 0, "a negative expert count");
  thread_local std::vector<Scratch> scratches;
  thread_local std::vector<ExpertWork> work;
  if (static_cast<int>(scratches.size()) < experts) scratches.resize(experts);
  work.clear();
  int64_t row = 0;
  int total_tiles = 0;
  for (int e = 0; e < experts; ++e) {
    const PackedWeights& w = weights[e];
    check_weights(w, activation_bits);
    check(w.k == weights[0].k && w.n == weights[0].n, "the experts' shapes differ");
    check(counts[e] >= 0, "a negative row count");
    check(x_stride >= w.k && out_stride >= w.n, "a row stride is shorter than its row");
    const int rows = static_cast<int>(counts[e]);
    if (rows > 0) {
      work.push_back({&w,
                      &table_for_rows(rows, activation_bits, w),
                      x + row * x_stride,
                      out + row * out_stride,
                      rows,
                      &scratches[e],
                      {}});
      total_tiles += w.tiles();
    }
    row += rows;
  }
  if (work.empty()) return;
  GroupedJob job{x, x_stride, out_stride, activation_bits, &work, {}};
  ThreadPool::instance().run(quantize_expert, &job, static_cast<int>(work.size()));
  for (int e = 0; e < static_cast<int>(work.size()); ++e) {
    const PackedWeights& w = *work[e].w;
    const int per_chunk = chunk_tiles(w, total_tiles);
    for (int t = 0; t < w.tiles(); t += per_chunk)
      job.chunks.push_back({e, t, std::min(w.tiles(), t + per_chunk)});
  }
  ThreadPool::instance().run(grouped_chunk, &job, static_cast<int>(job.chunks.size()));
}

std::string current_isa() { return kernels().name; }

void set_isa(const std::string& name) {
  const KernelTable* table = table_for(name);
  if (table == nullptr)
    throw std::invalid_argument("unknown ISA '" + name + "' (avx512_vnni, avx2 or scalar)");
  if (name != "scalar" && !cpu_has(name))
    throw std::invalid_argument("this CPU cannot run the " + name + " kernels");
  selected.store(table, std::memory_order_release);
}

bool amx_enabled() { return amx_on.load(std::memory_order_acquire); }

void set_amx(bool on) {
  if (on && !amx_status().empty())
    throw std::invalid_argument("AMX cannot run here: " + amx_status());
  amx_on.store(on, std::memory_order_release);
}

const std::string& amx_status() {
  static const std::string no_vnni = "the CPU lacks AVX-512 VNNI";
  return cpu_has("avx512_vnni") ? amx_problem() : no_vnni;
}

void quantized_matmul(const float* x, int64_t x_stride, int rows, int activation_bits,
                      const PackedWeights& w, const float* bias, float* out, int64_t out_stride) {
  check(x != nullptr && out != nullptr, "null pointer");
  check_weights(w, activation_bits);
  check(rows >= 0, "sizes must be positive");
  check(x_stride >= w.k && out_stride >= w.n, "a row stride is shorter than its row");
  if (rows == 0) return;
  const KernelTable& table = table_for_rows(rows, activation_bits, w);
  thread_local Scratch scratch;
  const QuantizedRows a = quantize_for(table, x, x_stride, rows, activation_bits, w, scratch);
  const int tiles_per_chunk = chunk_tiles(w, w.tiles());
  MatmulJob job{&table, &w, &a, rows, bias, out, out_stride, tiles_per_chunk};
  const int chunks = (w.tiles() + tiles_per_chunk - 1) / tiles_per_chunk;
  ThreadPool::instance().run(matmul_chunk, &job, chunks);
}

void quantize_activations(const float* x, int64_t x_stride, int rows, int k, int group, int bits,
                          int weight_bits, void* q, float* scale, int32_t* sum) {
  check(x != nullptr && q != nullptr && scale != nullptr && sum != nullptr, "null pointer");
  check(bits == 8 || bits == 16, "activation bits must be 8 or 16");
  check(weight_bits == 8 || weight_bits == 6 || weight_bits == 5 || weight_bits == 4,
        "weight bits must be 8, 6, 5 or 4");
  check_group(group);
  check(k > 0 && rows >= 0 && x_stride >= k, "bad sizes");
  Scratch scratch;
  quantize_into(kernels(), x, x_stride, rows, k, group, bits,
                shift_headroom(weight_bits, bits, group), false, scratch);
  const int groups = (k + group - 1) / group;
  const QuantizedRows a = scratch.rows(bits, groups, group, kernels().panel_rows, false);
  // row-major out, whatever the layout inside
  const int64_t words = a.words();
  const auto* from = reinterpret_cast<const int32_t*>(scratch.q.data());
  auto* to = static_cast<int32_t*>(q);
  for (int r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < words; ++j) to[r * words + j] = from[a.word_at(r, j)];
    for (int g = 0; g < groups; ++g) {
      const size_t at = static_cast<size_t>(r) * groups + g;
      scale[at] = scratch.unit[r] * scratch.scale[a.cell_at(r, g)];  // int16: 2^U·2^(e − U), exact
      sum[at] = scratch.sum[a.cell_at(r, g)];
    }
  }
}

}  // namespace pyserve_kernels
