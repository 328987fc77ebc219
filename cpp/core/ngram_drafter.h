// NgramDrafter: the planner's own n-gram drafts for speculative decoding.
//
// It keeps an NgramIndex of every live request's history (prompt, then each reported token) and
// a corpus of the sequences that ended (NgramCorpus, under a token budget), and proposes drafts
// with ngram_draft. The planner asks it for drafts while planning decode entries, so a draft
// costs one lookup in C++ per decoding request and never a round trip through Python.
//
// Drafting ahead of an unreported token: when a request's plain decode is still in flight, its
// history lacks the token being sampled. The drafter then drafts one token further and drops
// the first, which stands in for the unknown one; when that guess is wrong, verification
// rejects the drafts (outputs stay exact, only the work is lost). Behind an unreported verify
// entry the history also lacks its drafts: they are looked up as if accepted.
//
// Draft length adapts per request: it starts at kFirstLength (at most max_draft_tokens), grows by
// half again after a verify that accepted every draft and shrinks to accepted + 1 after one that
// did not, but with lookups never below kFirstLength: a lookup's drafts cost nothing to make, and
// a copied passage that diverged for a token (a renamed word) usually goes on matching. A verify
// costs more than a plain decode (its extra positions, and the request's overlap: its next entry
// waits for the verify result), so it pays only when it is accepted often enough: each request
// keeps a running mean of the drafts its verifies accepted, and while that mean is below the
// minimum gain (kMinLookupGain with lookups, kMinGain for a draft model's drafts, which cost
// draft steps) and the verify did not accept every draft, the request skips its next drafting
// chances, 2, 4, .. up to kMaxBackoff after consecutive misses.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "ngram_index.h"

namespace pyserve {

struct NgramDrafterConfig {
  int64_t max_draft_tokens = 8;  // K: the most drafts one verify entry carries
  int64_t min_match = 2;         // the shortest suffix that may propose a draft
  int64_t max_match = 4;         // the longest suffix looked up
  int64_t corpus_tokens = 0;     // tokens of ended sequences kept to draft from; 0: none
  bool lookup = true;  // false: only the lengths and back-off (a draft model drafts instead)
  int64_t vocab_size = 2147483647;
};

class NgramDrafter {
 public:
  static constexpr int32_t kMaxBackoff = 64;
  static constexpr int64_t kFirstLength = 4;
  static constexpr double kMinGain = 1.0;          // accepted drafts per verify worth their cost
  static constexpr double kMinLookupGain = 0.5;    // the same for lookups, which cost no draft step
  static constexpr double kPriorAcceptance = 0.8;  // a new request's
  static constexpr double kRecovery = 0.25;        // of the way back to it, each time declined

  explicit NgramDrafter(const NgramDrafterConfig& config);

  const NgramDrafterConfig& config() const { return config_; }
  size_t num_requests() const { return slots_.size(); }
  const NgramCorpus* corpus() const { return corpus_.get(); }

  // A new request; its prompt is the start of its history. The caller has checked the tokens.
  void add(int64_t rid, const int32_t* prompt, size_t n);
  void append(int64_t rid, int32_t token);  // a reported token
  // The request ended: its whole sequence (prompt + output) joins the corpus, if there is one.
  void end(int64_t rid, const int32_t* sequence, size_t n);
  void clear_corpus();

  // How many drafts the request wants now (0: none this time), at most `limit`. Counts down a
  // back-off, so call it once per decode entry planned.
  int64_t wanted(int64_t rid, int64_t limit);
  // Up to `k` drafts following the request's history extended by `assumed` (drafts of an
  // unreported verify entry, taken as accepted), then by `unknown` (0 or 1) unreported tokens;
  // empty when nothing matched. A continuation that reaches the end of its history goes on
  // from a lookup of the drafts so far.
  std::vector<int32_t> draft(int64_t rid, int64_t k, int64_t unknown,
                             const std::vector<int32_t>& assumed = {}) const;
  // A verify entry of `drafted` drafts accepted `accepted` of them.
  void verified(int64_t rid, int64_t drafted, int64_t accepted);
  // The share of its drafts the request's recent verifies accepted (a running mean).
  double acceptance(int64_t rid) const;
  // Whether the request's last verify accepted every draft: a verify still unreported is then
  // likely to as well (a copied passage), which is when planning behind it pays.
  bool accepted_all_last(int64_t rid) const;
  // The costs ruled out drafts for the request this time: its acceptance drifts back towards
  // kPriorAcceptance, so that a request whose drafts failed for a while tries again later rather
  // than never (no verify, no new evidence).
  void declined(int64_t rid);

 private:
  struct Slot {
    explicit Slot(int32_t max_ngram, int64_t vocab) : index(max_ngram, vocab) {}
    NgramIndex index;
    int64_t length = 0;  // drafts wanted at the next verify
    double gain = 2.0;   // running mean of the drafts a verify accepted (optimistic at first)
    double acceptance = kPriorAcceptance;  // running mean of the share of drafts accepted
    int32_t misses = 0;                    // consecutive verifies that left the mean too low
    int32_t skip = 0;                      // decode entries still to plan without drafts
    bool accepted_all_last = false;        // the last verify accepted every draft
  };

  NgramDrafterConfig config_;
  std::unordered_map<int64_t, Slot> slots_;
  std::unique_ptr<NgramCorpus> corpus_;
};

// ValueError unless the settings are usable (1 <= min_match <= max_match <= kMaxNgram, ...).
void check_drafter_config(const NgramDrafterConfig& config);

}  // namespace pyserve
