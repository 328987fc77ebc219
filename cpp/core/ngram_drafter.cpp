#include "ngram_drafter.h"

#include <algorithm>
#include <string>

#include "errors.h"

namespace pyserve {

void check_drafter_config(const NgramDrafterConfig& c) {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw ValueError(message);
  };
  require(c.max_draft_tokens >= 1, "speculative drafts need max_draft_tokens >= 1, got " +
                                       std::to_string(c.max_draft_tokens));
  require(c.min_match >= 1 && c.min_match <= c.max_match && c.max_match <= kMaxNgram,
          "n-gram match lengths must satisfy 1 <= min_match <= max_match <= " +
              std::to_string(kMaxNgram) + ", got " + std::to_string(c.min_match) + " and " +
              std::to_string(c.max_match));
  require(c.corpus_tokens >= 0,
          "the n-gram corpus budget must be >= 0 tokens, got " + std::to_string(c.corpus_tokens));
}

NgramDrafter::NgramDrafter(const NgramDrafterConfig& config) : config_(config) {
  check_drafter_config(config_);
  if (config_.corpus_tokens > 0 && config_.lookup) {
    corpus_ = std::make_unique<NgramCorpus>(static_cast<int32_t>(config_.max_match),
                                            config_.corpus_tokens, config_.vocab_size);
  }
}

void NgramDrafter::add(int64_t rid, const int32_t* prompt, size_t n) {
  auto [it, added] =
      slots_.try_emplace(rid, static_cast<int32_t>(config_.max_match), config_.vocab_size);
  if (!added) throw ValueError("drafter: request " + std::to_string(rid) + " already exists");
  if (config_.lookup) it->second.index.append(prompt, n);
  it->second.length = std::min(kFirstLength, config_.max_draft_tokens);
}

void NgramDrafter::append(int64_t rid, int32_t token) {
  auto it = slots_.find(rid);
  if (it != slots_.end() && config_.lookup) it->second.index.append(&token, 1);
}

void NgramDrafter::end(int64_t rid, const int32_t* sequence, size_t n) {
  slots_.erase(rid);
  if (corpus_) corpus_->add_sequence(sequence, n);
}

void NgramDrafter::clear_corpus() {
  if (corpus_) corpus_->clear();
}

int64_t NgramDrafter::wanted(int64_t rid, int64_t limit) {
  auto it = slots_.find(rid);
  if (it == slots_.end() || limit <= 0) return 0;
  Slot& s = it->second;
  if (s.skip > 0) {
    --s.skip;
    return 0;
  }
  return std::min(s.length, limit);
}

std::vector<int32_t> NgramDrafter::draft(int64_t rid, int64_t k, int64_t unknown,
                                         const std::vector<int32_t>& assumed) const {
  auto it = slots_.find(rid);
  if (it == slots_.end() || k <= 0) return {};
  // A continuation stops at the end of the history it was found in; the drafts then go on from a
  // lookup of what they end with (a loop, or a passage quoted again, continues).
  // The tokens past the history: the assumed ones, then the drafts (the unknown first).
  std::vector<int32_t> past = assumed;
  const size_t want = assumed.size() + static_cast<size_t>(k + unknown);
  while (past.size() < want) {
    const NgramDraft d = ngram_draft_after(it->second.index, past.data(), past.size(),
                                           corpus_.get(), static_cast<int64_t>(want - past.size()),
                                           config_.min_match, config_.max_match);
    if (d.tokens.empty()) break;
    past.insert(past.end(), d.tokens.begin(), d.tokens.end());
  }
  const size_t first = assumed.size() + static_cast<size_t>(unknown);
  if (past.size() <= first) return {};
  return std::vector<int32_t>(past.begin() + static_cast<std::ptrdiff_t>(first), past.end());
}

bool NgramDrafter::accepted_all_last(int64_t rid) const {
  auto it = slots_.find(rid);
  return it != slots_.end() && it->second.accepted_all_last;
}

double NgramDrafter::acceptance(int64_t rid) const {
  auto it = slots_.find(rid);
  return it == slots_.end() ? 0.0 : it->second.acceptance;
}

void NgramDrafter::declined(int64_t rid) {
  auto it = slots_.find(rid);
  if (it == slots_.end()) return;
  it->second.acceptance += kRecovery * (kPriorAcceptance - it->second.acceptance);
}

void NgramDrafter::verified(int64_t rid, int64_t drafted, int64_t accepted) {
  auto it = slots_.find(rid);
  if (it == slots_.end() || drafted <= 0) return;
  Slot& s = it->second;
  s.accepted_all_last = accepted >= drafted;
  const int64_t floor = config_.lookup ? std::min(kFirstLength, config_.max_draft_tokens) : 1;
  if (accepted >= drafted) {
    s.length = std::min(config_.max_draft_tokens, s.length + std::max<int64_t>(1, s.length / 2));
  } else {
    s.length = std::max(floor, accepted + 1);
  }
  s.gain = 0.5 * s.gain + 0.5 * static_cast<double>(accepted);
  s.acceptance =
      0.5 * s.acceptance + 0.5 * static_cast<double>(accepted) / static_cast<double>(drafted);
  if (s.gain >= (config_.lookup ? kMinLookupGain : kMinGain) || accepted >= drafted) {
    s.misses = 0;
    return;
  }
  s.misses = std::min(s.misses + 1, 6);
  s.skip = std::min<int32_t>(kMaxBackoff, 1 << s.misses);
}

}  // namespace pyserve
