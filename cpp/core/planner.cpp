#include "planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "errors.h"

namespace pyserve {

namespace {

// How many waiting requests lpm sorts by prefix match; the rest follow in arrival order, so a
// long queue costs a bounded number of tree walks per plan.
constexpr size_t kLpmWindow = 256;

void require(bool ok, const std::string& message) {
  if (!ok) throw ValueError(message);
}

Policy parse_policy(const std::string& policy) {
  if (policy == "fcfs") return Policy::kFcfs;
  if (policy == "lpm") return Policy::kLpm;
  if (policy == "priority") return Policy::kPriority;
  throw ValueError("policy must be \"fcfs\", \"lpm\" or \"priority\", got \"" + policy + "\"");
}

const PlannerConfig& validated(const PlannerConfig& c) {
  require(c.block_size >= 1, "block_size must be >= 1, got " + std::to_string(c.block_size));
  require(c.max_running_requests >= 1,
          "max_running_requests must be >= 1, got " + std::to_string(c.max_running_requests));
  require(c.max_prefill_tokens >= 1,
          "max_prefill_tokens must be >= 1, got " + std::to_string(c.max_prefill_tokens));
  require(c.chunked_prefill_size >= 1,
          "chunked_prefill_size must be >= 1, got " + std::to_string(c.chunked_prefill_size));
  require(c.vocab_size >= 1 && c.vocab_size <= 2147483647,
          "vocab_size must be in [1, 2**31-1], got " + std::to_string(c.vocab_size));
  require(c.min_reserve_ratio >= 0.0 && c.min_reserve_ratio <= c.init_reserve_ratio &&
              c.init_reserve_ratio <= 1.0,
          "reserve ratios must satisfy 0 <= min_reserve_ratio <= init_reserve_ratio <= 1, got " +
              std::to_string(c.min_reserve_ratio) + " and " + std::to_string(c.init_reserve_ratio));
  require(c.reserve_decay >= 0.0,
          "reserve_decay must be >= 0, got " + std::to_string(c.reserve_decay));
  require(c.max_draft_tokens >= 0 && c.max_draft_tokens <= 65536,
          "max_draft_tokens must be in [0, 65536], got " + std::to_string(c.max_draft_tokens));
  require(!(c.speculative_ngram && c.speculative_draft_model),
          "speculative_ngram and speculative_draft_model are alternatives: choose one");
  require(!c.speculative_chain || c.speculative_ngram,
          "speculative_chain chains the planner's own n-gram drafts: it needs speculative_ngram");
  require(!c.tenant_fairness || c.policy == "fcfs",
          "tenant_fairness orders admission by itself: it needs the fcfs policy, got \"" +
              c.policy + "\"");
  require(c.fairness_quantum >= 0,
          "fairness_quantum must be >= 0, got " + std::to_string(c.fairness_quantum));
  require(c.speculative_token_budget >= 1, "speculative_token_budget must be >= 1, got " +
                                               std::to_string(c.speculative_token_budget));
  require(c.disk_budget_blocks >= 0,
          "disk_budget_blocks must be >= 0, got " + std::to_string(c.disk_budget_blocks));
  require(c.enable_radix_cache || c.disk_budget_blocks == 0,
          "disk_budget_blocks needs the radix cache (the disk tier lives in its tree)");
  return c;
}

// Where a prefill chunk from `start` ends under whole spans (ascending [s, e) pairs), given the
// end the budgets allow (`end` > start) and the furthest end the KV pool can hold now (`limit`):
// a chunk that starts inside a span, or at its start, runs at least to the span's end, past the
// budgets if need be (else a span longer than the budget could never be computed); one that
// would end strictly inside a later span ends where that span starts. Returns `start` (nothing
// can be computed now) when the pool cannot hold the rest of the span `start` lies in.
int64_t whole_span_end(const std::vector<int32_t>& spans, int64_t start, int64_t end,
                       int64_t limit) {
  if (spans.empty()) return std::min(end, limit);
  const size_t n = spans.size() / 2;
  // The first span ending after pos (ends ascend with the starts).
  auto first_ending_after = [&](int64_t pos) {
    size_t lo = 0;
    size_t hi = n;
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (spans[2 * mid + 1] > pos) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return lo;
  };
  const size_t i = first_ending_after(start);
  if (i < n && spans[2 * i] <= start) end = std::max<int64_t>(end, spans[2 * i + 1]);
  end = std::min(end, limit);
  const size_t j = first_ending_after(end);
  if (j < n && spans[2 * j] < end) end = spans[2 * j] > start ? spans[2 * j] : start;
  return end;
}

}  // namespace

const char* state_name(RequestState state) {
  switch (state) {
    case RequestState::kWaiting:
      return "waiting";
    case RequestState::kRunning:
      return "running";
    case RequestState::kRetracted:
      return "retracted";
    case RequestState::kDone:
      return "done";
  }
  return "?";
}

Planner::Planner(const PlannerConfig& config)
    : config_(validated(config)),
      policy_(parse_policy(config.policy)),
      block_size_(config.block_size),
      allocator_(config.num_blocks),
      cache_(config.block_size, allocator_),
      reserve_ratio_(config.init_reserve_ratio),
      spec_accepted_histogram_(static_cast<size_t>(config.max_draft_tokens) + 1, 0) {
  cache_.set_disk_budget(config_.disk_budget_blocks);
  if (config_.speculative_ngram || config_.speculative_draft_model) {
    NgramDrafterConfig d;
    d.lookup = config_.speculative_ngram;
    d.max_draft_tokens = config_.max_draft_tokens;
    d.min_match = config_.ngram_min_match;
    d.max_match = config_.ngram_max_match;
    d.corpus_tokens = config_.ngram_corpus_tokens;
    d.vocab_size = config_.vocab_size;
    drafter_ = std::make_unique<NgramDrafter>(d);
  }
}

Request* Planner::find(int64_t rid) const {
  auto it = requests_.find(rid);
  return it == requests_.end() ? nullptr : it->second.get();
}

// ---------------------------------------------------------------------------------------------
// Requests in and out

void Planner::add_request(int64_t rid, std::vector<int32_t> prompt, int64_t max_new_tokens,
                          bool match_prefix, std::vector<int32_t> whole_spans, int64_t priority,
                          int32_t tenant) {
  if (find(rid)) throw ValueError("request " + std::to_string(rid) + " already exists");
  require(priority == 0 || policy_ == Policy::kPriority,
          "request " + std::to_string(rid) + ": priority " + std::to_string(priority) +
              " needs the \"priority\" policy (this planner's is \"" + config_.policy + "\")");
  require(tenant == 0 || (tenant > 0 && config_.tenant_fairness),
          "request " + std::to_string(rid) + ": tenant " + std::to_string(tenant) +
              (tenant < 0 ? " is negative" : " needs tenant_fairness"));
  require(!prompt.empty(), "request " + std::to_string(rid) + ": the prompt is empty");
  require(max_new_tokens >= 1, "request " + std::to_string(rid) +
                                   ": max_new_tokens must be >= 1, got " +
                                   std::to_string(max_new_tokens));
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= config_.vocab_size) {
      throw ValueError("request " + std::to_string(rid) + ": prompt[" + std::to_string(i) +
                       "] = " + std::to_string(prompt[i]) + " is out of range [0, " +
                       std::to_string(config_.vocab_size) + ")");
    }
  }
  const int64_t capacity = static_cast<int64_t>(allocator_.num_blocks()) * block_size_;
  if (whole_spans.size() % 2 != 0) {
    throw ValueError("request " + std::to_string(rid) + ": whole_spans holds " +
                     std::to_string(whole_spans.size()) + " ints, not [start, end) pairs");
  }
  for (size_t i = 0; i < whole_spans.size(); i += 2) {
    const int64_t s = whole_spans[i];
    const int64_t e = whole_spans[i + 1];
    auto refuse = [&](const std::string& why) {
      throw ValueError("request " + std::to_string(rid) + ": whole_spans[" + std::to_string(i / 2) +
                       "] = [" + std::to_string(s) + ", " + std::to_string(e) + ") " + why);
    };
    if (s < 0 || s >= e || e > static_cast<int64_t>(prompt.size())) {
      refuse("is not a non-empty range of prompt positions [0, " + std::to_string(prompt.size()) +
             ")");
    }
    if (i > 0 && s < whole_spans[i - 1]) {
      refuse("starts before the previous span ends at " + std::to_string(whole_spans[i - 1]) +
             " (spans must ascend and not overlap)");
    }
    // A chunk computing the span holds positions [0, e) at once: a pool that cannot hold them
    // would keep the request waiting forever.
    if (blocks_for(e) > allocator_.num_blocks()) {
      refuse("needs positions [0, " + std::to_string(e) +
             ") in the KV pool at once, more than its " + std::to_string(capacity) + " tokens");
    }
  }
  const int64_t total = static_cast<int64_t>(prompt.size()) + max_new_tokens;
  if (max_new_tokens > capacity || total > capacity || total > 2147483647) {
    throw ValueError("request " + std::to_string(rid) + ": " + std::to_string(prompt.size()) +
                     " prompt tokens + " + std::to_string(max_new_tokens) +
                     " new tokens exceed the " + std::to_string(capacity) +
                     " tokens the KV pool can hold");
  }
  auto owned = std::make_unique<Request>();
  Request& r = *owned;
  r.rid = rid;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new_tokens;
  r.match_prefix = match_prefix;
  r.whole_spans = std::move(whole_spans);
  r.priority = priority;
  r.tenant = tenant;
  if (config_.tenant_fairness) {
    Tenant& t = tenants_[tenant];
    if (t.live == 0) {  // back from idle: at the least-served live tenant's count, if higher
      bool any = false;
      int64_t least = 0;
      for (const auto& [id, other] : tenants_) {
        if (other.live > 0 && (!any || other.served < least)) {
          least = other.served;
          any = true;
        }
      }
      if (any) t.served = std::max(t.served, least);
    }
    ++t.live;
  }
  r.state = RequestState::kWaiting;
  enqueue_waiting(r, /*retracted=*/false);
  if (drafter_) drafter_->add(rid, r.prompt.data(), r.prompt.size());
  requests_.emplace(rid, std::move(owned));
}

void Planner::finish(int64_t rid) {
  Request* r = find(rid);
  if (!r || r->state == RequestState::kDone) {
    throw KeyError("finish: request " + std::to_string(rid) +
                   (r ? " is already finished or aborted" : " is unknown"));
  }
  end_request(*r);
}

bool Planner::abort(int64_t rid) {
  Request* r = find(rid);
  if (!r || r->state == RequestState::kDone) return false;
  end_request(*r);
  return true;
}

void Planner::end_request(Request& r) {
  if (r.state == RequestState::kRunning) {
    release_blocks(r);
    remove_running(r);
  } else {
    waiting_.erase(r.queue_pos);
    drop_load(r);
  }
  r.state = RequestState::kDone;
  if (config_.tenant_fairness) --tenants_[r.tenant].live;
  if (drafter_) {
    const std::vector<int32_t>& seq = sequence(r);
    drafter_->end(r.rid, seq.data(), seq.size());
  }
  dropped_.push_back(r.rid);
  if (r.inflight_steps == 0) requests_.erase(r.rid);
}

int64_t Planner::flush_cache() {
  if (drafter_) drafter_->clear_corpus();  // it holds what earlier requests computed, as the tree
  clear_disk_ = config_.disk_budget_blocks > 0;
  return cache_.reset();
}

int64_t Planner::spill_to_disk() {
  if (config_.disk_budget_blocks == 0) return 0;
  const int64_t before = cache_.stats().saved_blocks;
  cache_.evict(std::numeric_limits<int64_t>::max());
  return cache_.stats().saved_blocks - before;
}

void Planner::fail_loads(int64_t step_id, const std::vector<BlockId>& blocks) {
  if (inflight_.empty() || inflight_.front().step_id != step_id) {
    throw ProtocolError("fail_loads for step " + std::to_string(step_id) +
                        ", which is not the oldest unreported step");
  }
  InflightStep& s = inflight_.front();
  for (BlockId b : blocks) {
    if (std::find(s.load_blocks.begin(), s.load_blocks.end(), b) == s.load_blocks.end()) {
      throw ValueError("fail_loads for step " + std::to_string(step_id) + ": block " +
                       std::to_string(b) + " is not one of its loads");
    }
  }
  s.failed_loads.insert(s.failed_loads.end(), blocks.begin(), blocks.end());
}

void Planner::set_draft(int64_t rid, std::vector<int32_t> draft) {
  Request* r = find(rid);
  if (!r || r->state == RequestState::kDone) {
    throw KeyError("set_draft: request " + std::to_string(rid) +
                   (r ? " is already finished or aborted" : " is unknown"));
  }
  const std::string name = "set_draft: request " + std::to_string(rid);
  if (draft.empty()) {
    r->draft.clear();
    return;
  }
  // Drafts continue a sampled token, so the request must be decoding.
  require(r->state == RequestState::kRunning && r->num_scheduled >= r->prefill_target,
          name + " is " + state_name(r->state) +
              (r->state == RequestState::kRunning ? " with its prefill not fully planned" : "") +
              ": only a decoding request takes drafts");
  require(r->verifying.empty(), name + " still awaits the report that verifies its drafts");
  const int64_t k = static_cast<int64_t>(draft.size());
  require(k <= config_.max_draft_tokens,
          name + ": " + std::to_string(k) +
              " drafts, more than max_draft_tokens = " + std::to_string(config_.max_draft_tokens));
  for (size_t i = 0; i < draft.size(); ++i) {
    require(draft[i] >= 0 && draft[i] < config_.vocab_size,
            name + ": draft[" + std::to_string(i) + "] = " + std::to_string(draft[i]) +
                " is out of range [0, " + std::to_string(config_.vocab_size) + ")");
  }
  require(r->planned_samples + 1 + k <= r->max_new_tokens,
          name + ": " + std::to_string(k) +
              " drafts could take it past max_new_tokens = " + std::to_string(r->max_new_tokens) +
              " (" + std::to_string(r->planned_samples) + " samples planned)");
  r->draft = std::move(draft);
  r->worker_drafts = false;
}

// ---------------------------------------------------------------------------------------------
// Blocks

int64_t Planner::available_blocks() const {
  return allocator_.num_free() + (config_.enable_radix_cache ? cache_.evictable_blocks() : 0);
}

bool Planner::allocate_blocks(int64_t n, std::vector<BlockId>& table) {
  if (n <= 0) return true;
  if (allocator_.num_free() < n && config_.enable_radix_cache) {
    cache_.evict(n - allocator_.num_free());
  }
  if (allocator_.num_free() < n) return false;
  allocator_.allocate(n, table);
  return true;
}

// Blocks r may still need: the rest of its prefill, plus reserve_ratio of its remaining samples.
int64_t Planner::future_blocks(const Request& r) const {
  const int64_t remaining_samples = std::max<int64_t>(0, r.max_new_tokens - r.planned_samples);
  const int64_t reserved =
      static_cast<int64_t>(std::ceil(static_cast<double>(remaining_samples) * reserve_ratio_));
  const int64_t final_len = std::max(r.prefill_target, r.num_scheduled) + reserved;
  return std::max<int64_t>(0, blocks_for(final_len) - static_cast<int64_t>(r.table.size()));
}

void Planner::release_blocks(Request& r) {
  allocator_.decref(r.table.data(), r.table.size());
  if (config_.enable_radix_cache) cache_.release(r.node);
  r.table.clear();
  r.node = kRootNode;
  r.tree_len = 0;
  r.num_scheduled = 0;
  r.num_computed = 0;
  r.prefill_target = 0;
  r.draft.clear();
  r.worker_drafts = false;
}

// Releases r's scheduled positions from new_scheduled on: the blocks wholly past it go back.
// Tree blocks lie below tree_len <= num_computed <= new_scheduled, so none is released.
void Planner::truncate_scheduled(Request& r, int64_t new_scheduled) {
  const size_t keep = static_cast<size_t>(blocks_for(new_scheduled));
  allocator_.decref(r.table.data() + keep, r.table.size() - keep);
  r.table.resize(keep);
  r.num_scheduled = new_scheduled;
}

void Planner::remove_running(Request& r) {
  running_.erase(std::find(running_.begin(), running_.end(), &r));
}

// Offers r's newly computed whole blocks to the cache and moves r's lock to the new deepest
// node. Blocks the tree already had stay in r's table as r's own (duplicates, freed at the end).
void Planner::cache_computed_blocks(Request& r) {
  // Only positions whose tokens are known can be keys (report() guarantees all computed are).
  const int64_t full = std::min(r.num_computed, r.seq_len()) / block_size_ * block_size_;
  if (full <= r.tree_len) return;
  scratch_tokens_.resize(static_cast<size_t>(full - r.tree_len));
  for (int64_t pos = r.tree_len; pos < full; ++pos) {
    scratch_tokens_[static_cast<size_t>(pos - r.tree_len)] = r.token_at(pos);
  }
  const size_t first = static_cast<size_t>(r.tree_len / block_size_);
  const InsertResult result =
      cache_.insert_from(r.node, scratch_tokens_.data(), scratch_tokens_.size(),
                         r.table.data() + first, r.table.size() - first);
  cache_.move_lock(r.node, result.node);
  r.node = result.node;
  r.tree_len = full;
}

// ---------------------------------------------------------------------------------------------
// Planning

std::optional<Step> Planner::plan() {
  Step step;
  step.step_id = next_step_id_;
  InflightStep record{next_step_id_, {}, {}, {}, {}};
  const size_t expected = running_.size() + 8;
  for (auto* v : {&step.start_pos, &step.num_tokens, &step.block_offsets, &step.block_counts}) {
    v->reserve(expected);
  }
  step.rids.reserve(expected);
  step.is_decode.reserve(expected);
  step.sample.reserve(expected);
  record.entries.reserve(expected);
  retracted_this_plan_ = false;
  fair_head_ = nullptr;

  int64_t prefill_budget = config_.max_prefill_tokens;
  if (policy_ == Policy::kPriority) preempt_for_priority(step);
  if (config_.tenant_fairness) preempt_for_fairness(step);
  plan_decodes(step, record);
  plan_prefill_chunks(step, record, prefill_budget);
  // Memory ran short this step: admitting now (possibly the request just retracted) would only
  // invite the next retraction.
  if (!retracted_this_plan_) admit_waiting(step, record, prefill_budget);

  step.dropped.swap(dropped_);
  dropped_.clear();
  take_disk_ops(step);
  if (step.num_entries() == 0 && step.dropped.empty() && step.retracted.empty() &&
      step.save_blocks.empty() && step.load_blocks.empty() && step.drop_keys.empty() &&
      !step.clear_disk) {
    return {};
  }
  ++next_step_id_;
  inflight_.push_back(std::move(record));
  if (!retracted_this_plan_) {
    reserve_ratio_ = std::max(config_.min_reserve_ratio, reserve_ratio_ - config_.reserve_decay);
  }
  return step;
}

void Planner::take_disk_ops(Step& step) {
  if (config_.disk_budget_blocks == 0) return;
  for (const DiskOp& op : cache_.take_saves()) {
    step.save_blocks.push_back(op.block);
    step.save_keys.push_back(op.key);
    step.save_parents.push_back(op.parent);
    step.save_tokens.insert(step.save_tokens.end(), op.tokens.begin(), op.tokens.end());
  }
  step.drop_keys = cache_.take_drops();
  step.clear_disk = clear_disk_;
  clear_disk_ = false;
}

// Starts filling c's disk continuation: blocks for it, the loads in the step, a lock on the
// prefix matched in RAM. admit_cost counted the blocks.
void Planner::start_load(Request& c, Step& step, InflightStep& record) {
  const std::vector<int32_t>& seq = sequence(c);
  const PrefixMatch match = cache_.match_prefix(seq.data(), seq.size() - 1, false);
  cache_.lock(match.node);
  if (c.load_node >= 0) cache_.unlock(c.load_node);
  c.load_node = match.node;
  const int64_t first = match.num_tokens / block_size_;
  const std::vector<uint64_t> keys =
      cache_.block_keys(seq.data(), static_cast<size_t>((first + match.disk_blocks) * block_size_));
  if (!allocate_blocks(match.disk_blocks, c.loading)) {
    throw InvariantError("a load counted the blocks available but could not allocate " +
                         std::to_string(match.disk_blocks));
  }
  step.load_blocks.insert(step.load_blocks.end(), c.loading.begin(), c.loading.end());
  step.load_keys.insert(step.load_keys.end(), keys.begin() + first, keys.end());
  record.load_blocks.insert(record.load_blocks.end(), c.loading.begin(), c.loading.end());
  record.loads.push_back(&c);
  ++c.inflight_steps;
}

// A request that ends while waiting gives back what a load holds (the worker may still fill
// the blocks: a later step that reuses them runs after it).
void Planner::drop_load(Request& r) {
  allocator_.decref(r.loading.data(), r.loading.size());
  r.loading.clear();
  if (r.load_node >= 0) cache_.unlock(r.load_node);
  r.load_node = -1;
}

// The report of a step with loads: each loading request's blocks join the tree up to the first
// failed one; the disk nodes from there on are forgotten, to be recomputed.
void Planner::finish_loads(InflightStep& s) {
  for (Request* rp : s.loads) {
    Request& r = *rp;
    --r.inflight_steps;
    if (r.state == RequestState::kDone) continue;  // its blocks went back when it ended
    size_t good = 0;
    while (good < r.loading.size() && std::find(s.failed_loads.begin(), s.failed_loads.end(),
                                                r.loading[good]) == s.failed_loads.end()) {
      ++good;
    }
    const std::vector<int32_t>& seq = sequence(r);
    if (good > 0) {
      const int64_t base = cache_.depth(r.load_node);
      const InsertResult result =
          cache_.insert_from(r.load_node, seq.data() + base,
                             good * static_cast<size_t>(block_size_), r.loading.data(), good);
      cache_.move_lock(r.load_node, result.node);
      r.load_node = result.node;
    }
    if (good < r.loading.size()) {
      cache_.forget_disk(r.load_node, seq.data() + cache_.depth(r.load_node));
      disk_failed_blocks_ += static_cast<int64_t>(r.loading.size() - good);
    }
    disk_loaded_blocks_ += static_cast<int64_t>(good);
    allocator_.decref(r.loading.data(), r.loading.size());  // the tree holds the loaded ones
    r.loading.clear();
  }
}

void Planner::add_entry(Step& step, InflightStep& record, Request& r, int64_t num_tokens,
                        bool decode, size_t old_table_len) {
  const int64_t start = r.num_scheduled;
  const bool sample = decode || start + num_tokens == r.prefill_target;
  step.rids.push_back(r.rid);
  step.start_pos.push_back(static_cast<int32_t>(start));
  step.num_tokens.push_back(static_cast<int32_t>(num_tokens));
  step.is_decode.push_back(decode ? 1 : 0);
  step.sample.push_back(sample ? 1 : 0);
  step.block_offsets.push_back(static_cast<int32_t>(old_table_len));
  step.block_counts.push_back(static_cast<int32_t>(r.table.size() - old_table_len));
  step.block_ids.insert(step.block_ids.end(), r.table.begin() + static_cast<int64_t>(old_table_len),
                        r.table.end());
  if (decode) {
    step.num_decode_tokens += 1;
  } else {
    for (int64_t pos = start; pos < start + num_tokens; ++pos)
      step.input_ids.push_back(r.token_at(pos));
    step.num_prefill_tokens += num_tokens;
  }
  record.entries.push_back(InflightEntry{&r, start + num_tokens, sample, 0});
  if (config_.tenant_fairness && start + num_tokens > r.served_to) {  // a recompute is not served
    tenants_[r.tenant].served += start + num_tokens - std::max(start, r.served_to);
    r.served_to = start + num_tokens;
  }
  r.num_scheduled += num_tokens;
  if (sample) ++r.planned_samples;
  ++r.inflight_steps;
}

// A decode entry of k drafts: the last sampled token, then the drafts, each position sampled.
// Behind r's unreported verify entry it is chained (is_decode 3): planned as if that accepts
// every draft, its drafts kept apart until the report of that one.
void Planner::add_verify_entry(Step& step, InflightStep& record, Request& r, size_t old_len) {
  const int64_t k = static_cast<int64_t>(r.draft.size());
  const bool chain = !r.verifying.empty();
  add_entry(step, record, r, 1 + k, /*decode=*/true, old_len);
  InflightEntry& entry = record.entries.back();
  if (r.worker_drafts) {
    step.is_decode.back() = 2;  // the worker's draft model writes the drafts
    entry.worker_drafts = true;
    r.worker_drafts = false;
  } else {
    step.input_ids.insert(step.input_ids.end(), r.draft.begin(), r.draft.end());
  }
  if (chain) {
    step.is_decode.back() = 3;
    entry.chained = true;
    r.chained_step = step.step_id;
    r.chained_entry = record.entries.size() - 1;
    ++spec_chained_entries_;
  }
  step.num_decode_tokens += k;
  entry.drafts = static_cast<int32_t>(k);
  r.planned_samples += k;  // an upper bound until the report says how many were accepted
  (chain ? r.chained_drafts : r.verifying).swap(r.draft);
  r.draft.clear();
}

// Decoding, sampling left, and not waiting for a verify result its next input depends on
// (unless its next entry may be chained behind that verify entry).
bool Planner::decode_eligible(const Request& r) const {
  return r.num_scheduled >= r.prefill_target && r.planned_samples < r.max_new_tokens &&
         (r.verifying.empty() || chain_eligible(r));
}

// Its only unreported entry verifies drafts, nothing is chained behind it yet, and its verify
// before that accepted every draft. A chained entry pays when the verify accepts every draft
// (no round trip waited for); when it does not, the chained entry runs as a plain decode where
// waiting for the result would have drafted again from the right history, which costs more
// than the wait on loads whose verifies often fall short.
bool Planner::chain_eligible(const Request& r) const {
  return config_.speculative_chain && !r.verifying.empty() && !r.chained() &&
         r.inflight_steps == 1 && drafter_->accepted_all_last(r.rid);
}

// The report of r's verify entry came, with r's entry chained behind it: if the verify accepted
// every draft, the chained entry stands (its drafts are the ones verified next); else the worker
// computed it as a plain decode at accepted_end (the position of the token sampled after the
// accepted drafts), so its drafts and the positions past that one are dropped here too.
void Planner::resolve_chain(Request& r, bool verify_accepted_all, int64_t accepted_end) {
  const int64_t step_id = r.chained_step;
  r.chained_step = -1;
  if (verify_accepted_all) {
    r.verifying.swap(r.chained_drafts);
    r.chained_drafts.clear();
    return;
  }
  InflightEntry* chained = nullptr;
  for (InflightStep& s : inflight_) {
    if (s.step_id == step_id && r.chained_entry < s.entries.size()) {
      chained = &s.entries[r.chained_entry];
    }
  }
  if (chained == nullptr || chained->request != &r || !chained->chained) {
    throw InvariantError("request " + std::to_string(r.rid) + "'s chained entry is not in step " +
                         std::to_string(step_id));
  }
  ++spec_chained_fallbacks_;
  if (r.state == RequestState::kRunning) {  // else its admission resets both
    r.planned_samples -= chained->drafts;
    truncate_scheduled(r, accepted_end + 1);
  }
  chained->drafts = 0;
  chained->end = accepted_end + 1;
  r.chained_drafts.clear();
}

// The new block a plain 1-token decode of r needs (0 or 1).
int64_t Planner::plain_decode_blocks(const Request& r) const {
  return r.num_scheduled / block_size_ >= static_cast<int64_t>(r.table.size()) ? 1 : 0;
}

// The drafter's drafts for r's next decode entry, within the step's draft budget and r's
// max_new_tokens. With more than one sample of r still unreported the guess would be too weak.
void Planner::propose_drafts(Request& r, StepDrafts& step) {
  const int64_t limit = std::min(step.budget, r.max_new_tokens - r.planned_samples - 1);
  int64_t k = drafter_->wanted(r.rid, limit);
  // Behind an unreported verify entry (chaining), its drafts are assumed accepted: only the
  // token sampled after them is unknown.
  const bool chain = !r.verifying.empty();
  const int64_t unknown = chain ? 1 : r.planned_samples - static_cast<int64_t>(r.output.size());
  // the worker knows the unreported token: its draft model drafts after it
  if (k <= 0 || (unknown > 1 && !config_.speculative_draft_model)) return;
  const double share = drafter_->acceptance(r.rid);
  k = draft_costs_.length(step.decodes, step.drafts, step.gain, share, k);
  if (k <= 0) {
    drafter_->declined(r.rid);
    return;
  }
  if (config_.speculative_draft_model) {
    r.draft.assign(static_cast<size_t>(k), 0);
    r.worker_drafts = true;
  } else {
    r.draft = drafter_->draft(r.rid, k, unknown, r.verifying);  // empty unless chaining
  }
  const int64_t n = static_cast<int64_t>(r.draft.size());
  step.budget -= n;
  step.drafts += n;
  step.gain += share * static_cast<double>(n);
}

void Planner::set_decode_costs(const std::vector<double>& ms_by_tokens, double verify_overhead_ms) {
  draft_costs_.set(ms_by_tokens, verify_overhead_ms);
}

void Planner::count_verified(Request& r, int64_t drafts, int64_t accepted) {
  ++spec_verify_entries_;
  spec_draft_tokens_ += drafts;
  spec_accepted_tokens_ += accepted;
  ++spec_accepted_histogram_[static_cast<size_t>(accepted)];
  r.spec_drafted += drafts;
  r.spec_accepted += accepted;
  if (drafter_) drafter_->verified(r.rid, drafts, accepted);
}

// One decode token for every running request whose prefill is fully scheduled, plus its drafts
// when they fit. Oldest first, so that when blocks run out the victims (newest first) have no
// entry in this step yet.
void Planner::plan_decodes(Step& step, InflightStep& record) {
  // Blocks the plain decodes not yet planned need: drafts take only what is left beside them,
  // so that they never cause a retraction.
  int64_t plain_blocks_left = 0;
  int64_t decodes = 0;
  for (const Request* r : running_) {
    if (decode_eligible(*r)) {
      plain_blocks_left += plain_decode_blocks(*r);
      ++decodes;
    }
  }
  StepDrafts own;
  own.decodes = decodes;
  own.budget = config_.speculative_token_budget - decodes;
  for (size_t i = 0; i < running_.size();) {
    Request& r = *running_[i];
    if (!decode_eligible(r)) {
      ++i;
      continue;
    }
    plain_blocks_left -= plain_decode_blocks(r);
    const size_t old_len = r.table.size();
    if (drafter_ && r.draft.empty()) propose_drafts(r, own);
    if (!r.draft.empty()) {
      const int64_t k = static_cast<int64_t>(r.draft.size());
      const int64_t extra = blocks_for(r.num_scheduled + 1 + k) - static_cast<int64_t>(old_len);
      // After a retraction memory is short, and the count of blocks left is stale (after a
      // preemption, more important requests wait for memory).
      if (step.retracted.empty() && available_blocks() >= extra + plain_blocks_left) {
        if (!allocate_blocks(extra, r.table)) {
          throw InvariantError("a verify entry sized to the available blocks did not fit");
        }
        add_verify_entry(step, record, r, old_len);
        ++i;
        continue;
      }
      r.draft.clear();  // falls back to a plain decode
      r.worker_drafts = false;
    }
    // Behind an unreported verify (chain_eligible) without drafts: a chained plain decode would
    // only trade the wait for the verify result for a plain decode, so r waits.
    if (!r.verifying.empty()) {
      ++i;
      continue;
    }
    if (r.num_scheduled / block_size_ >= static_cast<int64_t>(old_len)) {
      while (!allocate_blocks(1, r.table)) {
        Request* victim = newest_retractable();
        retract(*victim, step);
        if (victim == &r) break;
      }
      if (r.state != RequestState::kRunning) continue;  // retracted: index i is the next one
    }
    add_entry(step, record, r, 1, /*decode=*/true, old_len);
    ++i;
  }
}

// The next chunk of every request admitted earlier whose prefill is not fully scheduled.
void Planner::plan_prefill_chunks(Step& step, InflightStep& record, int64_t& prefill_budget) {
  for (Request* rp : running_) {
    Request& r = *rp;
    if (r.num_scheduled >= r.prefill_target) continue;
    if (prefill_budget <= 0) break;
    const int64_t want = std::min(
        {r.prefill_target - r.num_scheduled, config_.chunked_prefill_size, prefill_budget});
    // Never wait for blocks that decodes may hold for long: compute what fits now (but a whole
    // span or nothing).
    const int64_t fits =
        (static_cast<int64_t>(r.table.size()) + available_blocks()) * block_size_ - r.num_scheduled;
    const int64_t chunk = whole_span_end(r.whole_spans, r.num_scheduled, r.num_scheduled + want,
                                         r.num_scheduled + fits) -
                          r.num_scheduled;
    if (chunk <= 0) continue;
    const size_t old_len = r.table.size();
    if (!allocate_blocks(blocks_for(r.num_scheduled + chunk) - static_cast<int64_t>(old_len),
                         r.table)) {
      throw InvariantError("a prefill chunk sized to the available blocks did not fit");
    }
    add_entry(step, record, r, chunk, /*decode=*/false, old_len);
    prefill_budget -= chunk;
  }
}

const std::vector<int32_t>& Planner::sequence(const Request& r) {
  if (r.output.empty()) return r.prompt;
  scratch_tokens_.assign(r.prompt.begin(), r.prompt.end());
  scratch_tokens_.insert(scratch_tokens_.end(), r.output.begin(), r.output.end());
  return scratch_tokens_;
}

// lpm: the first kLpmWindow waiting requests, longest cached prefix first (ties in queue order).
std::vector<Request*> Planner::lpm_order() {
  std::vector<std::pair<int64_t, Request*>> keyed;
  keyed.reserve(std::min(waiting_.size(), kLpmWindow));
  for (Request* r : waiting_) {
    if (keyed.size() == kLpmWindow) break;
    const std::vector<int32_t>& seq = sequence(*r);
    keyed.emplace_back(
        r->match_prefix ? cache_.peek_prefix(seq.data(), seq.size() - 1).num_blocks : 0, r);
  }
  std::stable_sort(keyed.begin(), keyed.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<Request*> order;
  order.reserve(keyed.size());
  for (const auto& entry : keyed) order.push_back(entry.second);
  return order;
}

// Admits waiting requests in policy order while every budget holds. Stops at the first request
// that does not fit (head-of-line), which keeps fcfs free of starvation. Stopped for lack of
// blocks that other waiting requests' loaded prefixes lock, it unlocks those and admits once
// more: the request it stopped at may fit now (else plan() could return nothing while the next
// call would admit it, and a caller that plans only after an event would wait for none).
void Planner::admit_waiting(Step& step, InflightStep& record, int64_t& prefill_budget) {
  if (admit_pass(step, record, prefill_budget)) admit_pass(step, record, prefill_budget);
}

// One pass of admit_waiting; whether it unlocked loaded prefixes.
bool Planner::admit_pass(Step& step, InflightStep& record, int64_t& prefill_budget) {
  if (waiting_.empty() || prefill_budget <= 0 ||
      static_cast<int64_t>(running_.size()) >= config_.max_running_requests) {
    return false;
  }
  int64_t reserved = 0;
  for (const Request* r : running_) reserved += future_blocks(*r);
  // Every admission needs at least one new block: skip ordering the queue (lpm walks the tree
  // for each waiting request) when not even that is left.
  if (available_blocks() <= reserved) return release_load_locks(nullptr) > 0;

  memory_stop_ = nullptr;
  if (config_.tenant_fairness) {
    // The room a fairness retraction made goes first to the request it was made for: this
    // plan's decodes may have left another tenant the least served by now.
    Request* c = std::exchange(fair_head_, nullptr);
    if (c == nullptr) c = least_served_waiting();
    while (c != nullptr && try_admit(*c, step, record, prefill_budget, reserved)) {
      c = least_served_waiting();
    }
  } else if (policy_ == Policy::kLpm && config_.enable_radix_cache && waiting_.size() > 1) {
    for (Request* c : lpm_order()) {
      if (!try_admit(*c, step, record, prefill_budget, reserved)) break;
    }
  } else {
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      Request& c = **it++;  // advance first: admission erases c from the queue
      if (!try_admit(c, step, record, prefill_budget, reserved)) break;
    }
  }
  return memory_stop_ != nullptr && release_load_locks(memory_stop_) > 0;
}

// Admission stopped for lack of blocks: the loaded prefixes that other waiting requests lock
// become evictable again, so that they cannot keep the request at the head out forever (they
// are loaded again, or recomputed, when their turn comes).
int64_t Planner::release_load_locks(const Request* keep) {
  int64_t released = 0;
  for (Request* r : waiting_) {
    if (r == keep || r->inflight_steps > 0 || r->load_node < 0) continue;
    cache_.unlock(r->load_node);
    r->load_node = -1;
    ++released;
  }
  return released;
}

// What admitting c now takes, with `reserved` blocks promised to the running requests.
Planner::AdmitCost Planner::admit_cost(const Request& c, int64_t prefill_budget, int64_t reserved) {
  AdmitCost a;
  const std::vector<int32_t>& seq = sequence(c);
  const int64_t target = static_cast<int64_t>(seq.size());
  // Match at most target - 1 tokens: a prefill always computes >= 1 token, so a fully cached
  // prompt recomputes its last block rather than writing into a cached one.
  if (config_.enable_radix_cache && c.match_prefix) {
    a.peek = cache_.peek_prefix(seq.data(), seq.size() - 1);
  }
  a.matched = a.peek.num_blocks * block_size_;
  const int64_t want = std::min({target - a.matched, config_.chunked_prefill_size, prefill_budget});
  // A match may end inside a whole span (its K/V was computed with the span whole): the chunk
  // then runs to the span's end. The block counts below use this adjusted length.
  a.chunk = whole_span_end(c.whole_spans, a.matched, a.matched + want, target) - a.matched;
  a.blocks_now = blocks_for(a.matched + a.chunk) - a.peek.num_blocks;
  const int64_t remaining_samples = c.max_new_tokens - static_cast<int64_t>(c.output.size());
  const int64_t reserve_tokens =
      static_cast<int64_t>(std::ceil(static_cast<double>(remaining_samples) * reserve_ratio_));
  a.blocks_later =
      std::max<int64_t>(0, blocks_for(target + reserve_tokens) - blocks_for(a.matched + a.chunk));
  a.shortfall =
      reserved + a.blocks_now + a.blocks_later - (available_blocks() - a.peek.unlocked_blocks);
  return a;
}

// Tenant fairness: among the first kLpmWindow waiting requests, the first admissible one of the
// tenant with the fewest tokens served; none if none is admissible.
Request* Planner::least_served_waiting() {
  Request* best = nullptr;
  int64_t best_served = 0;
  size_t seen = 0;
  for (Request* r : waiting_) {
    if (seen++ == kLpmWindow) break;
    if (!admissible(*r)) continue;
    const int64_t served = tenants_[r->tenant].served;
    if (!best || served < best_served) {
      best = r;
      best_served = served;
    }
  }
  return best;
}

// Whether admission would consider c now (else it is passed over, not a reason to stop).
bool Planner::admissible(const Request& c) const {
  // retracted while an earlier step still names it, or awaiting its finish
  return c.inflight_steps == 0 && static_cast<int64_t>(c.output.size()) < c.max_new_tokens;
}

// Admits c if the budgets allow. Returns false when admission must stop here.
bool Planner::try_admit(Request& c, Step& step, InflightStep& record, int64_t& prefill_budget,
                        int64_t& reserved) {
  if (prefill_budget <= 0 ||
      static_cast<int64_t>(running_.size()) >= config_.max_running_requests) {
    return false;
  }
  if (!admissible(c)) return true;
  const AdmitCost a = admit_cost(c, prefill_budget, reserved);
  if (a.peek.disk_blocks > 0) {  // load it first (the disk tier implies c.match_prefix)
    if (reserved + a.peek.disk_blocks > available_blocks() - a.peek.unlocked_blocks) {
      memory_stop_ = &c;
      return false;
    }
    start_load(c, step, record);
    return true;
  }
  if (a.shortfall > 0) {
    memory_stop_ = &c;
    return false;
  }
  const std::vector<int32_t>& seq = sequence(c);
  waiting_.erase(c.queue_pos);
  if (config_.enable_radix_cache && c.match_prefix) {
    PrefixMatch match = cache_.match_prefix(seq.data(), seq.size() - 1);
    cache_.lock(match.node);
    if (c.load_node >= 0) {  // the loaded prefix, locked until now
      cache_.unlock(c.load_node);
      c.load_node = -1;
    }
    allocator_.incref(match.blocks.data(), match.blocks.size());
    c.table = std::move(match.blocks);
    c.node = match.node;
    c.tree_len = match.num_tokens;
  } else if (config_.enable_radix_cache) {
    cache_.lock(kRootNode);  // every running request holds one lock; its blocks go below root
  }
  if (!allocate_blocks(a.blocks_now, c.table)) {
    throw InvariantError("admission counted the blocks available but could not allocate " +
                         std::to_string(a.blocks_now));
  }
  c.state = RequestState::kRunning;
  c.prefill_target = static_cast<int64_t>(seq.size());
  c.num_scheduled = a.matched;
  c.num_computed = a.matched;
  c.planned_samples = static_cast<int64_t>(c.output.size());
  if (!c.ever_admitted) c.cached_tokens = a.matched;
  c.ever_admitted = true;
  insert_running(c);
  add_entry(step, record, c, a.chunk, /*decode=*/false, 0);
  prefill_budget -= a.chunk;
  reserved += a.blocks_later;
  return true;
}

Request* Planner::newest_retractable() const {
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
    if ((*it)->planned_samples < (*it)->max_new_tokens) return *it;
  }
  return nullptr;  // unreachable: the request asking for a block is retractable
}

// memory_short: a decode found no block (the reservation was too optimistic, and admitting in
// this plan would invite the next retraction); else a preemption for a more important request.
void Planner::retract(Request& r, Step& step, bool memory_short) {
  release_blocks(r);
  remove_running(r);
  r.state = RequestState::kRetracted;
  enqueue_waiting(r, /*retracted=*/true);
  step.retracted.push_back(r.rid);
  ++retractions_;
  if (memory_short) {
    reserve_ratio_ = config_.init_reserve_ratio;
    retracted_this_plan_ = true;
  }
}

// A new request goes behind every waiting one of its priority or a smaller value; a retracted
// one ahead of every one of its priority or a larger value. With every priority 0 (fcfs, lpm):
// the back and the front.
void Planner::enqueue_waiting(Request& r, bool retracted) {
  if (retracted) {
    auto it = waiting_.begin();
    while (it != waiting_.end() && (*it)->priority < r.priority) ++it;
    r.queue_pos = waiting_.insert(it, &r);
  } else {
    auto it = waiting_.end();
    while (it != waiting_.begin() && (*std::prev(it))->priority > r.priority) --it;
    r.queue_pos = waiting_.insert(it, &r);
  }
}

// Behind every running request of its priority or a smaller value.
void Planner::insert_running(Request& r) {
  auto it = running_.end();
  while (it != running_.begin() && (*std::prev(it))->priority > r.priority) --it;
  running_.insert(it, &r);
}

// Blocks that retracting r would give back: those only r holds, and cached ones only r uses
// (they become evictable). An estimate for choosing victims: admission itself recounts.
int64_t Planner::releasable_blocks(const Request& r) const {
  int64_t n = 0;
  for (BlockId b : r.table) {
    const int32_t refs = allocator_.refcounts()[static_cast<size_t>(b)];
    n += refs == 1 || (config_.enable_radix_cache && refs == 2 && cache_.in_tree(b));
  }
  return n;
}

// How many blocks admitting head now lacks (<= 0: none, but a running slot is missing), or
// nothing when it can be admitted.
std::optional<int64_t> Planner::room_needed(const Request& head) {
  const bool slot_short = static_cast<int64_t>(running_.size()) >= config_.max_running_requests;
  int64_t reserved = 0;
  for (const Request* r : running_) reserved += future_blocks(*r);
  const int64_t shortfall = admit_cost(head, config_.max_prefill_tokens, reserved).shortfall;
  if (shortfall <= 0 && !slot_short) return std::nullopt;
  return shortfall;
}

// Retracts the first of candidates (running, samples left), in order, that make room for
// shortfall blocks and a running slot by the blocks they would give back; none if even all of
// them would not. Returns how many it retracted.
int64_t Planner::retract_to_make_room(const std::vector<Request*>& candidates, int64_t shortfall,
                                      Step& step) {
  size_t n = 0;
  int64_t freed = 0;
  while (n < candidates.size() && (n == 0 || freed < shortfall)) {
    freed += future_blocks(*candidates[n]) + releasable_blocks(*candidates[n]);
    ++n;
  }
  if (n == 0 || freed < shortfall) return 0;
  for (size_t i = 0; i < n; ++i) retract(*candidates[i], step, /*memory_short=*/false);
  return static_cast<int64_t>(n);
}

// The first admissible waiting request, when it cannot be admitted for lack of blocks or of a
// running slot, retracts running requests of strictly lower priority, the last in the running
// order first, as many as make room; none if even all of them would not.
void Planner::preempt_for_priority(Step& step) {
  auto head_it = std::find_if(waiting_.begin(), waiting_.end(),
                              [this](const Request* r) { return admissible(*r); });
  if (head_it == waiting_.end()) return;
  const Request& head = **head_it;
  const std::optional<int64_t> shortfall = room_needed(head);
  if (!shortfall) return;
  std::vector<Request*> candidates;
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
    Request& v = **it;
    if (v.priority <= head.priority) break;  // the running order puts every candidate last
    if (v.planned_samples >= v.max_new_tokens) continue;  // about to finish: not worth it
    candidates.push_back(&v);
  }
  retract_to_make_room(candidates, *shortfall, step);
}

// The admissible request of the least-served tenant, when it cannot be admitted for lack of
// blocks or of a running slot, retracts running requests of tenants served more than its own by
// more than fairness_quantum: the most-served tenant's first, the latest admitted first on equal
// counts, as many as make room; none if even all of them would not. Admission then tries the
// head first.
void Planner::preempt_for_fairness(Step& step) {
  Request* head = least_served_waiting();
  if (!head) return;
  const int64_t least = tenants_[head->tenant].served;
  std::vector<Request*> candidates;  // latest admitted first: the running order is admission's
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
    Request& v = **it;
    if (tenants_[v.tenant].served - least <= config_.fairness_quantum) continue;
    if (v.planned_samples >= v.max_new_tokens) continue;  // about to finish: not worth it
    candidates.push_back(&v);
  }
  if (candidates.empty()) return;
  const std::optional<int64_t> shortfall = room_needed(*head);
  if (!shortfall) return;
  std::stable_sort(candidates.begin(), candidates.end(),
                   [this](const Request* a, const Request* b) {
                     return tenants_[a->tenant].served > tenants_[b->tenant].served;
                   });
  const int64_t retracted = retract_to_make_room(candidates, *shortfall, step);
  fairness_retractions_ += retracted;
  if (retracted > 0) fair_head_ = head;
}

// ---------------------------------------------------------------------------------------------
// Reports

void Planner::report(int64_t step_id, const int64_t* rids, size_t num_rids, const int32_t* tokens,
                     size_t num_tokens) {
  if (inflight_.empty()) {
    throw ProtocolError("report for step " + std::to_string(step_id) +
                        ", but no step is awaiting a report");
  }
  InflightStep& s = inflight_.front();
  if (step_id != s.step_id) {
    throw ProtocolError("report for step " + std::to_string(step_id) +
                        ", but the oldest unreported step is " + std::to_string(s.step_id) +
                        " (steps are reported in the order planned)");
  }
  if (num_rids != num_tokens) {
    throw ValueError("report for step " + std::to_string(step_id) + ": " +
                     std::to_string(num_rids) + " rids but " + std::to_string(num_tokens) +
                     " tokens");
  }
  for (size_t i = 0; i < num_tokens; ++i) {
    if (tokens[i] < 0 || tokens[i] >= config_.vocab_size) {
      throw ValueError("report for step " + std::to_string(step_id) + ": tokens[" +
                       std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                       " is out of range [0, " + std::to_string(config_.vocab_size) + ")");
    }
  }
  // Match each token to its rid's sampling entry: a merge when they come in step order (the
  // worker's order), a lookup otherwise. A verify entry of k drafts takes 1..k+1 tokens.
  const size_t num_entries = s.entries.size();
  scratch_targets_.assign(num_rids, 0);
  scratch_counts_.assign(num_entries, 0);
  size_t e = 0;
  bool in_order = true;
  for (size_t i = 0; i < num_rids && in_order; ++i) {
    if (i > 0 && rids[i] == rids[i - 1]) {
      const size_t prev = scratch_targets_[i - 1];
      if (scratch_counts_[prev] > s.entries[prev].drafts) {
        in_order = false;  // the lookup below names the error
      } else {
        scratch_targets_[i] = prev;
        ++scratch_counts_[prev];
      }
      continue;
    }
    while (e < num_entries && !(s.entries[e].sample && s.entries[e].request->rid == rids[i])) {
      ++e;
    }
    if (e == num_entries) {
      in_order = false;
    } else {
      scratch_targets_[i] = e;
      scratch_counts_[e] = 1;
      ++e;
    }
  }
  if (!in_order) {
    std::unordered_map<int64_t, size_t> sampling;
    for (size_t j = 0; j < num_entries; ++j) {
      if (s.entries[j].sample) sampling.emplace(s.entries[j].request->rid, j);
    }
    std::fill(scratch_counts_.begin(), scratch_counts_.end(), 0);
    for (size_t i = 0; i < num_rids; ++i) {
      auto it = sampling.find(rids[i]);
      if (it == sampling.end() || scratch_counts_[it->second] > s.entries[it->second].drafts) {
        throw ProtocolError("report for step " + std::to_string(step_id) + " names request " +
                            std::to_string(rids[i]) +
                            ", which did not sample in that step (or is named more often than "
                            "it sampled)");
      }
      scratch_targets_[i] = it->second;
      ++scratch_counts_[it->second];
    }
  }

  // A request that has not ended must get its sample: the worker drops only ended requests, and
  // a missing token would leave positions whose token the core does not know.
  bool any_verify = false;
  for (size_t j = 0; j < num_entries; ++j) {
    const InflightEntry& entry = s.entries[j];
    const Request& r = *entry.request;
    any_verify = any_verify || entry.drafts > 0;
    if (entry.sample && r.state != RequestState::kDone && scratch_counts_[j] == 0) {
      throw ProtocolError("report for step " + std::to_string(step_id) +
                          " leaves out the sample of request " + std::to_string(r.rid) +
                          ", which is " + state_name(r.state) +
                          " (only finished or aborted requests may be left out)");
    }
  }
  // A verify entry's tokens before its last are accepted drafts: K/V computed for any other
  // token must not count as computed (it could reach the cache).
  if (any_verify) {
    std::vector<int32_t> seen(num_entries, 0);
    for (size_t i = 0; i < num_rids; ++i) {
      const size_t j = scratch_targets_[i];
      const Request& r = *s.entries[j].request;
      const int32_t m = seen[j]++;
      if (s.entries[j].drafts == 0 || s.entries[j].worker_drafts ||
          r.state == RequestState::kDone || m + 1 == scratch_counts_[j]) {
        continue;
      }
      if (tokens[i] != r.verifying[static_cast<size_t>(m)]) {
        throw ProtocolError("report for step " + std::to_string(step_id) + ": request " +
                            std::to_string(r.rid) + "'s token " + std::to_string(m) + " is " +
                            std::to_string(tokens[i]) + ", not its draft " +
                            std::to_string(r.verifying[static_cast<size_t>(m)]) +
                            ", yet more tokens follow it");
      }
    }
  }

  for (size_t j = 0; j < num_entries; ++j) {
    const InflightEntry& entry = s.entries[j];
    Request& r = *entry.request;
    --r.inflight_steps;
    // The K/V past the accepted drafts and the first position after them is of rejected drafts.
    const int64_t accepted_end = entry.end - entry.drafts - 1 + scratch_counts_[j];
    if (entry.drafts > 0) {
      r.verifying.clear();
      if (scratch_counts_[j] > 0) count_verified(r, entry.drafts, scratch_counts_[j] - 1);
      // The worker decided the chained entry's fate by the same count (a finished request's
      // tokens are discarded either way).
      if (r.chained()) resolve_chain(r, scratch_counts_[j] == entry.drafts + 1, accepted_end);
    }
    if (r.state != RequestState::kRunning) continue;
    if (entry.drafts == 0) {
      r.num_computed = std::max(r.num_computed, entry.end);
      continue;
    }
    r.num_computed = std::max(r.num_computed, accepted_end);
    r.planned_samples -= entry.drafts + 1 - scratch_counts_[j];
    // No later entry names r (it waited for this report), so its scheduled positions end here;
    // a chained entry behind it was dealt with above.
    if (r.inflight_steps == 0) truncate_scheduled(r, accepted_end);
  }
  for (size_t i = 0; i < num_rids; ++i) {
    Request& r = *s.entries[scratch_targets_[i]].request;
    if (r.state == RequestState::kDone) continue;
    r.output.push_back(tokens[i]);
    if (drafter_) drafter_->append(r.rid, tokens[i]);
  }
  for (const InflightEntry& entry : s.entries) {
    Request& r = *entry.request;
    if (r.state == RequestState::kRunning && config_.enable_radix_cache && r.match_prefix) {
      cache_computed_blocks(r);
    }
  }
  if (!s.loads.empty()) finish_loads(s);
  for (const InflightEntry& entry : s.entries) {
    Request& r = *entry.request;
    if (r.state == RequestState::kDone && r.inflight_steps == 0) requests_.erase(r.rid);
  }
  for (Request* r : s.loads) {
    if (r->state == RequestState::kDone && r->inflight_steps == 0) requests_.erase(r->rid);
  }
  inflight_.pop_front();
}

// ---------------------------------------------------------------------------------------------
// Introspection

PlannerStats Planner::stats() const {
  PlannerStats s;
  s.num_waiting = num_waiting();
  s.num_running = num_running();
  s.num_free_blocks = num_free_blocks();
  s.num_inflight_steps = num_inflight_steps();
  s.num_requests = static_cast<int64_t>(requests_.size());
  s.retractions = retractions_;
  s.fairness_retractions = fairness_retractions_;
  s.steps_planned = next_step_id_;
  for (const auto& [id, t] : tenants_) s.tenant_tokens.emplace_back(id, t.served);
  std::sort(s.tenant_tokens.begin(), s.tenant_tokens.end());
  s.reserve_ratio = reserve_ratio_;
  s.spec_verify_entries = spec_verify_entries_;
  s.spec_chained_entries = spec_chained_entries_;
  s.spec_chained_fallbacks = spec_chained_fallbacks_;
  s.spec_draft_tokens = spec_draft_tokens_;
  s.spec_accepted_tokens = spec_accepted_tokens_;
  s.spec_accepted_histogram = spec_accepted_histogram_;
  s.ngram_corpus_tokens = drafter_ && drafter_->corpus() ? drafter_->corpus()->num_tokens() : 0;
  s.disk_loaded_blocks = disk_loaded_blocks_;
  s.disk_failed_blocks = disk_failed_blocks_;
  for (const Request* r : waiting_) s.num_loading += !r->loading.empty();
  s.cache = cache_.stats();
  return s;
}

RequestInfo Planner::request(int64_t rid) const {
  const Request* r = find(rid);
  if (!r) throw KeyError("request " + std::to_string(rid) + " is unknown");
  RequestInfo info;
  info.state = state_name(r->state);
  info.prompt_len = static_cast<int64_t>(r->prompt.size());
  info.output_len = static_cast<int64_t>(r->output.size());
  info.num_computed = r->num_computed;
  info.num_scheduled = r->num_scheduled;
  info.cached_tokens = r->cached_tokens;
  info.max_new_tokens = r->max_new_tokens;
  info.priority = r->priority;
  info.tenant = r->tenant;
  info.planned_samples = r->planned_samples;
  info.num_blocks = static_cast<int64_t>(r->table.size());
  info.inflight_steps = r->inflight_steps;
  info.draft_len = static_cast<int64_t>(r->draft.size());
  info.verifying = static_cast<int64_t>(r->verifying.size());
  info.spec_drafted = r->spec_drafted;
  info.spec_accepted = r->spec_accepted;
  info.output = r->output;
  return info;
}

std::vector<uint8_t> Planner::block_states() const {
  std::vector<uint8_t> states(static_cast<size_t>(allocator_.num_blocks()), 0);
  for (size_t b = 0; b < states.size(); ++b) {
    const BlockId id = static_cast<BlockId>(b);
    if (cache_.in_tree(id)) {
      states[b] = 2;
    } else if (allocator_.refcounts()[b] > 0) {
      states[b] = 1;
    }
  }
  return states;
}

}  // namespace pyserve
