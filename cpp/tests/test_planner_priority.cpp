// The priority policy, as a specification: admission by (priority, arrival), preemption of
// less important running requests, retraction of the least important.
#include <string>

#include "check.h"
#include "errors.h"
#include "planner.h"
#include "planner_driver.h"

using namespace driver;
using pyserve::ValueError;

namespace {

PlannerConfig priority_config(int64_t num_blocks, int64_t block_size) {
  PlannerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.vocab_size = 1000;
  c.policy = "priority";
  c.init_reserve_ratio = 0.0;
  c.min_reserve_ratio = 0.0;
  return c;
}

void add_with(Planner& p, int64_t rid, const Tokens& prompt, int64_t max_new, int64_t priority) {
  p.add_request(rid, prompt, max_new, true, {}, priority);
  p.check_invariants();
}

}  // namespace

TEST(a_priority_needs_the_priority_policy) {
  PlannerConfig c = priority_config(8, 2);
  c.policy = "fcfs";
  Planner p(c);
  CHECK_THROWS(p.add_request(1, {1, 2}, 2, true, {}, 1), ValueError);
  p.add_request(1, {1, 2}, 2, true, {}, 0);
  p.check_invariants();
}

TEST(the_smallest_priority_value_is_admitted_first_and_equals_keep_arrival_order) {
  PlannerConfig c = priority_config(64, 2);
  c.max_running_requests = 1;
  Planner p(c);
  add_with(p, 1, {1, 2}, 1, 5);
  add_with(p, 2, {3, 4}, 1, 0);
  add_with(p, 3, {5, 6}, 1, -2);
  add_with(p, 4, {7, 8}, 1, 0);
  std::vector<int64_t> order;
  for (int i = 0; i < 4; ++i) {
    const Step s = plan(p);
    CHECK_EQ(s.num_entries(), size_t{1});
    order.push_back(s.rids[0]);
    report(p, s);
    p.finish(s.rids[0]);
  }
  CHECK_EQ(order, (std::vector<int64_t>{3, 2, 4, 1}));
}

TEST(a_waiting_request_preempts_less_important_running_ones_which_resume_later) {
  // 4 blocks of 2 tokens: two running requests of priority 1 hold them all.
  Planner p(priority_config(4, 2));
  Worker w;
  add_with(p, 1, {1, 2, 3}, 2, 1);
  add_with(p, 2, {4, 5, 6}, 2, 1);
  Step s = plan(p);
  w.run(s, 2);
  CHECK_EQ(rids(s), (std::vector<int64_t>{1, 2}));
  report(p, s, [](int64_t rid) { return static_cast<int32_t>(10 * rid); });

  // A more important request arrives: the newest of the priority-1 requests gives way, and
  // the newcomer is admitted in the same step.
  add_with(p, 3, {7, 8, 9}, 2, 0);
  s = plan(p);
  w.run(s, 2);
  CHECK_EQ(s.retracted, (std::vector<int64_t>{2}));
  CHECK(entry_for(s, 3).has_value());
  CHECK(!entry_for(s, 2).has_value());
  CHECK_EQ(std::string(p.request(2).state), "retracted");
  CHECK_EQ(p.stats().retractions, 1);
  report(p, s, [](int64_t rid) { return static_cast<int32_t>(10 * rid + 1); });

  // An equally important request never preempts: request 4 (priority 1) waits.
  add_with(p, 4, {1, 1, 1}, 1, 1);
  s = plan(p);
  CHECK(s.retracted.empty());
  CHECK(!entry_for(s, 4).has_value());
  report(p, s, [](int64_t rid) { return static_cast<int32_t>(10 * rid + 2); });
  p.finish(3);
  p.finish(1);

  // Request 2 resumes ahead of request 4, which arrived later at its priority; its output so
  // far is recomputed.
  s = plan(p);
  const Entry e = *entry_for(s, 2);
  CHECK_EQ(e.start, 0);
  CHECK_EQ(e.input, (Tokens{4, 5, 6, 20}));
  CHECK_EQ(p.request(2).output, (Tokens{20}));
}

TEST(a_request_that_cannot_fit_even_after_preempting_everything_below_it_preempts_nothing) {
  Planner p(priority_config(4, 2));
  add_with(p, 1, {1, 2}, 2, 0);  // as important as the newcomer: never preempted
  add_with(p, 2, {3, 4}, 2, 3);
  report(p, plan(p));
  // 7 tokens need 4 blocks: 2 are free, request 2 would give back 1, and request 1 is as
  // important as the newcomer.
  add_with(p, 3, {5, 6, 7, 8, 9, 10, 11}, 1, 0);
  const Step s = plan(p);
  CHECK(s.retracted.empty());
  CHECK_EQ(std::string(p.request(2).state), "running");
}

TEST(a_decode_short_of_blocks_retracts_the_least_important_request_not_the_newest) {
  Planner p(priority_config(4, 2));
  add_with(p, 1, {1, 2}, 4, 2);  // least important, admitted first
  add_with(p, 2, {3, 4}, 4, 0);
  Step s = plan(p);
  CHECK_EQ(rids(s), (std::vector<int64_t>{2, 1}));  // admitted in queue order
  report(p, s);
  for (int i = 0; i < 2; ++i) report(p, plan(p));
  s = plan(p);  // position 4 of each needs a third block: none is free
  CHECK_EQ(s.retracted, (std::vector<int64_t>{1}));
  CHECK_EQ(std::string(p.request(2).state), "running");
}

int main() { return check::run_all_tests(); }
