// Planner retraction, aborts, overlap (steps in flight) and errors, as a specification.
#include <cmath>
#include <string>

#include "check.h"
#include "errors.h"
#include "planner.h"
#include "planner_driver.h"

using namespace driver;
using pyserve::KeyError;
using pyserve::ProtocolError;
using pyserve::ValueError;

namespace {

PlannerConfig config(int64_t num_blocks, int64_t block_size) {
  PlannerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.vocab_size = 1000;
  return c;
}

// Two requests whose decodes outgrow a 4-block pool (block size 2).
PlannerConfig tight_pool() {
  PlannerConfig c = config(4, 2);
  c.init_reserve_ratio = 0.5;
  c.min_reserve_ratio = 0.0;
  c.reserve_decay = 0.1;
  return c;
}

int32_t token_of(int64_t rid) { return static_cast<int32_t>(10 * rid); }

void report_step(Planner& p, const Step& s, int32_t step_number) {
  report(p, s, [step_number](int64_t rid) { return token_of(rid) + step_number; });
}

bool near(double a, double b) { return std::fabs(a - b) < 1e-9; }

}  // namespace

TEST(a_decode_without_blocks_retracts_the_newest_request_which_later_resumes_its_output) {
  Planner p(tight_pool());
  Worker w;
  add(p, 1, {1, 2}, 4);
  add(p, 2, {3, 4}, 4);
  for (int32_t n = 0; n < 3; ++n) {  // prefill, then decodes at positions 2 and 3
    const Step s = plan(p);
    w.run(s, 2);
    CHECK_EQ(rids(s), (std::vector<int64_t>{1, 2}));
    report_step(p, s, n);
  }
  CHECK_EQ(p.num_free_blocks(), 0);
  CHECK(near(p.stats().reserve_ratio, 0.2));  // decayed 0.1 a step from 0.5

  // Position 4 needs a third block for request 1: request 2, the newest, is retracted; its
  // blocks are cached but unlocked, so eviction frees its leaf (both blocks: leaves go whole).
  Step s = plan(p);
  w.run(s, 2);
  CHECK_EQ(rids(s), (std::vector<int64_t>{1}));
  CHECK_EQ(s.retracted, (std::vector<int64_t>{2}));
  CHECK_EQ(std::string(p.request(2).state), "retracted");
  CHECK_EQ(p.stats().retractions, 1);
  CHECK(near(p.stats().reserve_ratio, 0.5));  // back to init after a retraction
  report_step(p, s, 3);
  p.finish(1);

  // Request 2 is recomputed over prompt + its output.
  s = plan(p);
  w.run(s, 2);
  CHECK_EQ(s.dropped, (std::vector<int64_t>{1}));
  const Entry e = *entry_for(s, 2);
  CHECK_EQ(e.block_offset, 0);
  CHECK_EQ(e.start, 0);
  CHECK_EQ(e.input, (Tokens{3, 4, 20, 21, 22}));
  CHECK(e.sample);
  report_step(p, s, 3);
  CHECK_EQ(p.request(2).output, (Tokens{20, 21, 22, 23}));
  CHECK_EQ(p.request(2).cached_tokens, 0);  // the first admission's hit, not the recompute's
}

TEST(a_retracted_request_waits_until_every_step_naming_it_is_reported) {
  Planner p(tight_pool());
  add(p, 1, {1, 2}, 4);
  add(p, 2, {3, 4}, 4);
  report_step(p, plan(p), 0);
  report_step(p, plan(p), 1);
  const Step s2 = plan(p);  // decodes at position 3, left unreported
  const Step s3 = plan(p);  // request 1 needs position 4's block: request 2 goes
  CHECK_EQ(s3.retracted, (std::vector<int64_t>{2}));
  CHECK_EQ(p.request(2).inflight_steps, 1);
  p.finish(1);
  const Step s4 = plan(p);  // room now, but step 2 still names request 2
  CHECK_EQ(s4.num_entries(), size_t{0});
  CHECK_EQ(s4.dropped, (std::vector<int64_t>{1}));
  report_step(p, s2, 2);  // request 2's token from step 2 still counts
  CHECK_EQ(p.request(2).output, (Tokens{20, 21, 22}));
  report_step(p, s3, 3);
  report(p, s4);
  const Step s5 = plan(p);
  const Entry e = *entry_for(s5, 2);
  CHECK_EQ(e.start, 2);
  CHECK_EQ(e.input, (Tokens{20, 21, 22}));
  report_step(p, s5, 3);
}

TEST(retraction_skips_requests_with_every_sample_planned_and_may_retract_the_asker) {
  PlannerConfig c = config(3, 2);
  c.init_reserve_ratio = 0.0;
  c.min_reserve_ratio = 0.0;
  Planner p(c);
  add(p, 2, {3, 4}, 4);
  add(p, 1, {1, 2}, 1);  // newest, but done sampling after its prefill: never retracted
  for (int32_t n = 0; n < 3; ++n) report_step(p, plan(p), n);
  Step s = plan(p);  // request 2 needs a block at position 4; only it can give way
  CHECK_EQ(s.num_entries(), size_t{0});
  CHECK_EQ(s.retracted, (std::vector<int64_t>{2}));
  CHECK_EQ(std::string(p.request(1).state), "running");
  report(p, s);
  p.finish(1);
  s = plan(p);
  const Entry e = *entry_for(s, 2);
  CHECK_EQ(e.start, 4);  // prompt and its first two outputs are cached blocks
  CHECK_EQ(e.input, (Tokens{22}));
  report_step(p, s, 3);
  CHECK_EQ(p.request(2).output, (Tokens{20, 21, 22, 23}));
}

TEST(abort_works_in_every_state) {
  PlannerConfig c = config(16, 2);
  c.chunked_prefill_size = 2;
  c.max_prefill_tokens = 4;
  Planner p(c);
  add(p, 1, {1, 2, 3, 4, 5, 6}, 4);  // will be mid-prefill
  add(p, 2, {7, 8}, 4);              // will be decoding
  add(p, 3, {9, 9}, 4);              // stays waiting (prefill budget)
  Step s = plan(p);
  CHECK_EQ(rids(s), (std::vector<int64_t>{1, 2}));
  report(p, s);
  CHECK(p.abort(3));  // waiting
  CHECK(p.abort(1));  // prefilling: its first chunk's block stays cached, the rest is freed
  CHECK_EQ(count_state(p, 2), 2);
  s = plan(p);  // request 2 decodes; the aborted ones are dropped
  CHECK_EQ(rids(s), (std::vector<int64_t>{2}));
  CHECK_EQ(s.dropped, (std::vector<int64_t>{3, 1}));
  CHECK(p.abort(2));  // running, with its decode in flight
  CHECK_EQ(count_state(p, 1), 0);
  CHECK_EQ(std::string(p.request(2).state), "done");
  report(p, s, 5);  // its token is ignored
  CHECK_THROWS(p.request(2), KeyError);
  CHECK(!p.abort(2));
  CHECK(!p.abort(12345));
  CHECK_THROWS(p.finish(2), KeyError);
  CHECK_THROWS(p.finish(12345), KeyError);
  p.check_invariants();
  p.flush_cache();
  CHECK_EQ(p.num_free_blocks(), 16);
}

TEST(aborting_a_retracted_request_removes_it_from_the_queue) {
  Planner p(tight_pool());
  add(p, 1, {1, 2}, 4);
  add(p, 2, {3, 4}, 4);
  for (int32_t n = 0; n < 3; ++n) report_step(p, plan(p), n);
  const Step s = plan(p);
  CHECK_EQ(s.retracted, (std::vector<int64_t>{2}));
  CHECK(p.abort(2));
  CHECK_EQ(p.num_waiting(), 0);
  report(p, s);
  p.finish(1);
  CHECK_EQ(plan(p).dropped, (std::vector<int64_t>{2, 1}));
}

TEST(two_steps_in_flight_decode_ahead_of_the_reports) {
  Planner p(config(16, 2));
  Worker w;
  add(p, 1, {1, 2, 3}, 3);
  const Step s0 = plan(p);
  const Step s1 = plan(p);  // the worker holds the token step 0 samples
  w.run(s0, 2);
  w.run(s1, 2);
  CHECK_EQ(p.num_inflight_steps(), 2);
  CHECK(entry_for(s1, 1)->decode);
  CHECK_EQ(entry_for(s1, 1)->start, 3);
  CHECK_EQ(p.request(1).num_computed, 0);
  CHECK_EQ(p.request(1).num_scheduled, 4);
  CHECK_THROWS(report(p, s1), ProtocolError);  // step 0 comes first
  report(p, s0, 10);
  report(p, s1, 11);
  CHECK_EQ(p.request(1).output, (Tokens{10, 11}));
  CHECK_EQ(p.request(1).num_computed, 4);
  const Step s2 = plan(p);
  CHECK(!p.plan().has_value());  // its third and last sample is already planned
  report(p, s2, 12);
  CHECK_EQ(p.request(1).output, (Tokens{10, 11, 12}));
}

TEST(a_request_finished_with_a_step_in_flight_frees_its_blocks_at_once) {
  Planner p(config(16, 2));
  add(p, 1, {1, 2}, 5);
  report(p, plan(p), 2);    // say token 2 is EOS
  const Step s1 = plan(p);  // planned before main saw the EOS
  CHECK_EQ(p.num_free_blocks(), 14);
  p.finish(1);
  CHECK_EQ(p.num_free_blocks(), 15);  // the cached block {1,2} stays; the decode block is free
  CHECK_THROWS(p.add_request(1, {5}, 1), ValueError);  // still named by step 1
  const Step s2 = plan(p);
  CHECK_EQ(s2.num_entries(), size_t{0});
  CHECK_EQ(s2.dropped, (std::vector<int64_t>{1}));
  report(p, s1, 9);  // ignored
  CHECK_THROWS(p.request(1), KeyError);
  report(p, s2);
  add(p, 1, {5}, 1);  // the rid may be used again
}

TEST(report_errors_raise_and_change_nothing) {
  PlannerConfig c = config(16, 2);
  c.chunked_prefill_size = 2;
  Planner p(c);
  const std::vector<int64_t> none;
  const Tokens no_tokens;
  CHECK_THROWS(p.report(0, none.data(), 0, no_tokens.data(), 0), ProtocolError);
  add(p, 1, {1, 2}, 3);
  add(p, 2, {3, 4}, 3);
  add(p, 3, {5, 6, 7}, 3);  // chunked: its first entry does not sample
  const Step s = plan(p);
  auto bad = [&](int64_t step_id, std::vector<int64_t> rids_, Tokens tokens) {
    p.report(step_id, rids_.data(), rids_.size(), tokens.data(), tokens.size());
  };
  CHECK_THROWS(bad(5, {1, 2}, {1, 1}), ProtocolError);   // not the oldest step
  CHECK_THROWS(bad(0, {1, 2}, {1}), ValueError);         // lengths differ
  CHECK_THROWS(bad(0, {1, 2}, {1, 1000}), ValueError);   // token out of range
  CHECK_THROWS(bad(0, {1, 2}, {1, -1}), ValueError);     // token out of range
  CHECK_THROWS(bad(0, {1, 99}, {1, 1}), ProtocolError);  // not in the step
  CHECK_THROWS(bad(0, {1, 1}, {1, 1}), ProtocolError);   // named twice
  CHECK_THROWS(bad(0, {3}, {1}), ProtocolError);         // did not sample
  CHECK_THROWS(bad(0, {1}, {1}), ProtocolError);         // leaves out running request 2
  CHECK_EQ(p.num_inflight_steps(), 1);
  CHECK(p.request(1).output.empty());
  p.check_invariants();
  bad(s.step_id, {2, 1}, {30, 40});  // any order
  CHECK_EQ(p.request(1).output, (Tokens{40}));
  CHECK_EQ(p.request(2).output, (Tokens{30}));
  p.check_invariants();
}

TEST(only_the_samples_of_ended_requests_may_be_left_out_of_a_report) {
  Planner p(config(16, 2));
  add(p, 1, {1, 2, 3}, 8);
  add(p, 2, {4, 5, 6}, 8);
  const Step s0 = plan(p);
  const Step s1 = plan(p);  // decodes, before step 0's tokens are known
  const std::vector<int64_t> none;
  const Tokens no_tokens;
  CHECK_THROWS(p.report(s0.step_id, none.data(), 0, no_tokens.data(), 0), ProtocolError);
  const std::vector<int64_t> one{1};
  const Tokens token{9};
  CHECK_THROWS(p.report(s0.step_id, one.data(), 1, token.data(), 1), ProtocolError);
  CHECK_EQ(p.num_inflight_steps(), 2);
  p.abort(2);  // the worker will drop it, so its sample may be missing now
  p.report(s0.step_id, one.data(), 1, token.data(), 1);
  p.report(s1.step_id, one.data(), 1, token.data(), 1);
  CHECK_EQ(p.request(1).output, (Tokens{9, 9}));
  p.check_invariants();
}

TEST(add_request_rejects_bad_requests) {
  Planner p(config(4, 2));  // holds 8 tokens
  add(p, 1, {1}, 1);
  CHECK_THROWS(p.add_request(1, {2}, 1), ValueError);        // duplicate
  CHECK_THROWS(p.add_request(2, {}, 1), ValueError);         // empty prompt
  CHECK_THROWS(p.add_request(2, {1000}, 1), ValueError);     // out of vocab
  CHECK_THROWS(p.add_request(2, {-3}, 1), ValueError);       // negative token
  CHECK_THROWS(p.add_request(2, {1}, 0), ValueError);        // no new tokens
  CHECK_THROWS(p.add_request(2, {1, 2, 3}, 6), ValueError);  // 9 tokens > 8
  add(p, 2, {1, 2, 3}, 5);                                   // exactly 8 fits
  CHECK_EQ(p.num_waiting(), 2);
}

TEST(constructor_rejects_bad_settings) {
  auto make = [](auto tweak) {
    PlannerConfig c = config(8, 2);
    tweak(c);
    Planner p(c);
  };
  CHECK_THROWS(make([](PlannerConfig& c) { c.num_blocks = 0; }), ValueError);
  CHECK_THROWS(make([](PlannerConfig& c) { c.block_size = 0; }), ValueError);
  CHECK_THROWS(make([](PlannerConfig& c) { c.max_running_requests = 0; }), ValueError);
  CHECK_THROWS(make([](PlannerConfig& c) { c.max_prefill_tokens = -1; }), ValueError);
  CHECK_THROWS(make([](PlannerConfig& c) { c.chunked_prefill_size = 0; }), ValueError);
  CHECK_THROWS(make([](PlannerConfig& c) { c.policy = "random"; }), ValueError);
  CHECK_THROWS(make([](PlannerConfig& c) { c.vocab_size = 0; }), ValueError);
  CHECK_THROWS(make([](PlannerConfig& c) { c.min_reserve_ratio = 0.9; }), ValueError);
  CHECK_THROWS(make([](PlannerConfig& c) { c.init_reserve_ratio = 1.5; }), ValueError);
  CHECK_THROWS(make([](PlannerConfig& c) { c.reserve_decay = -0.1; }), ValueError);
}

TEST(after_every_request_ends_and_the_cache_is_flushed_every_block_is_free) {
  PlannerConfig c = config(12, 2);
  c.chunked_prefill_size = 3;
  Planner p(c);
  for (int64_t rid = 0; rid < 6; ++rid) {
    Tokens prompt = {1, 2, 3, 4};
    prompt.push_back(static_cast<int32_t>(rid));
    add(p, rid, prompt, 3);
  }
  for (int n = 0; n < 200 && (p.num_waiting() + p.num_running() > 0); ++n) {
    const std::optional<Step> s = p.plan();
    p.check_invariants();
    if (!s) break;
    report(p, *s, 1);
    for (int64_t rid = 0; rid < 6; ++rid) {
      try {
        if (p.request(rid).output_len == 3 && std::string(p.request(rid).state) != "done") {
          p.finish(rid);
        }
      } catch (const KeyError&) {
      }
    }
  }
  CHECK_EQ(p.num_waiting() + p.num_running(), 0);
  while (auto s = p.plan()) report(p, *s);
  p.flush_cache();
  CHECK_EQ(p.num_free_blocks(), 12);
  CHECK_EQ(p.stats().num_requests, 0);
  p.check_invariants();
}

int main() { return check::run_all_tests(); }
