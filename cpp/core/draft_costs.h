// DraftCosts: how many drafts a request's verify entry should carry, from what steps cost.
//
// The scheduler measures decode-only steps (the milliseconds a step of t decode tokens takes,
// drafts included) and the extra wall time a verify entry costs its step (the request's next
// entry waits for the verify result instead of overlapping it). A request whose verifies
// accepted a share `a` of their drafts is expected to gain a * k tokens from k drafts (accepted
// drafts come in runs: a copied passage accepts nearly all, an edit nearly none, so the share
// predicts better than a chance per draft); the drafts are worth their cost only if the step's
// expected tokens per millisecond grow, which a compute-bound batch (many decodes: each token
// costs about as much as the last) or a low acceptance rules out. The k asked for is kept when
// it pays; otherwise the shorter k that pays best, or none.
//
// Costs of unmeasured token counts are interpolated between measured ones; past the largest
// one they grow with the slope between the two largest (kPriorSlope of the cost a token when
// only one is known), so that a longer verify is tried, measured, and kept only if it pays.
// Below the smallest one nothing is known: a step whose cost without the drafts is unmeasured
// gets none, so that the plain step is measured before drafts are weighed against it.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace pyserve {

class DraftCosts {
 public:
  static constexpr double kPriorSlope = 0.1;

  bool known() const { return !points_.empty(); }
  // ms_by_tokens[t] = milliseconds of a decode-only step of t tokens (t >= 1; 0 or less:
  // unmeasured); ValueError for a negative overhead or a non-finite value.
  void set(const std::vector<double>& ms_by_tokens, double verify_overhead_ms);
  double cost(int64_t tokens) const;  // requires known()

  // The drafts (0..k) to give one more request, whose verifies accepted a share `acceptance`
  // of their drafts, in a step of `decodes` decode entries that already verifies `drafts`
  // drafts expected to yield `gain` extra tokens.
  int64_t length(int64_t decodes, int64_t drafts, double gain, double acceptance, int64_t k) const;

 private:
  std::vector<std::pair<int64_t, double>> points_;  // measured (tokens, ms), by tokens
  double overhead_ms_ = 0.0;
};

}  // namespace pyserve
