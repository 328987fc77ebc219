// Tenant fairness, as a specification: admission by the tokens served per tenant.
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

int main() { return check::run_all_tests(); }
