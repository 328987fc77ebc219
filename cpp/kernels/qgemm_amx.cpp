// The AMX path (Intel Sapphire Rapids and later): int8 activations times the packed 8- or 4-bit
// weights on the tile unit, for calls with many rows (prefill chunks, large decode batches). When
// switched on (`set_amx`), the dispatcher sends it int8 activations from `kAmxMinRows` rows on
// (dispatch.cpp); everything else stays on the AVX-512 VNNI path, which is also where every call
// goes when the CPU lacks AMX or Linux refuses the tile state (`amx_problem`).
//
// The arithmetic is the VNNI int8 path's, operation for operation, so outputs are equal bit for
// bit: per row, group and tile of 16 outputs, the integer Σu·q, then
// acc = fma(m, s·Σq, fma(float(Σu·q)·s, d, acc)) in the same order, then fma(acc, unit, bias).
//
// Tiles. `tdpbsud` multiplies signed bytes of its first source (A, rows × 4k bytes) by unsigned
// bytes of its second (B, k rows of 16 × 4 bytes) into int32 (C, rows × 16): A is 16 rows of
// activations q (signed, row-major, 32 inputs), B the weights u (unsigned, 0..255 or 0..15) of 16
// outputs × 32 inputs in the "4 inputs × 16 outputs" order that the packed 8-bit layout already
// has (a group's 8 blocks of 64 bytes are B's 8 rows; 4-bit blocks are split into their low and
// high nibbles once per tile and call), so C[row][output] is Σu·q of the group, with the outputs
// in lanes, as the VNNI loop has them. No bias or correction term is needed either side.
//
// A pass handles 16 rows × one tile of outputs: each group's C is stored to L1 and scaled into
// the float sums with AVX-512 while the tile unit computes the next group into the other C tile.
// The tile configuration is per thread and other code on the same thread (oneDNN inside torch)
// may load its own, so every call loads ours and releases the tiles before it returns.
#include "qgemm.h"

#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#define PYSERVE_AMX \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,amx-tile,amx-int8")))

// The tile instructions as plain asm with memory clobbers: GCC's own tileloadd macro has none, so
// stores into a buffer that only a tile load reads could be dropped or moved past it.
#define PYSERVE_TILE_LOAD(tile, base, stride)                                           \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #tile::"r"(static_cast<const void*>(base)), \
               "r"(static_cast<long>(stride))                                           \
               : "memory")
#define PYSERVE_TILE_STORE(tile, base, stride)                                         \
  asm volatile("tilestored %%tmm" #tile ", (%0,%1,1)" ::"r"(static_cast<void*>(base)), \
               "r"(static_cast<long>(stride))                                          \
               : "memory")
#define PYSERVE_TILE_ZERO(tile) asm volatile("tilezero %%tmm" #tile::: "memory")
// C += A (signed bytes) · B (unsigned bytes)
#define PYSERVE_TILE_DPBSUD(c, a, b) \
  asm volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c::: "memory")

namespace pyserve_kernels {
namespace {

constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;
constexpr int kBlockInputs = 32;                       // inputs a tile product covers: one block
constexpr int kBlockBytes = kBlockInputs * kTileRows;  // B: 8 rows of 64 bytes

// ldtilecfg's 64-byte operand, palette 1.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm1: C of even and odd groups (rows × 16 int32); tmm2/tmm4: A (rows × 32 bytes of q);
// tmm3/tmm5: B (8 rows × 64 bytes of u), one pair per parity as well.
TileConfig config_for(int rows) {
  TileConfig c;
  for (int t : {0, 1}) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = 64;
  }
  for (int t : {2, 4}) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = kBlockInputs;
  }
  for (int t : {3, 5}) {
    c.rows[t] = kBlockInputs / 4;
    c.colsb[t] = 64;
  }
  return c;
}

PYSERVE_AMX inline void load_config(const TileConfig& c) {
  asm volatile("ldtilecfg %0" ::"m"(c) : "memory");
}
PYSERVE_AMX inline void release_tiles() { asm volatile("tilerelease" ::: "memory"); }

inline __mmask16 first_lanes(int n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff)
                 : static_cast<__mmask16>((1u << (n > 0 ? n : 0)) - 1);
}

// The VNNI path's quantizer, one panel of rows at a time, then out of the panel: the tiles read
// 16 rows of q at one stride (row-major), and the values are the VNNI path's by construction.
void quantize_rows_amx(const float* x, int64_t x_stride, int rows, int k, int group, int bits,
                       int headroom, void* q, float* scale, int32_t* shift, float* unit_sum,
                       int32_t* sum, float* unit) {
  const KernelTable& vnni = avx512_kernels();
  const int P = vnni.panel_rows;
  const int groups = (k + group - 1) / group;
  const int64_t words = static_cast<int64_t>(groups) * group * bits / 32;
  thread_local std::vector<int32_t> panel_q, panel_shift, panel_sum;
  thread_local std::vector<float> panel_scale, panel_unit_sum;
  panel_q.resize(static_cast<size_t>(words * P));
  for (auto* v : {&panel_shift, &panel_sum}) v->resize(static_cast<size_t>(groups) * P);
  for (auto* v : {&panel_scale, &panel_unit_sum}) v->resize(static_cast<size_t>(groups) * P);
  auto* const q32 = static_cast<int32_t*>(q);
  for (int r0 = 0; r0 < rows; r0 += P) {
    const int n = std::min(P, rows - r0);
    vnni.quantize_rows(x + r0 * x_stride, x_stride, n, k, group, bits, headroom, panel_q.data(),
                       panel_scale.data(), panel_shift.data(), panel_unit_sum.data(),
                       panel_sum.data(), unit + r0);
    for (int r = 0; r < n; ++r) {
      int32_t* const to = q32 + static_cast<int64_t>(r0 + r) * words;
      for (int64_t j = 0; j < words; ++j) to[j] = panel_q[panel_index(r, j, words, P)];
      const int64_t cell0 = static_cast<int64_t>(r0 + r) * groups;
      for (int g = 0; g < groups; ++g) {
        const int64_t from = panel_index(r, g, groups, P);
        scale[cell0 + g] = panel_scale[from];
        shift[cell0 + g] = panel_shift[from];
        unit_sum[cell0 + g] = panel_unit_sum[from];
        sum[cell0 + g] = panel_sum[from];
      }
    }
  }
}

// One pass: `count` rows (16, or the last few) × one tile of outputs over every group, into
// out_acc. Group g's products go into C[g % 2]; the next group's are issued right after this
// one's C is stored, before it is scaled. With 16 rows the float sums stay in registers.
template <bool kFull>
PYSERVE_AMX void row_block(const int8_t* q, int64_t q_stride, const uint8_t* weights, int groups,
                           int group, const float* dm, const float* scale, const float* unit_sum,
                           int count, float (*out_acc)[kTileRows]) {
  const int blocks = group / kBlockInputs;
  alignas(64) int32_t dots[2][kTileRows][kTileRows];
  __m512 acc[kTileRows];
  const int rows = kFull ? kTileRows : count;
  for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
  auto issue = [&](int g) PYSERVE_AMX {
    const int8_t* qa = q + static_cast<int64_t>(g) * group;
    const uint8_t* wb = weights + static_cast<size_t>(g) * blocks * kBlockBytes;
    if (g % 2 == 0) {
      PYSERVE_TILE_ZERO(0);
      for (int b = 0; b < blocks; ++b) {
        PYSERVE_TILE_LOAD(2, qa + b * kBlockInputs, q_stride);
        PYSERVE_TILE_LOAD(3, wb + b * kBlockBytes, 64);
        PYSERVE_TILE_DPBSUD(0, 2, 3);
      }
    } else {
      PYSERVE_TILE_ZERO(1);
      for (int b = 0; b < blocks; ++b) {
        PYSERVE_TILE_LOAD(4, qa + b * kBlockInputs, q_stride);
        PYSERVE_TILE_LOAD(5, wb + b * kBlockBytes, 64);
        PYSERVE_TILE_DPBSUD(1, 4, 5);
      }
    }
  };
  issue(0);
  for (int g = 0; g < groups; ++g) {
    if (g % 2 == 0)
      PYSERVE_TILE_STORE(0, dots[0], 64);
    else
      PYSERVE_TILE_STORE(1, dots[1], 64);
    if (g + 1 < groups) issue(g + 1);
    // as the VNNI loop: fma(m, s·Σq, fma(float(Σu·q)·s, d, acc))
    const __m512 d = _mm512_load_ps(dm + g * 2 * kTileRows);
    const __m512 m = _mm512_load_ps(dm + g * 2 * kTileRows + kTileRows);
#pragma GCC unroll 16
    for (int r = 0; r < rows; ++r) {
      const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[g % 2][r])),
                                          _mm512_set1_ps(scale[r * groups + g]));
      const __m512 sum = _mm512_fmadd_ps(scaled, d, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(unit_sum[r * groups + g]), sum);
    }
  }
  for (int r = 0; r < rows; ++r) _mm512_store_ps(out_acc[r], acc[r]);
}

PYSERVE_AMX void tiles_amx(const PackedWeights& w, const QuantizedRows& a, int row0, int rows,
                           int tile0, int tile1, const float* bias, float* out,
                           int64_t out_stride) {
  if (a.bits != 8 || a.panel_rows != 0)  // never sent here by the dispatcher; correct anyway
    return scalar_kernels().tiles(w, a, row0, rows, tile0, tile1, bias, out, out_stride);
  const int groups = w.groups();
  const int blocks = w.group / kBlockInputs;
  const size_t group_bytes = w.group_bytes();
  const int64_t q_stride = a.k_padded;         // bytes of a row of int8 q
  thread_local std::vector<uint8_t> unpacked;  // 4 bits: the tiles' blocks as bytes, B's order
  thread_local std::vector<float> dm;          // the tiles' d, m per group, as float
  // the chunk's tiles (~32 KiB of weights) are prepared once, then every 16 rows of q (in L1
  // after the first tile) pass over them
  const int tiles = tile1 - tile0;
  const size_t tile_b_bytes = static_cast<size_t>(groups) * blocks * kBlockBytes;
  const size_t tile_dm = static_cast<size_t>(groups) * 2 * kTileRows;
  if (w.bits == 4) unpacked.resize(tiles * tile_b_bytes);
  dm.resize(tiles * tile_dm + 16);
  // 64-byte aligned inside the vector (AVX-512 aligned loads)
  float* const dm_of = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(dm.data()) + 63) &
                                                ~static_cast<uintptr_t>(63));
  alignas(64) float acc[kTileRows][kTileRows];
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  for (int t = tile0; t < tile1; ++t) {
    const uint8_t* const data = w.data + static_cast<size_t>(t) * groups * group_bytes;
    const uint16_t* const sc = w.scales + static_cast<size_t>(t) * tile_dm;
    float* const dm_t = dm_of + (t - tile0) * tile_dm;
    for (size_t i = 0; i < tile_dm; i += kTileRows)
      _mm512_store_ps(
          dm_t + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + i))));
    if (w.bits == 4) {
      // packed block p holds quad 2p in its low nibbles and quad 2p + 1 in its high ones
      uint8_t* const to = unpacked.data() + (t - tile0) * tile_b_bytes;
      const int64_t packed_blocks = static_cast<int64_t>(groups) * blocks * 4;
      for (int64_t p = 0; p < packed_blocks; ++p) {
        const __m512i packed = _mm512_loadu_si512(data + 64 * p);
        _mm512_storeu_si512(to + 128 * p, _mm512_and_si512(packed, low_nibbles));
        _mm512_storeu_si512(to + 128 * p + 64,
                            _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles));
      }
    }
  }

  int configured = 0;  // rows of the loaded configuration
  for (int r0 = row0; r0 < row0 + rows; r0 += kTileRows) {
    const int count = std::min(kTileRows, row0 + rows - r0);
    if (count != configured) {
      const TileConfig c = config_for(count);
      load_config(c);
      configured = count;
    }
    const int8_t* const q = static_cast<const int8_t*>(a.q) + r0 * q_stride;
    const float* const scale = a.scale + static_cast<int64_t>(r0) * groups;
    const float* const unit_sum = a.unit_sum + static_cast<int64_t>(r0) * groups;
    for (int t = tile0; t < tile1; ++t) {
      // B of (group g, block b) at weights + (g·blocks + b)·512
      const uint8_t* const weights = w.bits == 4
                                         ? unpacked.data() + (t - tile0) * tile_b_bytes
                                         : w.data + static_cast<size_t>(t) * groups * group_bytes;
      const float* const dm_t = dm_of + (t - tile0) * tile_dm;
      if (count == kTileRows)
        row_block<true>(q, q_stride, weights, groups, w.group, dm_t, scale, unit_sum, count, acc);
      else
        row_block<false>(q, q_stride, weights, groups, w.group, dm_t, scale, unit_sum, count, acc);
      const __mmask16 live = first_lanes(w.n - t * kTileRows);
      const __m512 b =
          bias ? _mm512_maskz_loadu_ps(live, bias + t * kTileRows) : _mm512_setzero_ps();
      for (int r = 0; r < count; ++r) {
        float* o = out + static_cast<int64_t>(r0 + r) * out_stride + t * kTileRows;
        _mm512_mask_storeu_ps(
            o, live, _mm512_fmadd_ps(_mm512_load_ps(acc[r]), _mm512_set1_ps(a.unit[r0 + r]), b));
      }
    }
  }
  release_tiles();
}

PYSERVE_AMX void probe_tiles() {
  const TileConfig c = config_for(kTileRows);
  load_config(c);
  PYSERVE_TILE_ZERO(0);
  PYSERVE_TILE_ZERO(2);
  PYSERVE_TILE_ZERO(3);
  PYSERVE_TILE_DPBSUD(0, 2, 3);
  release_tiles();
}

std::string find_amx_problem() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) ||
      !(edx & (1u << 25)))
    return "the CPU lacks AMX-TILE / AMX-INT8";
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27)))
    return "the OS has not enabled XSAVE";
  uint32_t xcr0_low = 0, xcr0_high = 0;
  asm volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  if ((xcr0_low & (3u << 17)) != (3u << 17)) return "the OS has not enabled the tile state (XCR0)";
  if (std::getenv("PYSERVE_KERNELS_FAKE_AMX_REFUSAL") != nullptr)
    return "Linux refused the tile data permission (simulated: PYSERVE_KERNELS_FAKE_AMX_REFUSAL)";
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
    return std::string(
               "Linux refused the tile data permission (arch_prctl "
               "ARCH_REQ_XCOMP_PERM: ") +
           std::strerror(errno) + ")";
  unsigned long long permitted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &permitted) != 0 ||
      !(permitted & (1ull << kXfeatureXtiledata)))
    return "Linux did not grant the tile data permission (ARCH_GET_XCOMP_PERM)";
  // A VM may advertise AMX and still fault on it: try the instructions in a child first, so
  // that a fault there costs a fallback here, not the process.
  const pid_t child = fork();
  if (child < 0) return std::string("could not fork a probe process: ") + std::strerror(errno);
  if (child == 0) {
    probe_tiles();
    _exit(0);
  }
  int status = 0;
  pid_t done;
  do {
    done = waitpid(child, &status, 0);
  } while (done < 0 && errno == EINTR);
  if (done != child) return std::string("lost the probe process: ") + std::strerror(errno);
  if (WIFSIGNALED(status))
    return "the tile instructions died with signal " + std::to_string(WTERMSIG(status)) +
           " in a probe process";
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "the probe process failed";
  return "";
}

}  // namespace

const std::string& amx_problem() {
  static const std::string problem = find_amx_problem();
  return problem;
}

const KernelTable& amx_kernels() {
  // every row in one pass over a chunk of tiles: the 4-bit unpacking and the scales' conversion
  // are done once per tile, whatever M is
  static const KernelTable table{"avx512_amx", 1 << 30, 0, quantize_rows_amx, tiles_amx};
  return table;
}

}  // namespace pyserve_kernels

#else  // not x86-64 Linux with GCC/Clang: never selected

namespace pyserve_kernels {
const std::string& amx_problem() {
  static const std::string problem = "AMX kernels are built for x86-64 Linux only";
  return problem;
}
const KernelTable& amx_kernels() { return avx512_kernels(); }
}  // namespace pyserve_kernels

#endif
