// The AVX-512 attention loops (Skylake-X and later Intel, Zen 4 and later AMD): 16 floats a
// register, masked loads for a head_dim that is not a multiple of 16, a polynomial exp.
// Function-level target attributes: this file builds with the default flags.
#include "attention.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "avx512_math.h"

#define PYSERVE_AVX512 PYSERVE_AVX512_MATH

namespace pyserve_kernels {
namespace {

using avx512::element;
using avx512::exp_nonpositive;
using avx512::lanes;
using avx512::load;

// Issues the prefetches of a list of spans into L2, a few cache lines at each step of a loop, so
// that they never pile up on the miss buffers: `lines` over `steps` spread evenly (an int8
// cache's scale lines, a few more than the steps, would have doubled each step's count had it
// been rounded up).
class Prefetcher {
 public:
  Prefetcher(const PrefetchSpan* spans, int count, int64_t steps)
      : span_(spans), end_(spans + count), steps_(steps > 0 ? steps : 1) {
    for (int i = 0; i < count; ++i) lines_ += (spans[i].bytes + 63) / 64;
    if (span_ < end_) {
      at_ = span_->begin;
      stop_ = at_ + span_->bytes;
    }
  }
  static Prefetcher none() { return Prefetcher(nullptr, 0, 1); }
  inline void step() {
    owed_ += lines_;
    int n = 0;
    for (; owed_ >= steps_; owed_ -= steps_) ++n;
    issue(n);
  }
  void finish() { issue(std::numeric_limits<int>::max()); }

 private:
  inline void issue(int n) {
    while (n > 0 && span_ < end_) {
      if (at_ >= stop_) {
        if (++span_ == end_) return;
        at_ = span_->begin;
        stop_ = at_ + span_->bytes;
        continue;
      }
      __builtin_prefetch(at_, 0, 2);
      at_ += 64;
      --n;
    }
  }
  const PrefetchSpan* span_;
  const PrefetchSpan* end_;
  const char* at_ = nullptr;
  const char* stop_ = nullptr;
  int64_t steps_;
  int64_t lines_ = 0;
  int64_t owed_ = 0;  // lines × the steps so far, less steps × the lines issued
};

// HN query heads against ≤ 16 tokens (`live` lanes) of dimension-major K: four independent FMA
// chains a head (a broadcast query element times one K vector each), summed at the end; the
// running maxima `most` take the live lanes. int8: each group of kInt8Group dimensions is summed
// so on its own and added times its scales (group g's of the 16 tokens at scale + g·k_stride).
// DIM > 0: head_dim known at compile time (with a loop of unknown trip count GCC kept the
// accumulators in memory, stored every iteration); DIM == 0: any head_dim.
template <DType T, int HN, int DIM>
PYSERVE_AVX512 inline void score_heads(const float* q, int runtime_dim, const void* k,
                                       int64_t k_stride, __mmask16 live, float* s, int stride,
                                       __m512 (&most)[HN], Prefetcher& prefetch,
                                       const uint16_t* scale) {
  const int dim = DIM > 0 ? DIM : runtime_dim;
  const int step = T == DType::kInt8 ? kInt8Group : dim;
  // a group's length known at compile time where head_dim is (64 and 128: whole groups), so
  // that the FMA loop has a constant trip count and its sums stay in registers
  constexpr int kLength = DIM == 0 ? 0 : T == DType::kInt8 ? kInt8Group : DIM;
  __m512 sum[HN];
  for (int h = 0; h < HN; ++h) sum[h] = _mm512_setzero_ps();
  for (int start = 0; start < dim; start += step) {
    const int length = kLength > 0 ? kLength : std::min(step, dim - start);
    const int whole = length / 4 * 4;
    const void* k_group = element<T>(k, start * k_stride);
    const float* q_group = q + start;
    __m512 acc[HN][4];
    for (int h = 0; h < HN; ++h)
      for (int c = 0; c < 4; ++c) acc[h][c] = _mm512_setzero_ps();
    for (int i = 0; i < whole; i += 4) {
      __m512 key[4];
      for (int c = 0; c < 4; ++c) {
        const void* row = element<T>(k_group, (i + c) * k_stride);
        key[c] = live == 0xffff ? load<T>(row) : load<T>(row, live);
      }
      for (int h = 0; h < HN; ++h)
        for (int c = 0; c < 4; ++c)
          acc[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(q_group[h * dim + i + c]), key[c], acc[h][c]);
      prefetch.step();
    }
    __m512 part[HN];
    for (int h = 0; h < HN; ++h)
      part[h] =
          _mm512_add_ps(_mm512_add_ps(acc[h][0], acc[h][1]), _mm512_add_ps(acc[h][2], acc[h][3]));
    for (int i = whole; i < length; ++i) {
      const __m512 key = load<T>(element<T>(k_group, i * k_stride), live);
      for (int h = 0; h < HN; ++h)
        part[h] = _mm512_fmadd_ps(_mm512_set1_ps(q_group[h * dim + i]), key, part[h]);
    }
    if constexpr (T == DType::kInt8) {  // the raw values' dot products times the group's scales
      const __m512 factor =
          _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, scale + start / step * k_stride));
      for (int h = 0; h < HN; ++h) sum[h] = _mm512_fmadd_ps(part[h], factor, sum[h]);
    } else {
      for (int h = 0; h < HN; ++h) sum[h] = part[h];
    }
  }
  for (int h = 0; h < HN; ++h) {
    _mm512_mask_storeu_ps(s + h * stride, live, sum[h]);
    most[h] = _mm512_mask_max_ps(most[h], live, most[h], sum[h]);
  }
}

// HN heads over a chunk's tiles: one horizontal maximum a head at the end.
template <DType T, int HN, int DIM>
PYSERVE_AVX512 void score_tiles(const float* q, int dim, int64_t k_stride, const Tile* tiles,
                                int count, float* s, int stride, float* top, Prefetcher& prefetch) {
  __m512 most[HN];
  for (int h = 0; h < HN; ++h) most[h] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int j = 0, offset = 0; j < count; offset += tiles[j++].tokens)
    for (int t0 = 0; t0 < tiles[j].tokens; t0 += 16)
      score_heads<T, HN, DIM>(q, dim, element<T>(tiles[j].k, t0), k_stride,
                              lanes(tiles[j].tokens - t0), s + offset + t0, stride, most, prefetch,
                              T == DType::kInt8 ? tiles[j].k_scale + t0 : nullptr);
  for (int h = 0; h < HN; ++h) top[h] = _mm512_reduce_max_ps(most[h]);
}

template <DType T, int DIM>
PYSERVE_AVX512 void score_as(const float* q, int group, int dim, int64_t k_stride,
                             const Tile* tiles, int count, const PrefetchSpan* ahead,
                             int ahead_count, float* s, int stride, float* top) {
  int64_t steps = 0;
  for (int j = 0; j < count; ++j) steps += (tiles[j].tokens + 15) / 16 * (dim / 4);
  Prefetcher prefetch(ahead, ahead_count, steps);
  Prefetcher idle = Prefetcher::none();
  for (int h = 0; h < group; h += 4) {  // the first pass over the chunk prefetches
    const float* qh = q + h * dim;
    float* sh = s + h * stride;
    Prefetcher& p = h == 0 ? prefetch : idle;
    switch (group - h) {
      case 1:
        score_tiles<T, 1, DIM>(qh, dim, k_stride, tiles, count, sh, stride, top + h, p);
        break;
      case 2:
        score_tiles<T, 2, DIM>(qh, dim, k_stride, tiles, count, sh, stride, top + h, p);
        break;
      case 3:
        score_tiles<T, 3, DIM>(qh, dim, k_stride, tiles, count, sh, stride, top + h, p);
        break;
      default:
        score_tiles<T, 4, DIM>(qh, dim, k_stride, tiles, count, sh, stride, top + h, p);
    }
  }
  prefetch.finish();
}

template <DType T>
PYSERVE_AVX512 void score_for(const float* q, int group, int dim, int64_t k_stride,
                              const Tile* tiles, int count, const PrefetchSpan* ahead,
                              int ahead_count, float* s, int stride, float* top) {
  if (dim == 64)
    return score_as<T, 64>(q, group, dim, k_stride, tiles, count, ahead, ahead_count, s, stride,
                           top);
  if (dim == 128)
    return score_as<T, 128>(q, group, dim, k_stride, tiles, count, ahead, ahead_count, s, stride,
                            top);
  return score_as<T, 0>(q, group, dim, k_stride, tiles, count, ahead, ahead_count, s, stride, top);
}

PYSERVE_AVX512 void score(DType cache, const float* q, int group, int dim, int64_t k_stride,
                          const Tile* tiles, int count, const PrefetchSpan* ahead, int ahead_count,
                          float* s, int stride, float* top) {
  switch (cache) {
    case DType::kFloat32:
      return score_for<DType::kFloat32>(q, group, dim, k_stride, tiles, count, ahead, ahead_count,
                                        s, stride, top);
    case DType::kBFloat16:
      return score_for<DType::kBFloat16>(q, group, dim, k_stride, tiles, count, ahead, ahead_count,
                                         s, stride, top);
    case DType::kFloat16:
      return score_for<DType::kFloat16>(q, group, dim, k_stride, tiles, count, ahead, ahead_count,
                                        s, stride, top);
    case DType::kInt8:
      return score_for<DType::kInt8>(q, group, dim, k_stride, tiles, count, ahead, ahead_count, s,
                                     stride, top);
  }
}

PYSERVE_AVX512 float exp_sum(float* s, int n, float shift) {
  const __m512 offset = _mm512_set1_ps(shift);
  __m512 total = _mm512_setzero_ps();
  for (int t = 0; t < n; t += 16) {
    const __mmask16 live = lanes(n - t);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), offset));
    _mm512_mask_storeu_ps(s + t, live, e);
    total = _mm512_mask_add_ps(total, live, total, e);
  }
  return _mm512_reduce_add_ps(total);
}

PYSERVE_AVX512 float softcap(float* s, int n, float cap) {
  const __m512 c = _mm512_set1_ps(cap), inverse = _mm512_set1_ps(1.0f / cap);
  __m512 most = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int t = 0; t < n; t += 16) {
    const __mmask16 live = lanes(n - t);
    const __m512 capped =
        _mm512_mul_ps(c, avx512::tanh(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + t), inverse)));
    _mm512_mask_storeu_ps(s + t, live, capped);
    most = _mm512_mask_max_ps(most, live, most, capped);
  }
  return _mm512_reduce_max_ps(most);
}

// G heads of the group over a chunk's tiles, their sums in registers throughout, each V row
// loaded and converted once for all of them. The weight of head g's token o (over the chunk) at
// p[g·stride + o]; int8: one per group of the row, already times its V scale, group r's at
// p[g·stride + o·groups + r].
template <DType T, int DIM, int G>
PYSERVE_AVX512 void accumulate_heads(const float* p, int stride, const Tile* tiles, int count,
                                     float* acc, Prefetcher& prefetch) {
  constexpr int chunks = DIM / 16;
  constexpr int groups = T == DType::kInt8 ? DIM / kInt8Group : 1;
  static_assert(DIM % (16 * groups) == 0, "whole groups, two vectors each");
  constexpr int per_group = chunks / groups;
  __m512 sum[G][chunks];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < chunks; ++c) sum[g][c] = _mm512_loadu_ps(acc + g * DIM + 16 * c);
  for (int j = 0, offset = 0; j < count; offset += tiles[j++].tokens) {
    const void* v = tiles[j].v;
    const float* pj = p + offset * groups;
    for (int t = 0; t < tiles[j].tokens; ++t) {
      __m512 row[chunks];
      for (int c = 0; c < chunks; ++c) row[c] = load<T>(element<T>(v, t * DIM + 16 * c));
      for (int g = 0; g < G; ++g)
        for (int r = 0; r < groups; ++r) {
          const __m512 weight = _mm512_set1_ps(pj[g * stride + t * groups + r]);
          for (int c = r * per_group; c < (r + 1) * per_group; ++c)
            sum[g][c] = _mm512_fmadd_ps(weight, row[c], sum[g][c]);
        }
      prefetch.step();
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < chunks; ++c) _mm512_storeu_ps(acc + g * DIM + 16 * c, sum[g][c]);
}

// int8: w[h·kChunkTokens·groups + o·groups + r] = p[h·stride + o] · the V scale of group r of
// the chunk's token o, for every head: token-major as the cache's scales, 16 products at a time
// (each weight spread over its groups' lanes by one permute), once a chunk, so that the loop
// over V rows multiplies no more than a float cache's.
template <int DIM>
PYSERVE_AVX512 void scale_weights(const float* p, int stride, int group, const Tile* tiles,
                                  int count, float* w) {
  constexpr int groups = DIM / kInt8Group;
  static_assert(16 % groups == 0, "a vector holds whole tokens' groups");
  alignas(64) float scales[kChunkTokens * groups];  // the chunk's V scales as floats
  int total = 0;
  for (int j = 0; j < count; total += tiles[j++].tokens) {
    const int n = tiles[j].tokens * groups;
    for (int i = 0; i < n; i += 16) {
      const __mmask16 live = lanes(n - i);
      const __m256i half = _mm256_maskz_loadu_epi16(live, tiles[j].v_scale + i);
      _mm512_mask_storeu_ps(scales + total * groups + i, live, _mm512_cvtph_ps(half));
    }
  }
  alignas(64) int32_t spread[16];  // lane l takes the weight of the vector's token l / groups
  for (int l = 0; l < 16; ++l) spread[l] = l / groups;
  const __m512i index = _mm512_load_si512(spread);
  const int n = total * groups;
  for (int h = 0; h < group; ++h)
    for (int i = 0; i < n; i += 16) {
      const int first = i / groups;
      const __m512 weights = _mm512_maskz_loadu_ps(lanes(total - first), p + h * stride + first);
      const __mmask16 live = lanes(n - i);
      const __m512 scale = _mm512_maskz_loadu_ps(live, scales + i);
      _mm512_mask_storeu_ps(w + h * kChunkTokens * groups + i, live,
                            _mm512_mul_ps(_mm512_permutexvar_ps(index, weights), scale));
    }
}

template <DType T, int DIM>
PYSERVE_AVX512 void accumulate_as(const float* p, int stride, int group, int dim, const Tile* tiles,
                                  int count, const PrefetchSpan* ahead, int ahead_count,
                                  float* acc) {
  int64_t steps = 0;
  for (int j = 0; j < count; ++j) steps += tiles[j].tokens;
  Prefetcher prefetch(ahead, ahead_count, steps);
  if constexpr (DIM > 0) {
    constexpr int groups = T == DType::kInt8 ? DIM / kInt8Group : 1;
    thread_local std::vector<float> scaled;  // int8's weights, per head and group
    if constexpr (T == DType::kInt8) {
      scaled.resize(static_cast<size_t>(group) * groups * kChunkTokens);
      scale_weights<DIM>(p, stride, group, tiles, count, scaled.data());
      p = scaled.data();
      stride = kChunkTokens * groups;
    }
    Prefetcher idle = Prefetcher::none();
    constexpr int most = DIM <= 64 ? 4 : 2;  // sums + a row within the 32 registers
    for (int h = 0; h < group;) {            // the first pass over the chunk prefetches
      const float* ph = p + h * stride;
      float* acc_h = acc + h * DIM;
      Prefetcher& pf = h == 0 ? prefetch : idle;
      switch (std::min(most, group - h)) {
        case 1:
          accumulate_heads<T, DIM, 1>(ph, stride, tiles, count, acc_h, pf);
          h += 1;
          break;
        case 2:
          accumulate_heads<T, DIM, 2>(ph, stride, tiles, count, acc_h, pf);
          h += 2;
          break;
        case 3:
          accumulate_heads<T, DIM, 3>(ph, stride, tiles, count, acc_h, pf);
          h += 3;
          break;
        default:
          accumulate_heads<T, DIM, most>(ph, stride, tiles, count, acc_h, pf);
          h += most;
      }
    }
  } else {
    const int groups = int8_groups(dim);
    for (int j = 0, offset = 0; j < count; offset += tiles[j++].tokens) {
      const void* v = tiles[j].v;
      for (int h = 0; h < group; ++h) {
        const float* ph = p + h * stride + offset;
        for (int i = 0; i < dim; i += 16) {
          const __mmask16 live = lanes(dim - i);
          __m512 sum = _mm512_maskz_loadu_ps(live, acc + h * dim + i);
          for (int t = 0; t < tiles[j].tokens; ++t) {
            // int8: the weight times the group's scale, then the raw values
            const float factor =
                T == DType::kInt8 ? _cvtsh_ss(tiles[j].v_scale[t * groups + i / kInt8Group]) : 1.0f;
            const __m512 weight = _mm512_set1_ps(ph[t] * factor);
            sum = _mm512_fmadd_ps(weight, load<T>(element<T>(v, int64_t{t} * dim + i), live), sum);
          }
          _mm512_mask_storeu_ps(acc + h * dim + i, live, sum);
        }
      }
    }
  }
  prefetch.finish();
}

template <DType T>
PYSERVE_AVX512 void accumulate_for(const float* p, int stride, int group, int dim,
                                   const Tile* tiles, int count, const PrefetchSpan* ahead,
                                   int ahead_count, float* acc) {
  if (dim == 64)
    return accumulate_as<T, 64>(p, stride, group, dim, tiles, count, ahead, ahead_count, acc);
  if (dim == 128)
    return accumulate_as<T, 128>(p, stride, group, dim, tiles, count, ahead, ahead_count, acc);
  return accumulate_as<T, 0>(p, stride, group, dim, tiles, count, ahead, ahead_count, acc);
}

PYSERVE_AVX512 void accumulate(DType cache, const float* p, int stride, int group, int dim,
                               const Tile* tiles, int count, const PrefetchSpan* ahead,
                               int ahead_count, float* acc) {
  switch (cache) {
    case DType::kFloat32:
      return accumulate_for<DType::kFloat32>(p, stride, group, dim, tiles, count, ahead,
                                             ahead_count, acc);
    case DType::kBFloat16:
      return accumulate_for<DType::kBFloat16>(p, stride, group, dim, tiles, count, ahead,
                                              ahead_count, acc);
    case DType::kFloat16:
      return accumulate_for<DType::kFloat16>(p, stride, group, dim, tiles, count, ahead,
                                             ahead_count, acc);
    case DType::kInt8:
      return accumulate_for<DType::kInt8>(p, stride, group, dim, tiles, count, ahead, ahead_count,
                                          acc);
  }
}

}  // namespace

const AttentionKernels& avx512_attention() {
  static const AttentionKernels table{"avx512", score, exp_sum, softcap, accumulate};
  return table;
}

}  // namespace pyserve_kernels

#else  // not x86-64: the dispatcher never picks this path

namespace pyserve_kernels {
const AttentionKernels& avx512_attention() { return scalar_attention(); }
}  // namespace pyserve_kernels

#endif
