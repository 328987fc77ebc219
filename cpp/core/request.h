// Request: one generation request as the planner tracks it.
#pragma once

#include <cstdint>
#include <list>
#include <vector>

#include "block_allocator.h"
#include "radix_cache.h"

namespace pyserve {

enum class RequestState {
  kWaiting,    // queued, never admitted
  kRunning,    // admitted: prefilling (in one or more chunks) or decoding
  kRetracted,  // preempted: blocks freed, queued again to be recomputed
  kDone,       // finished or aborted, but still named by an unreported step
};

const char* state_name(RequestState state);

struct Request {
  int64_t rid = 0;
  std::vector<int32_t> prompt;
  std::vector<int32_t> output;  // sampled tokens reported so far
  int64_t max_new_tokens = 0;
  int64_t priority = 0;  // lower runs first (the priority policy; 0 under the others)
  int32_t tenant = 0;    // whose request it is (tenant fairness; 0 without it)
  // false: admission never reuses cached prefix blocks, so every prompt position is computed
  // (an embedding that pools over all of them needs each one's hidden state); its blocks are
  // freed at the end, never cached
  bool match_prefix = true;
  // [start, end) pairs of prompt positions, ascending and disjoint, that one forward pass must
  // compute whole (an image whose positions attend to each other): no prefill chunk ends
  // strictly inside one. They stay with the request across retraction and recompute.
  std::vector<int32_t> whole_spans;
  RequestState state = RequestState::kWaiting;

  // While running. Positions [0, num_scheduled) are computed or planned in an unreported step;
  // positions [0, num_computed) are computed (reported). The prefill covers [0, prefill_target):
  // the prompt plus, after a retraction, the output it already had.
  std::vector<BlockId> table;  // block i holds positions [i * block_size, (i + 1) * block_size)
  NodeId node = kRootNode;     // locked cache node; its path covers positions [0, tree_len)
  int64_t tree_len = 0;        // table blocks below this are in the tree (or duplicate it)
  int64_t prefill_target = 0;
  int64_t num_scheduled = 0;
  int64_t num_computed = 0;
  int64_t planned_samples = 0;  // samples planned so far, reported or not (a verify entry
                                // counts all 1 + k it may yield until its report)

  // Speculative decoding. draft: tokens set_draft proposed for the next decode entry, consumed
  // by the next plan(). verifying: the drafts of an unreported verify entry; while it is
  // non-empty the request gets no entry, because its next input depends on the verify result.
  std::vector<int32_t> draft;
  std::vector<int32_t> verifying;
  bool worker_drafts = false;  // draft and verifying are placeholders: the draft model drafts
  // speculative_chain: an unreported verify entry planned behind the one of `verifying`, as if
  // that accepts every draft: its drafts, and where its record is (-1: none chained).
  std::vector<int32_t> chained_drafts;
  int64_t chained_step = -1;
  size_t chained_entry = 0;
  bool chained() const { return chained_step >= 0; }
  int64_t spec_drafted = 0;   // drafts of its reported verify entries
  int64_t spec_accepted = 0;  // of which accepted

  // The disk tier: while waiting, blocks being filled from disk files by an unreported step
  // (owned by the request until that report puts them in the tree), and the cache node it locks
  // meanwhile (-1: none), which keeps the prefix it loads onto, then the loaded blocks, in RAM
  // until it is admitted.
  std::vector<BlockId> loading;
  NodeId load_node = -1;

  int64_t cached_tokens = 0;  // prefix hit at the first admission
  int64_t served_to = 0;      // tenant fairness: its positions below this were counted served
  bool ever_admitted = false;
  int32_t inflight_steps = 0;               // unreported steps with an entry for this request
  std::list<Request*>::iterator queue_pos;  // valid while waiting or retracted

  int64_t seq_len() const { return static_cast<int64_t>(prompt.size() + output.size()); }
  int32_t token_at(int64_t pos) const {
    const int64_t p = static_cast<int64_t>(prompt.size());
    return pos < p ? prompt[static_cast<size_t>(pos)] : output[static_cast<size_t>(pos - p)];
  }
};

}  // namespace pyserve
