// Planner: the scheduler. It owns the block pool and the radix cache, keeps the waiting queue
// and the running set, and turns them into numbered Steps.
//
// Life of a request: add_request -> waiting -> admitted (prefix matched and locked, prefill in
// one or more chunks) -> running (one decode token a step) -> finish/abort. When a decode needs
// a block and none can be freed, the most recently admitted running request is retracted: its
// blocks are freed and it is requeued at the front, to be recomputed (prompt + the output it
// already has) once every step that names it has been reported.
//
// Overlap: plan() may run ahead of report(). Positions planned but not reported are
// "scheduled"; only reported ("computed") whole blocks enter the cache, so no unreported step
// ever writes into a cached block. A request that ends while named by an unreported step frees
// its blocks at once: the worker runs steps in order, so a block reused by a later step is
// written only after the earlier step is done.
//
// Speculative decoding: set_draft(rid, d1..dk) makes that request's next decode entry a verify
// entry of 1 + k positions (its last sampled token, then the drafts), with KV blocks for all of
// them. Drafts never cost another request its place: if the free and evictable blocks cannot
// hold the extra positions beside the plain decodes still to be planned in this step, or a
// retraction already happened in it, the entry falls back to a plain 1-token decode. The report
// gives 1..k+1 tokens for it (the accepted drafts, then one more); the rejected positions are
// released: num_scheduled rolls back to the new computed length and blocks wholly past it are
// freed. Until that report the request gets no entry, unless speculative_chain and its verify
// before accepted every draft: then its next entry is chained right behind the verify entry, as
// if that accepts every draft (is_decode 3, with the drafter's drafts after the assumed ones),
// when it has drafts and their blocks fit as drafts' do. The worker runs steps in order, so it
// knows the verify result when it reaches the chained entry: if the verify accepted fewer, it
// computes the chained entry as a plain 1-token decode at the right position (the position after
// the accepted drafts), and the report of the verify entry makes the same change here: the chained
// entry's drafts are dropped, and positions past that one position are released. Such a request
// does not wait a round trip for its verify result. Only computed whole blocks enter the cache, so
// no cached block ever holds rejected K/V.
//
// Whole spans: add_request may name runs of prompt positions that one forward pass must compute
// together (an image whose positions attend to each other). No prefill chunk ends strictly
// inside one: a chunk that would ends at the span's start; a chunk that starts inside one (after
// a prefix match) or at its start runs to its end, past chunked_prefill_size and the step's
// budget if need be (so a step exceeds the budget by less than one span), but never past what
// the pool holds now: then the request waits.
//
// Priorities (policy "priority"; the other policies refuse a nonzero one): lower runs first.
// The waiting queue is ordered by (priority, arrival), a retracted request going ahead of the
// waiting ones of its priority; the running set by (priority, admission), so decodes plan the
// most important first and a retraction for memory takes the last: the lowest-priority request,
// the latest admitted among equals. Before planning, when the first admissible waiting request
// cannot be admitted for lack of blocks or of a running slot, the running requests of strictly
// lower priority (larger value) are retracted, lowest first, as many as make room by the count
// of blocks they would give back; none if even all of them would not. Guarantee (the property
// tests check it): a request is never admitted for the first time while an admissible request
// of smaller priority value, or of equal value and earlier arrival, or a retracted one of equal
// or smaller value, still waits; a running request is retracted only while every running one
// that stays (and could be retracted) has a priority value at most its own. Between classes this
// is strict priority: a stream of more important requests can delay a less important one
// without bound (a deadline bounds that wait); within a class it is fcfs.
//
// Tenant fairness (tenant_fairness, with the fcfs policy): each tenant has a virtual token
// counter, the positions planned for its requests (prefill and decode) past the furthest each
// had been planned before: a recompute after a retraction is the planner's cost, not service
// (counting it would let two preempted tenants retract each other without progress). Admission
// takes the admissible waiting request of the least-served tenant (queue order among its
// requests and on ties), among the first 256 waiting; it stops, as fcfs does, at the first that
// does not fit. A tenant with no live request that sends one starts at the least-served live
// tenant's count, so idle time banks no credit. Guarantee (the property tests check it): no
// request is admitted while an admissible waiting request of a tenant with a smaller count (at
// that admission) waits in the window; so one tenant's backlog delays another tenant's request
// only while that other tenant has been served more tokens than the backlogged one.
// Decode slots too: before planning, when that request (W) cannot be admitted for lack of
// blocks or of a running slot, the running requests of tenants served more than W's by more
// than fairness_quantum tokens are retracted, the most-served tenant's first (on equal counts
// the latest admitted first), as many as make room by the count of blocks they would give back
// (as for priorities); none if even all of them would not. Guarantee (the property tests check
// it): a request is retracted for fairness only while an admissible request of a tenant served
// less by more than the quantum waits, and only if every running request that stays and could
// be retracted in its place is of a tenant served less (or equally, and admitted earlier). The
// quantum is the hysteresis: once W runs, its tenant must pull ahead of the retracted one by more
// than the quantum before a request of the other can take its slot back, so each such exchange
// costs a recompute (mostly a prefix hit: the retracted blocks stay cached) per quantum of new
// tokens served, and there is no cycle without progress. Bound: the victims are never admitted
// ahead of W while their tenants stay served more, so the room goes to the least-served tenant
// at the first admission after it is made: W's in the same step (the property tests check it
// without the radix cache, whose shared prefixes make the blocks given back an estimate) unless
// the step's prefill chunks, a decode's new block or a memory retraction take room or budget
// first, or its decodes tie another tenant with W's (queue order decides); and running
// requests of another tenant keep W waiting only until that tenant is served the quantum more.
//
// Disk tier (disk_budget_blocks > 0): evicted cache blocks are saved to disk (the steps carry
// the saves). A waiting request whose prefix continues on disk loads it before admission: the
// planner allocates blocks for the disk blocks, puts the loads in the step and locks the prefix
// matched in RAM; the request is passed over until that step's report. The report puts the
// loaded blocks in the tree, up to the first whose load failed (fail_loads); the disk nodes
// from that one on are forgotten (their files dropped) and recomputed. The request keeps its
// lock on the loaded prefix until it is admitted, so eviction cannot undo the load, unless
// admission stops for lack of blocks at another request: then those locks go (they could keep
// it out forever) and a request whose prefix was evicted again loads it again.
//
// Ownership invariant (check_invariants): a block's refcount is 1 if the tree holds it plus one
// for every running request whose table holds it; the tree blocks in a running request's table
// lie on the path to the node it locks; each running request holds exactly one lock.
#pragma once

#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "block_allocator.h"
#include "draft_costs.h"
#include "ngram_drafter.h"
#include "radix_cache.h"
#include "request.h"
#include "step.h"

namespace pyserve {

enum class Policy { kFcfs, kLpm, kPriority };

struct PlannerConfig {
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t max_running_requests = 256;
  int64_t max_prefill_tokens = 8192;
  int64_t chunked_prefill_size = 2048;
  std::string policy = "fcfs";  // or "lpm", "priority"
  bool enable_radix_cache = true;
  int64_t vocab_size = 2147483647;  // token ids must be in [0, vocab_size)
  double init_reserve_ratio = 0.7;
  double min_reserve_ratio = 0.1;
  double reserve_decay = 0.001;
  int64_t max_draft_tokens = 0;  // the most drafts one decode entry verifies; 0: no drafts
  // The planner drafts by itself from n-grams (NgramDrafter) for decoding requests that were
  // given no drafts, while a step's decode entries and drafts stay within
  // speculative_token_budget tokens.
  bool speculative_ngram = false;
  // Decoding requests get verify entries whose drafts the worker's draft model writes
  // (is_decode 2, no ids in input_ids), sized like the planner's own n-gram drafts.
  bool speculative_draft_model = false;
  int64_t ngram_min_match = 2;
  int64_t ngram_max_match = 4;
  int64_t ngram_corpus_tokens = 0;  // tokens of ended sequences to draft from; 0: none
  int64_t speculative_token_budget = 16;
  // With speculative_ngram: a request's next entry is planned behind its unreported verify entry
  // (is_decode 3; see the header comment), so that the worker never waits for a verify result.
  bool speculative_chain = false;
  bool tenant_fairness = false;  // admission by tokens served per tenant (fcfs policy only)
  // With tenant_fairness: how many tokens a running request's tenant may be served beyond a
  // waiting one's before the running request is retracted to make room for it.
  int64_t fairness_quantum = 4096;
  // Blocks the radix cache keeps on disk (RadixCache::set_disk_budget); 0: no disk tier. Steps
  // carry the saves and drops its evictions queue.
  int64_t disk_budget_blocks = 0;
};

struct RequestInfo {
  const char* state = "";
  int64_t prompt_len = 0;
  int64_t output_len = 0;
  int64_t num_computed = 0;
  int64_t num_scheduled = 0;
  int64_t cached_tokens = 0;
  int64_t max_new_tokens = 0;
  int64_t priority = 0;
  int32_t tenant = 0;
  int64_t planned_samples = 0;
  int64_t num_blocks = 0;
  int32_t inflight_steps = 0;
  int64_t draft_len = 0;      // drafts set for the next plan()
  int64_t verifying = 0;      // drafts of an unreported verify entry
  int64_t spec_drafted = 0;   // drafts verified so far
  int64_t spec_accepted = 0;  // of which accepted
  std::vector<int32_t> output;
};

struct PlannerStats {
  int64_t num_waiting = 0;
  int64_t num_running = 0;
  int64_t num_free_blocks = 0;
  int64_t num_inflight_steps = 0;
  int64_t num_requests = 0;  // known: waiting, running, retracted, or done but still in flight
  int64_t retractions = 0;
  int64_t fairness_retractions = 0;  // of which to make room for a less-served tenant
  int64_t steps_planned = 0;
  std::vector<std::pair<int32_t, int64_t>> tenant_tokens;  // (tenant, tokens served), ascending
  double reserve_ratio = 0.0;
  int64_t spec_verify_entries = 0;               // reported verify entries
  int64_t spec_chained_entries = 0;              // planned behind an unreported verify entry
  int64_t spec_chained_fallbacks = 0;            // of which run as a plain decode
  int64_t spec_draft_tokens = 0;                 // drafts they verified
  int64_t spec_accepted_tokens = 0;              // drafts they accepted
  std::vector<int64_t> spec_accepted_histogram;  // [a]: verify entries that accepted a drafts
  int64_t disk_loaded_blocks = 0;                // blocks filled from disk and put in the tree
  int64_t disk_failed_blocks = 0;                // loads that failed (recomputed instead)
  int64_t num_loading = 0;                       // waiting requests with loads in flight
  int64_t ngram_corpus_tokens = 0;               // tokens in the drafter's corpus
  CacheStats cache;
};

class Planner {
 public:
  explicit Planner(const PlannerConfig& config);
  Planner(const Planner&) = delete;
  Planner& operator=(const Planner&) = delete;

  // ValueError: duplicate rid, empty prompt, token out of range, max_new_tokens < 1, or more
  // tokens than the pool can ever hold. match_prefix false: its admissions (first and after a
  // retraction) compute the whole sequence instead of reusing cached blocks, and its blocks
  // never enter the cache (they would duplicate cached ones, and a running request's lock
  // would hold both): they are freed when it ends. whole_spans: [start, end) pairs of prompt
  // positions, ascending, disjoint and non-empty, that no prefill chunk ends strictly inside
  // (ValueError naming the span otherwise, or if the pool cannot hold positions [0, end)).
  // priority: lower runs first; ValueError if nonzero under a policy other than "priority".
  void add_request(int64_t rid, std::vector<int32_t> prompt, int64_t max_new_tokens,
                   bool match_prefix = true, std::vector<int32_t> whole_spans = {},
                   int64_t priority = 0, int32_t tenant = 0);

  // The next Step, or nothing when there is nothing to compute, drop or report as retracted.
  std::optional<Step> plan();

  // Drafts d1..dk for running request rid's next decode entry (empty: none), replacing any set
  // since the last plan(); the next plan() consumes them, verifying them or falling back to a
  // plain decode. The caller drafts from what it knows: the planner cannot check that the drafts
  // follow the request's latest token. KeyError if rid is unknown or ended; ValueError if it is
  // not running with its prefill planned, still verifying earlier drafts, or if a token is out
  // of range, k > max_draft_tokens, or 1 + k samples would pass max_new_tokens.
  void set_draft(int64_t rid, std::vector<int32_t> draft);

  // Step step_id is done (the oldest unreported one: steps are reported in the order planned).
  // rids[i] sampled tokens[i]; rids must be entries of that step that sample. A verify entry of
  // k drafts names its rid 1..k+1 times, its tokens in order: the accepted drafts, then one
  // more; a token that is named before the last must equal its draft. ProtocolError for a wrong
  // step or rid, a rid named too often or a mismatched draft, ValueError for mismatched lengths
  // or a token out of range; nothing changes when it throws.
  void report(int64_t step_id, const int64_t* rids, size_t num_rids, const int32_t* tokens,
              size_t num_tokens);

  // What decode-only steps cost, as the scheduler measured them (DraftCosts::set): from then on
  // the planner's own drafts are only as many as the costs say pay. ValueError for bad values.
  void set_decode_costs(const std::vector<double>& ms_by_tokens, double verify_overhead_ms);

  // The blocks of step step_id's loads that failed (the oldest unreported step; before its
  // report). ProtocolError for another step, ValueError for a block it does not load.
  void fail_loads(int64_t step_id, const std::vector<BlockId>& blocks);
  // Turns every unlocked cached RAM block into a disk block (saved by the next step), as a
  // clean stop does; returns the blocks. 0 without the disk tier.
  int64_t spill_to_disk();
  // Queues drops for block files the tree does not hold (found at start, not indexed).
  void drop_disk_files(const std::vector<uint64_t>& keys) { cache_.queue_drops(keys); }

  void finish(int64_t rid);  // KeyError if unknown or already finished/aborted
  bool abort(int64_t rid);   // false if unknown or already finished/aborted
  // Drops every unlocked cache node and the disk tier (the next step clears its files);
  // returns blocks released.
  int64_t flush_cache();

  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_free_blocks() const { return allocator_.num_free(); }
  int64_t num_inflight_steps() const { return static_cast<int64_t>(inflight_.size()); }
  PlannerStats stats() const;
  RequestInfo request(int64_t rid) const;  // KeyError if unknown

  std::vector<uint8_t> block_states() const;  // 0 free, 1 running requests only, 2 in the tree
  const std::vector<int32_t>& refcounts() const { return allocator_.refcounts(); }
  void check_invariants() const;  // InvariantError naming the first broken invariant

  const PlannerConfig& config() const { return config_; }
  BlockAllocator& allocator() { return allocator_; }
  RadixCache& cache() { return cache_; }

 private:
  struct InflightEntry {
    Request* request;  // stays valid: a request is erased only when no unreported step names it
    int64_t end;       // the entry computes positions up to here
    bool sample;
    int32_t drafts;              // a verify entry's drafts: it samples up to drafts + 1 tokens
    bool worker_drafts = false;  // the worker's draft model wrote them: the core never saw them
    bool chained = false;        // planned behind the request's unreported verify entry
  };
  struct InflightStep {
    int64_t step_id;
    std::vector<InflightEntry> entries;
    std::vector<Request*> loads;        // waiting requests whose loads the step carries
    std::vector<BlockId> load_blocks;   // the blocks those loads fill (Step::load_blocks)
    std::vector<BlockId> failed_loads;  // fail_loads
  };

  Request* find(int64_t rid) const;
  const std::vector<int32_t>& sequence(const Request& r);
  int64_t blocks_for(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }
  int64_t available_blocks() const;
  int64_t future_blocks(const Request& r) const;
  bool allocate_blocks(int64_t n, std::vector<BlockId>& table);
  bool decode_eligible(const Request& r) const;
  bool chain_eligible(const Request& r) const;
  void resolve_chain(Request& r, bool verify_accepted_all, int64_t accepted_end);
  int64_t plain_decode_blocks(const Request& r) const;
  void truncate_scheduled(Request& r, int64_t new_scheduled);

  void plan_decodes(Step& step, InflightStep& record);
  void plan_prefill_chunks(Step& step, InflightStep& record, int64_t& prefill_budget);
  void admit_waiting(Step& step, InflightStep& record, int64_t& prefill_budget);
  bool admit_pass(Step& step, InflightStep& record, int64_t& prefill_budget);
  std::vector<Request*> lpm_order();
  struct AdmitCost {  // what admitting a waiting request now takes
    PrefixPeek peek;
    int64_t matched = 0;       // cached prefix positions it reuses
    int64_t chunk = 0;         // its first prefill chunk
    int64_t blocks_now = 0;    // new blocks for that chunk
    int64_t blocks_later = 0;  // blocks reserved for the rest of its prefill and samples
    int64_t shortfall = 0;     // blocks missing beside `reserved` (<= 0: it fits)
  };
  AdmitCost admit_cost(const Request& c, int64_t prefill_budget, int64_t reserved);
  bool admissible(const Request& c) const;
  bool try_admit(Request& c, Step& step, InflightStep& record, int64_t& prefill_budget,
                 int64_t& reserved);
  void preempt_for_priority(Step& step);
  void preempt_for_fairness(Step& step);
  std::optional<int64_t> room_needed(const Request& head);
  int64_t retract_to_make_room(const std::vector<Request*>& candidates, int64_t shortfall,
                               Step& step);
  Request* least_served_waiting();
  int64_t releasable_blocks(const Request& r) const;
  void enqueue_waiting(Request& r, bool retracted);
  void insert_running(Request& r);
  void add_entry(Step& step, InflightStep& record, Request& r, int64_t num_tokens, bool decode,
                 size_t old_table_len);
  void add_verify_entry(Step& step, InflightStep& record, Request& r, size_t old_table_len);
  struct StepDrafts {     // the planner's own drafts in the step being planned
    int64_t decodes = 0;  // its decode entries
    int64_t budget = 0;   // drafts still allowed by speculative_token_budget
    int64_t drafts = 0;   // drafts given so far
    double gain = 0.0;    // the extra tokens they are expected to yield
  };
  void propose_drafts(Request& r, StepDrafts& step);
  void count_verified(Request& r, int64_t drafts, int64_t accepted);

  Request* newest_retractable() const;
  void retract(Request& r, Step& step, bool memory_short = true);
  void release_blocks(Request& r);
  void remove_running(Request& r);
  void end_request(Request& r);
  void cache_computed_blocks(Request& r);
  void take_disk_ops(Step& step);
  void start_load(Request& c, Step& step, InflightStep& record);
  void finish_loads(InflightStep& s);
  void drop_load(Request& r);
  int64_t release_load_locks(const Request* keep);

  PlannerConfig config_;
  Policy policy_;
  int64_t block_size_;
  BlockAllocator allocator_;
  RadixCache cache_;

  std::unordered_map<int64_t, std::unique_ptr<Request>> requests_;
  // Front is admitted first: by (priority, arrival), retracted requests ahead of their class.
  std::list<Request*> waiting_;
  std::vector<Request*> running_;  // by (priority, admission); the back is retracted first
  std::deque<InflightStep> inflight_;
  std::vector<int64_t> dropped_;  // ended since the last step
  struct Tenant {
    int64_t served = 0;  // tokens planned for its requests (lifted when it returns: see above)
    int64_t live = 0;    // its requests not yet ended
  };
  std::unordered_map<int32_t, Tenant> tenants_;  // with tenant_fairness

  int64_t next_step_id_ = 0;
  int64_t retractions_ = 0;
  int64_t fairness_retractions_ = 0;
  double reserve_ratio_;
  bool retracted_this_plan_ = false;
  std::unique_ptr<NgramDrafter> drafter_;  // with speculative_ngram
  DraftCosts draft_costs_;
  int64_t spec_verify_entries_ = 0;
  int64_t spec_chained_entries_ = 0;
  int64_t spec_chained_fallbacks_ = 0;
  int64_t spec_draft_tokens_ = 0;
  int64_t spec_accepted_tokens_ = 0;
  std::vector<int64_t> spec_accepted_histogram_;
  bool clear_disk_ = false;         // flush_cache since the last step
  Request* memory_stop_ = nullptr;  // where admission stopped for lack of blocks, in a plan
  Request* fair_head_ = nullptr;    // a fairness retraction in this plan made room for it
  int64_t disk_loaded_blocks_ = 0;
  int64_t disk_failed_blocks_ = 0;
  std::vector<int32_t> scratch_tokens_;
  std::vector<size_t> scratch_targets_;  // report: the entry each token belongs to
  std::vector<int32_t> scratch_counts_;  // report: tokens named for each entry
};

}  // namespace pyserve
