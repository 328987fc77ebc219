// Tenant fairness, as a specification: admission and decode slots by the tokens served per
// tenant.
#include <string>

#include "check.h"
#include "errors.h"
#include "planner.h"
#include "planner_driver.h"

using namespace driver;
using pyserve::ValueError;

namespace {

PlannerConfig fair_config() {
  PlannerConfig c;
  c.num_blocks = 64;
  c.block_size = 2;
  c.vocab_size = 1000;
  c.max_running_requests = 1;
  c.tenant_fairness = true;
  c.enable_radix_cache = false;  // every prompt token is computed, so counted
  return c;
}

// Plans, reports and finishes one request at a time; returns the order they ran in.
std::vector<int64_t> run_one_at_a_time(Planner& p, int n) {
  std::vector<int64_t> order;
  for (int i = 0; i < n; ++i) {
    const Step s = plan(p);
    CHECK_EQ(s.num_entries(), size_t{1});
    order.push_back(s.rids[0]);
    report(p, s);
    p.finish(s.rids[0]);
  }
  return order;
}

}  // namespace

TEST(tenants_need_fairness_and_fairness_needs_fcfs) {
  PlannerConfig c = fair_config();
  c.tenant_fairness = false;
  Planner plain(c);
  CHECK_THROWS(plain.add_request(1, {1, 2}, 1, true, {}, 0, 3), ValueError);
  Planner fair(fair_config());
  CHECK_THROWS(fair.add_request(1, {1, 2}, 1, true, {}, 0, -1), ValueError);
  c = fair_config();
  c.policy = "lpm";
  CHECK_THROWS(Planner{c}, ValueError);
}

TEST(a_single_request_of_another_tenant_runs_after_at_most_one_of_a_backlog) {
  Planner p(fair_config());
  for (int64_t rid = 1; rid <= 6; ++rid) p.add_request(rid, {1, 2, 3}, 1, true, {}, 0, 1);
  report(p, plan(p));  // tenant 1's first request runs and is served 3 tokens
  p.finish(1);
  p.add_request(100, {4, 5, 6}, 1, true, {}, 0, 2);  // arrives behind five of tenant 1's
  p.check_invariants();
  const std::vector<int64_t> order = run_one_at_a_time(p, 6);
  // Tenant 2 starts at tenant 1's count (3): a tie, which queue order breaks; then tenant 1
  // has been served more.
  CHECK_EQ(order[0], 2);
  CHECK_EQ(order[1], 100);
  const auto tokens = p.stats().tenant_tokens;
  CHECK_EQ(tokens.size(), size_t{2});
  CHECK_EQ(tokens[0].second, 18);  // tenant 1: six prompts of 3
  CHECK_EQ(tokens[1].second, 6);   // lifted to 3 on arrival, then its own 3
}

TEST(an_idle_tenant_banks_no_credit) {
  Planner p(fair_config());
  for (int64_t rid = 1; rid <= 3; ++rid) p.add_request(rid, {1, 2, 3}, 1, true, {}, 0, 1);
  run_one_at_a_time(p, 3);  // tenant 1 served 9 tokens; tenant 2 was never seen
  // Tenant 1 keeps a backlog; tenant 2 arrives: it starts at tenant 1's count, so the two
  // alternate instead of tenant 2 running three requests in a row.
  for (int64_t rid = 4; rid <= 6; ++rid) p.add_request(rid, {1, 2, 3}, 1, true, {}, 0, 1);
  for (int64_t rid = 7; rid <= 9; ++rid) p.add_request(rid, {4, 5, 6}, 1, true, {}, 0, 2);
  p.check_invariants();
  CHECK_EQ(run_one_at_a_time(p, 6), (std::vector<int64_t>{4, 7, 5, 8, 6, 9}));
}

namespace {

int64_t served(const Planner& p, int32_t tenant) {
  for (const auto& [id, tokens] : p.stats().tenant_tokens) {
    if (id == tenant) return tokens;
  }
  return -1;
}

}  // namespace

TEST(fairness_quantum_must_not_be_negative) {
  PlannerConfig c = fair_config();
  c.fairness_quantum = -1;
  CHECK_THROWS(Planner{c}, ValueError);
}

TEST(a_tenant_served_more_than_the_quantum_gives_its_running_slot_to_a_waiting_tenant) {
  PlannerConfig c = fair_config();
  c.fairness_quantum = 4;
  Planner p(c);
  p.add_request(1, {1, 2, 3}, 30, true, {}, 0, 1);
  report(p, plan(p));                               // tenant 1: 3 prompt positions
  p.add_request(2, {4, 5, 6}, 30, true, {}, 0, 2);  // starts at tenant 1's count, 3
  // Request 1 keeps the only slot while tenant 1 is ahead by at most the quantum: decodes
  // bring it from 3 to 8.
  for (int i = 0; i < 5; ++i) {
    const Step s = plan(p);
    CHECK_EQ(rids(s), (std::vector<int64_t>{1}));
    CHECK(s.retracted.empty());
    report(p, s);
  }
  CHECK_EQ(served(p, 1), 8);
  // 8 - 3 > 4: request 1 is retracted and request 2 admitted in the same step.
  Step s = plan(p);
  CHECK_EQ(s.retracted, (std::vector<int64_t>{1}));
  CHECK_EQ(rids(s), (std::vector<int64_t>{2}));
  CHECK_EQ(std::string(p.request(1).state), "retracted");
  CHECK_EQ(p.stats().retractions, 1);
  CHECK_EQ(p.stats().fairness_retractions, 1);
  report(p, s);
  // The hysteresis: request 2 keeps the slot until tenant 2 (6 now) is ahead of tenant 1 (8)
  // by more than the quantum, seven decodes later.
  int decodes = 0;
  for (s = plan(p); s.retracted.empty(); s = plan(p)) {
    CHECK_EQ(rids(s), (std::vector<int64_t>{2}));
    report(p, s);
    ++decodes;
  }
  CHECK_EQ(decodes, 7);
  CHECK_EQ(s.retracted, (std::vector<int64_t>{2}));
  // Request 1 recomputes prompt + its 6 tokens; only position 8, never planned before, is new.
  const Entry e = *entry_for(s, 1);
  CHECK_EQ(e.start, 0);
  CHECK_EQ(e.num_tokens, 9);
  CHECK_EQ(served(p, 1), 9);
  CHECK_EQ(p.stats().fairness_retractions, 2);
  report(p, s);
}

TEST(within_the_quantum_a_running_request_keeps_its_slot_until_it_ends) {
  Planner p(fair_config());  // the default quantum, 4096
  p.add_request(1, {1, 2, 3}, 6, true, {}, 0, 1);
  report(p, plan(p));
  p.add_request(2, {4, 5, 6}, 6, true, {}, 0, 2);
  for (int i = 0; i < 5; ++i) {
    const Step s = plan(p);
    CHECK_EQ(rids(s), (std::vector<int64_t>{1}));
    report(p, s);
  }
  p.finish(1);
  CHECK_EQ(rids(plan(p)), (std::vector<int64_t>{2}));
  CHECK_EQ(p.stats().retractions, 0);
}

TEST(a_request_named_by_an_unreported_step_can_be_retracted_for_fairness) {
  PlannerConfig c = fair_config();
  c.fairness_quantum = 0;
  Planner p(c);
  p.add_request(1, {1, 2, 3}, 10, true, {}, 0, 1);
  report(p, plan(p));
  p.add_request(2, {4, 5, 6}, 10, true, {}, 0, 2);  // a tie at 3: no preemption
  const Step s1 = plan(p);                          // request 1's decode: tenant 1 at 4
  CHECK_EQ(rids(s1), (std::vector<int64_t>{1}));
  const Step s2 = plan(p);  // before s1's report: 4 > 3
  CHECK_EQ(s2.retracted, (std::vector<int64_t>{1}));
  CHECK_EQ(rids(s2), (std::vector<int64_t>{2}));
  report(p, s1, 11);  // the token of a retracted request is kept: it is recomputed
  report(p, s2, 21);
  CHECK_EQ(p.request(1).output, (Tokens{7, 11}));
  // Tenant 2 is at 6 now: request 1 takes the slot back, recomputing its 5 positions, of
  // which only position 4 is new service.
  const Step s3 = plan(p);
  CHECK_EQ(s3.retracted, (std::vector<int64_t>{2}));
  const Entry e = *entry_for(s3, 1);
  CHECK_EQ(e.input, (Tokens{1, 2, 3, 7, 11}));
  CHECK_EQ(served(p, 1), 5);
  CHECK_EQ(served(p, 2), 6);
  report(p, s3);
}

TEST(a_preemption_that_cannot_make_room_retracts_nothing) {
  PlannerConfig c = fair_config();
  c.num_blocks = 6;
  c.max_running_requests = 4;
  c.fairness_quantum = 0;
  c.init_reserve_ratio = 0.0;
  c.min_reserve_ratio = 0.0;
  Planner p(c);
  p.add_request(1, {1, 2, 3}, 8, true, {}, 0, 1);  // 2 blocks
  p.add_request(2, {4}, 1, true, {}, 0, 2);        // 1 block, sampled out: not retractable
  report(p, plan(p));
  report(p, plan(p));  // request 1's decode at position 3: tenant 1 at 4, tenant 2 at 1
  CHECK_EQ(p.num_free_blocks(), 3);
  // 11 tokens need 6 blocks: 3 are free and request 1 would give back 2.
  p.add_request(3, range(10, 11), 1, true, {}, 0, 2);
  Step s = plan(p);
  CHECK(s.retracted.empty());
  CHECK(!entry_for(s, 3).has_value());
  report(p, s);  // request 1 decodes into a third block
  p.abort(3);
  // 8 tokens need 4 blocks: 2 are free and request 1 gives back 3.
  p.add_request(4, range(10, 8), 1, true, {}, 0, 2);
  s = plan(p);
  CHECK_EQ(s.retracted, (std::vector<int64_t>{1}));
  CHECK(entry_for(s, 4).has_value());
  CHECK_EQ(std::string(p.request(2).state), "running");
}

TEST(the_room_a_fairness_retraction_makes_goes_to_the_request_it_was_made_for) {
  PlannerConfig c = fair_config();
  c.max_running_requests = 2;
  c.fairness_quantum = 0;
  Planner p(c);
  p.add_request(1, range(10, 10), 30, true, {}, 0, 1);
  p.add_request(2, {4}, 30, true, {}, 0, 2);
  report(p, plan(p));  // tenant 1 at 10, tenant 2 at 1
  p.add_request(3, {5}, 5, true, {}, 0, 2);
  p.add_request(4, {6}, 5, true, {}, 0, 3);  // lifted to the least live count: 1
  CHECK_EQ(served(p, 3), 1);
  // Request 3 heads the tie at 1 and retracts request 1 for the slot. Request 2's decode then
  // lifts tenant 2 to 2, above tenant 3: the slot still goes to request 3.
  const Step s = plan(p);
  CHECK_EQ(s.retracted, (std::vector<int64_t>{1}));
  CHECK(entry_for(s, 3).has_value());
  CHECK(!entry_for(s, 4).has_value());
  CHECK_EQ(served(p, 2), 3);
  report(p, s);
}

int main() { return check::run_all_tests(); }
