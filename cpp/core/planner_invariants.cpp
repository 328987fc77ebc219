// Planner::check_invariants: the exact ownership and bookkeeping rules, checked in tests after
// every operation. O(blocks + nodes + total table length): never called on the hot path.
#include <string>
#include <unordered_map>
#include <vector>

#include "errors.h"
#include "planner.h"

namespace pyserve {

void Planner::check_invariants() const {
  auto fail = [](const std::string& msg) { throw InvariantError("planner: " + msg); };
  allocator_.check_invariants();
  cache_.check_invariants();

  const size_t num_blocks = static_cast<size_t>(allocator_.num_blocks());
  const bool radix = config_.enable_radix_cache;

  // Request states and queues.
  size_t waiting = 0;
  size_t running = 0;
  for (const auto& [rid, owned] : requests_) {
    const Request& r = *owned;
    const std::string name = "request " + std::to_string(rid);
    if (r.rid != rid) fail(name + " is filed under the wrong id");
    if (r.inflight_steps < 0) fail(name + " has a negative in-flight count");
    switch (r.state) {
      case RequestState::kWaiting:
      case RequestState::kRetracted:
        ++waiting;
        if (*r.queue_pos != &r) fail(name + " has a stale queue position");
        break;
      case RequestState::kRunning:
        ++running;
        break;
      case RequestState::kDone:
        if (r.inflight_steps == 0) fail(name + " is done and in no step but still kept");
        break;
    }
    if (r.state != RequestState::kRunning && !r.table.empty()) {
      fail(name + " holds blocks while " + state_name(r.state));
    }
    if (r.planned_samples > r.max_new_tokens) fail(name + " planned more samples than allowed");
    if (r.tenant != 0 && !config_.tenant_fairness) fail(name + " has a tenant without fairness");
    // every position planned for it was counted served (once)
    if (config_.tenant_fairness ? r.served_to < r.num_scheduled : r.served_to != 0) {
      fail(name + " has positions planned that its tenant was not counted");
    }
    if (r.priority != 0 && policy_ != Policy::kPriority) {
      fail(name + " has a priority under a policy that ignores it");
    }
    if (!r.draft.empty()) {
      if (r.state != RequestState::kRunning || r.num_scheduled < r.prefill_target) {
        fail(name + " holds drafts while not decoding");
      }
      if (!r.verifying.empty()) fail(name + " holds new drafts while verifying earlier ones");
      const int64_t k = static_cast<int64_t>(r.draft.size());
      if (k > config_.max_draft_tokens) fail(name + " holds more drafts than max_draft_tokens");
      if (r.planned_samples + 1 + k > r.max_new_tokens) {
        fail(name + "'s drafts could take it past max_new_tokens");
      }
    }
    if (static_cast<int64_t>(r.output.size()) > r.max_new_tokens) {
      fail(name + " has more output than max_new_tokens");
    }
  }
  if (waiting != waiting_.size()) fail("the waiting queue and the request states disagree");
  if (running != running_.size()) fail("the running set and the request states disagree");
  if (static_cast<int64_t>(running_.size()) > config_.max_running_requests) {
    fail("more running requests than max_running_requests");
  }
  for (size_t i = 0; i < running_.size(); ++i) {
    if (running_[i]->state != RequestState::kRunning) {
      fail("a non-running request is in the running set");
    }
    if (i > 0 && running_[i - 1]->priority > running_[i]->priority) {
      fail("the running set is not ordered by priority");
    }
  }
  const Request* before = nullptr;
  for (const Request* r : waiting_) {
    if (before && before->priority > r->priority)
      fail("the waiting queue is not ordered by priority");
    before = r;
  }
  if (fairness_retractions_ > retractions_ || (fairness_retractions_ && !config_.tenant_fairness)) {
    fail("fairness retractions are not a part of the retractions");
  }
  if (config_.tenant_fairness) {
    std::unordered_map<int32_t, int64_t> live;
    for (const auto& entry : requests_) {
      live[entry.second->tenant] += entry.second->state != RequestState::kDone;
    }
    for (const auto& [id, t] : tenants_) {
      if (t.live != live[id]) fail("tenant " + std::to_string(id) + "'s live count is wrong");
    }
  }
  if (drafter_) {
    size_t live = 0;
    for (const auto& entry : requests_) live += entry.second->state != RequestState::kDone;
    if (drafter_->num_requests() != live) fail("the drafter's requests and the live ones differ");
  }

  // In-flight counts.
  std::unordered_map<const Request*, int32_t> named;
  std::unordered_map<const Request*, const InflightEntry*> verify;   // the oldest
  std::unordered_map<const Request*, const InflightEntry*> chained;  // chained behind it
  for (const InflightStep& s : inflight_) {
    for (const InflightEntry& e : s.entries) {
      const bool behind_verify = verify.count(e.request) > 0;
      ++named[e.request];
      if (e.drafts < 0 || e.drafts > config_.max_draft_tokens) {
        fail("step " + std::to_string(s.step_id) + " has an entry with a bad draft count");
      }
      if (e.chained && (!e.sample || !config_.speculative_chain)) {
        fail("step " + std::to_string(s.step_id) + " has a chained entry that cannot be one");
      }
      if (behind_verify) {
        // only the entry chained behind the unreported verify entry may follow it
        if (!e.chained || !e.request->chained() || !chained.emplace(e.request, &e).second) {
          fail("request " + std::to_string(e.request->rid) +
               " is planned behind its unreported verify entry, not chained to it");
        }
        continue;
      }
      if (e.drafts == 0) continue;
      if (!e.sample) fail("step " + std::to_string(s.step_id) + " verifies without sampling");
      verify.emplace(e.request, &e);
    }
    for (const Request* r : s.loads) {
      if (++named[r] > 1) fail("request " + std::to_string(r->rid) + " loads in two steps");
      if (r->state != RequestState::kDone && r->state != RequestState::kWaiting &&
          r->state != RequestState::kRetracted) {
        fail("request " + std::to_string(r->rid) + " loads while " + state_name(r->state));
      }
    }
  }
  for (const auto& [rid, owned] : requests_) {
    auto it = named.find(owned.get());
    if ((it == named.end() ? 0 : it->second) != owned->inflight_steps) {
      fail("request " + std::to_string(rid) + " miscounts the unreported steps naming it");
    }
    // While a verify entry is unreported the request waits (nothing is scheduled after it) or
    // has one entry chained behind it.
    auto v = verify.find(owned.get());
    const size_t k = v == verify.end() ? 0 : static_cast<size_t>(v->second->drafts);
    if (owned->verifying.size() != k) {
      fail("request " + std::to_string(rid) + " verifies " +
           std::to_string(owned->verifying.size()) + " drafts, but its unreported steps " +
           std::to_string(k));
    }
    auto c = chained.find(owned.get());
    if (owned->chained() != (c != chained.end())) {
      fail("request " + std::to_string(rid) + (owned->chained() ? " has no" : " has an unmarked") +
           " entry chained behind its verify entry");
    }
    if (c != chained.end() &&
        (owned->chained_drafts.size() != static_cast<size_t>(c->second->drafts) ||
         owned->inflight_steps != 2)) {
      fail("request " + std::to_string(rid) + "'s chained entry does not match its record");
    }
    const InflightEntry* last = c != chained.end() ? c->second : k > 0 ? v->second : nullptr;
    if (last != nullptr && owned->state == RequestState::kRunning &&
        last->end != owned->num_scheduled) {
      fail("request " + std::to_string(rid) + " is scheduled past its unreported verify entry");
    }
  }

  // Refcounts: one for the tree plus one per running table that holds the block.
  std::vector<int64_t> expected(num_blocks, 0);
  for (size_t b = 0; b < num_blocks; ++b) expected[b] = cache_.in_tree(static_cast<BlockId>(b));
  std::vector<int32_t> direct_locks(static_cast<size_t>(cache_.node_id_limit()), 0);
  for (const Request* rp : running_) {
    const Request& r = *rp;
    const std::string name = "request " + std::to_string(r.rid);
    if (r.num_computed > r.num_scheduled) fail(name + " computed more than it scheduled");
    if (r.num_computed > r.seq_len()) fail(name + " computed positions whose tokens are unknown");
    if (r.num_computed < r.tree_len) fail(name + " cached blocks it has not computed");
    if (static_cast<int64_t>(r.table.size()) != blocks_for(r.num_scheduled)) {
      fail(name + " has " + std::to_string(r.table.size()) + " blocks for " +
           std::to_string(r.num_scheduled) + " scheduled tokens");
    }
    if (r.num_scheduled > static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens) {
      fail(name + " scheduled past prompt + max_new_tokens");
    }
    // Its scheduled positions end where its last entry did: never strictly inside a whole span.
    for (size_t i = 0; i < r.whole_spans.size(); i += 2) {
      if (r.whole_spans[i] < r.num_scheduled && r.num_scheduled < r.whole_spans[i + 1]) {
        fail(name + "'s scheduled positions end inside its whole span [" +
             std::to_string(r.whole_spans[i]) + ", " + std::to_string(r.whole_spans[i + 1]) + ")");
      }
    }
    for (BlockId b : r.table) {
      if (b < 0 || static_cast<size_t>(b) >= num_blocks) fail(name + " holds a bad block id");
      ++expected[b];
    }
    if (!radix) continue;
    if (!cache_.is_live(r.node)) fail(name + " locks a node that was evicted");
    ++direct_locks[r.node];
    if (r.tree_len % block_size_ != 0 || cache_.depth(r.node) != r.tree_len) {
      fail(name + ": its cache node does not end where its cached prefix ends");
    }
    const std::vector<BlockId> path = cache_.path_blocks(r.node);
    for (size_t i = 0; i < r.table.size(); ++i) {
      const BlockId b = r.table[i];
      if (!cache_.in_tree(b)) continue;
      if (i >= path.size() || path[i] != b) {
        fail(name + " holds tree block " + std::to_string(b) + " off its locked path");
      }
    }
  }
  // A waiting request's load: its blocks (one reference each), its lock, both only while a
  // step carrying the loads is unreported; its lock alone once they are in the tree.
  for (const Request* rp : waiting_) {
    const Request& r = *rp;
    const std::string name = "request " + std::to_string(r.rid);
    if (!r.loading.empty() && r.inflight_steps == 0) fail(name + " holds loads no step carries");
    if (!r.loading.empty() && r.load_node < 0) fail(name + " loads without a lock");
    for (BlockId b : r.loading) {
      if (b < 0 || static_cast<size_t>(b) >= num_blocks) fail(name + " loads a bad block id");
      ++expected[b];
    }
    if (r.load_node < 0) continue;
    if (!radix || config_.disk_budget_blocks == 0) fail(name + " loads without a disk tier");
    if (!cache_.is_live(r.load_node)) fail(name + " locks a node that was evicted");
    ++direct_locks[r.load_node];
  }
  for (const auto& [rid, owned] : requests_) {
    if (owned->state != RequestState::kWaiting && owned->state != RequestState::kRetracted &&
        (owned->load_node >= 0 || !owned->loading.empty())) {
      fail("request " + std::to_string(rid) + " holds a load while " + state_name(owned->state));
    }
  }
  for (size_t b = 0; b < num_blocks; ++b) {
    const int32_t actual = allocator_.refcounts()[b];
    if (actual != expected[b]) {
      fail("block " + std::to_string(b) + " has refcount " + std::to_string(actual) + ", but " +
           std::to_string(expected[b]) + " holders");
    }
  }

  // Locks: a node's count is the requests locking it directly plus its children's counts.
  if (radix) {
    std::vector<int64_t> expected_locks(direct_locks.begin(), direct_locks.end());
    for (NodeId id = 0; id < cache_.node_id_limit(); ++id) {
      if (!cache_.is_live(id) || direct_locks[id] == 0) continue;
      for (NodeId x = cache_.parent(id); x >= 0; x = cache_.parent(x)) {
        expected_locks[x] += direct_locks[id];
      }
    }
    for (NodeId id = 0; id < cache_.node_id_limit(); ++id) {
      if (cache_.is_live(id) && cache_.lock_count(id) != expected_locks[id]) {
        fail("cache node " + std::to_string(id) + " has " + std::to_string(cache_.lock_count(id)) +
             " locks, but requests hold " + std::to_string(expected_locks[id]));
      }
    }
  } else if (cache_.cached_blocks() != 0) {
    fail("the radix cache is disabled but holds blocks");
  }
}

}  // namespace pyserve
