#include "draft_costs.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "errors.h"

namespace pyserve {

void DraftCosts::set(const std::vector<double>& ms_by_tokens, double verify_overhead_ms) {
  if (!(verify_overhead_ms >= 0.0) || !std::isfinite(verify_overhead_ms)) {
    throw ValueError("verify_overhead_ms must be a finite number >= 0, got " +
                     std::to_string(verify_overhead_ms));
  }
  std::vector<std::pair<int64_t, double>> points;
  for (size_t t = 1; t < ms_by_tokens.size(); ++t) {
    const double ms = ms_by_tokens[t];
    if (!std::isfinite(ms)) {
      throw ValueError("decode costs must be finite, got " + std::to_string(ms) + " for " +
                       std::to_string(t) + " tokens");
    }
    if (ms > 0.0) points.emplace_back(static_cast<int64_t>(t), ms);
  }
  points_ = std::move(points);
  overhead_ms_ = verify_overhead_ms;
}

double DraftCosts::cost(int64_t tokens) const {
  const auto& p = points_;
  auto above = std::lower_bound(p.begin(), p.end(), tokens,
                                [](const auto& point, int64_t t) { return point.first < t; });
  if (above != p.end() && above->first == tokens) return above->second;
  if (above == p.begin()) return above->second;  // below every measurement: no cheaper
  if (above != p.end()) {
    const auto& lo = *(above - 1);
    const double f =
        static_cast<double>(tokens - lo.first) / static_cast<double>(above->first - lo.first);
    return lo.second + f * (above->second - lo.second);
  }
  const auto& last = p.back();
  double slope = kPriorSlope * last.second / static_cast<double>(last.first);
  if (p.size() >= 2) {
    const auto& before = p[p.size() - 2];
    slope = std::max(
        0.0, (last.second - before.second) / static_cast<double>(last.first - before.first));
  }
  return last.second + slope * static_cast<double>(tokens - last.first);
}

int64_t DraftCosts::length(int64_t decodes, int64_t drafts, double gain, double acceptance,
                           int64_t k) const {
  if (!known() || k <= 0 || decodes <= 0) return k;
  // The step without these drafts must have been measured: below every measurement cost() can
  // only say "no cheaper", which would price the plain step at a verify's cost and make any
  // draft look free (a draft model that drafts every step would never let one be measured).
  if (points_.front().first > decodes + drafts) return 0;
  const double tokens = static_cast<double>(decodes) + gain;
  const double base_rate = tokens / (cost(decodes + drafts) + (drafts > 0 ? overhead_ms_ : 0.0));
  auto rate = [&](int64_t n) {
    return (tokens + acceptance * static_cast<double>(n)) /
           (cost(decodes + drafts + n) + overhead_ms_);
  };
  if (rate(k) > base_rate) return k;
  int64_t best = 0;
  double best_rate = base_rate;
  for (int64_t n = 1; n < k; ++n) {
    if (rate(n) > best_rate) {
      best_rate = rate(n);
      best = n;
    }
  }
  return best;
}

}  // namespace pyserve
