// The planner's own n-gram drafts (speculative_ngram): what it drafts from, ahead of an
// unreported token, within the step's budget, and how it backs off.
#include <cmath>
#include <string>
#include <vector>

#include "check.h"
#include "draft_costs.h"
#include "errors.h"
#include "planner.h"
#include "planner_driver.h"

using namespace driver;
using pyserve::ValueError;

namespace {

PlannerConfig config(int64_t corpus_tokens = 0, int64_t budget = 64) {
  PlannerConfig c;
  c.num_blocks = 64;
  c.block_size = 4;
  c.vocab_size = 1000;
  c.max_draft_tokens = 4;
  c.speculative_ngram = true;
  c.ngram_min_match = 2;
  c.ngram_max_match = 3;
  c.ngram_corpus_tokens = corpus_tokens;
  c.speculative_token_budget = budget;
  return c;
}

// Reports a verify entry's first `accepted` drafts, then `next`.
void report_verify(Planner& p, const Step& s, int64_t rid, size_t accepted, int32_t next) {
  const Entry e = *entry_for(s, rid);
  CHECK(accepted <= e.input.size());
  Tokens tokens(e.input.begin(), e.input.begin() + static_cast<int64_t>(accepted));
  tokens.push_back(next);
  std::vector<int64_t> rids(tokens.size(), rid);
  p.report(s.step_id, rids.data(), rids.size(), tokens.data(), tokens.size());
  p.check_invariants();
}

}  // namespace

TEST(a_decoding_request_drafts_what_followed_its_suffix_in_its_prompt) {
  Planner p(config());
  add(p, 1, {10, 11, 12, 13, 14, 10, 11}, 20);
  report(p, plan(p), 12);  // history ends 10 11 12, which the prompt continued with 13 14 10
  const Step s = plan(p);
  const Entry e = *entry_for(s, 1);
  CHECK_EQ(e.num_tokens, 5);
  CHECK_EQ(e.input, (Tokens{13, 14, 10, 11}));
  report_verify(p, s, 1, 4, 12);
  CHECK_EQ(p.request(1).spec_drafted, 4);
  CHECK_EQ(p.request(1).spec_accepted, 4);
  const auto stats = p.stats();
  CHECK_EQ(stats.spec_verify_entries, 1);
  CHECK_EQ(stats.spec_accepted_histogram, (std::vector<int64_t>{0, 0, 0, 0, 1}));
}

TEST(drafts_back_off_while_rejected_and_skip_the_token_being_sampled_when_one_is_in_flight) {
  Planner p(config());
  add(p, 1, {10, 11, 12, 13, 14, 15, 10, 11}, 30);
  report(p, plan(p), 12);
  const Step first = plan(p);  // 10 11 12 is followed by 13 14 15 10 in the prompt
  CHECK_EQ(entry_for(first, 1)->input, (Tokens{13, 14, 15, 10}));
  report_verify(p, first, 1, 0, 13);  // nothing accepted: lookups still draft kFirstLength
  const Step second = plan(p);
  CHECK_EQ(entry_for(second, 1)->input, (Tokens{14, 15, 10, 11}));
  report_verify(p, second, 1, 0, 14);  // the mean gain falls to 0.5: still worth drafting
  const Step third = plan(p);
  CHECK_EQ(entry_for(third, 1)->input, (Tokens{15, 10, 11, 12}));
  report_verify(p, third, 1, 0, 10);  // 0.25: too low, the next two chances go without
  const Step plain1 = plan(p);
  CHECK_EQ(entry_for(plain1, 1)->num_tokens, 1);
  const Step plain2 = plan(p);  // planned before plain1 is reported: overlap
  CHECK_EQ(entry_for(plain2, 1)->num_tokens, 1);
  report(p, plain1, 11);
  // plain2 samples the token after .. 14 10 11; the drafts guess it (12, as in the prompt) and
  // start after it.
  const Step ahead = plan(p);
  CHECK_EQ(entry_for(ahead, 1)->input, (Tokens{13, 14, 10, 11}));
  report(p, plain2, 12);
  report_verify(p, ahead, 1, 4, 12);  // every draft accepted: never a miss
  CHECK_EQ(p.request(1).output, (Tokens{12, 13, 14, 10, 11, 12, 13, 14, 10, 11, 12}));
  // and the next verify drafts as many (max_draft_tokens)
  const Step next = plan(p);
  CHECK_EQ(entry_for(next, 1)->num_tokens, 5);
}

// The entry chained behind an unreported verify entry: what the worker runs it as, and what the
// verify's report makes of it here.
struct Chained {
  Planner p;
  Step verify, chained;
  explicit Chained(PlannerConfig c) : p((c.speculative_chain = true, c)) {
    add(p, 1, {10, 11, 12, 13, 14, 15, 16, 10, 11}, 30);
    report(p, plan(p), 12);  // the history ends 10 11 12, which the prompt continued with 13 ..
    const Step first = plan(p);
    CHECK_EQ(entry_for(first, 1)->input, (Tokens{13, 14, 15, 16}));
    CHECK(!p.plan().has_value());  // no verify before it accepted every draft: it waits
    report_verify(p, first, 1, 4, 10);
    verify = plan(p);  // after 15 16 10: 11 12 13 14, as in the prompt
    CHECK_EQ(entry_for(verify, 1)->input, (Tokens{11, 12, 13, 14}));
    chained = plan(p);  // planned before the verify's report
    p.check_invariants();
  }
};

TEST(a_chained_entry_is_planned_behind_an_unreported_verify_as_if_it_accepts_every_draft) {
  Chained c(config());
  const Entry v = *entry_for(c.verify, 1);
  const Entry e = *entry_for(c.chained, 1);
  CHECK_EQ(c.chained.is_decode[0], 3);
  CHECK_EQ(e.start, v.start + 5);
  // after 12 13 14 (assumed) the history went on 15 16 10, then (looked up again) 11 12: the
  // first stands in for the token the verify samples, the rest are drafts
  CHECK_EQ(e.input, (Tokens{16, 10, 11, 12}));
  CHECK(!c.p.plan().has_value());  // one chained entry at most
  CHECK_EQ(c.p.request(1).num_scheduled, e.start + 5);
  report_verify(c.p, c.verify, 1, 4, 15);  // every draft accepted: the chained entry stands
  CHECK_EQ(c.p.request(1).num_scheduled, e.start + 5);
  CHECK_EQ(c.p.request(1).verifying, 4);
  report_verify(c.p, c.chained, 1, 2, 99);
  CHECK_EQ(c.p.request(1).output, (Tokens{12, 13, 14, 15, 16, 10, 11, 12, 13, 14, 15, 16, 10, 99}));
  CHECK_EQ(c.p.request(1).num_computed, e.start + 3);
}

TEST(a_chained_entry_becomes_a_plain_decode_where_the_verify_accepted_fewer) {
  Chained c(config());
  const Entry v = *entry_for(c.verify, 1);
  report_verify(c.p, c.verify, 1, 1, 99);  // 11 accepted, then 99: the chained entry runs at
  const int64_t bonus = v.start + 2;       // 99's position, as one token
  CHECK_EQ(c.p.request(1).num_scheduled, bonus + 1);
  CHECK_EQ(c.p.request(1).planned_samples, 9);  // 12, 13 .. 10, 11, 99, and the chained one's
  CHECK_EQ(c.p.request(1).verifying, 0);
  CHECK_THROWS(report_verify(c.p, c.chained, 1, 1, 5), pyserve::ProtocolError);  // one token only
  report(c.p, c.chained, 5);
  CHECK_EQ(c.p.request(1).output, (Tokens{12, 13, 14, 15, 16, 10, 11, 99, 5}));
  CHECK_EQ(c.p.request(1).num_computed, bonus + 1);
  const Step next = plan(c.p);  // planned as usual from there
  CHECK_EQ(entry_for(next, 1)->start, bonus + 1);
  c.p.check_invariants();
}

TEST(without_speculative_chain_a_verifying_request_waits_for_its_report) {
  Planner p(config());
  add(p, 1, {10, 11, 12, 13, 14, 15, 16, 10, 11}, 30);
  report(p, plan(p), 12);
  CHECK_EQ(entry_for(plan(p), 1)->num_tokens, 5);
  CHECK(!p.plan().has_value());
  PlannerConfig bad = config();
  bad.speculative_ngram = false;
  bad.speculative_chain = true;
  CHECK_THROWS(Planner{bad}, ValueError);
}

TEST(the_step_budget_bounds_decodes_plus_drafts) {
  Planner p(config(0, 5));  // two decodes leave 3 drafts
  add(p, 1, {10, 11, 12, 13, 14, 10, 11}, 20);
  add(p, 2, {20, 21, 22, 23, 24, 20, 21}, 20);
  const Step prefill = plan(p);
  report(p, prefill, [](int64_t rid) { return rid == 1 ? 12 : 22; });
  const Step s = plan(p);
  CHECK_EQ(entry_for(s, 1)->input, (Tokens{13, 14, 10}));  // the oldest first
  CHECK_EQ(entry_for(s, 2)->num_tokens, 1);
}

TEST(drafts_never_pass_max_new_tokens) {
  Planner p(config());
  add(p, 1, {10, 11, 12, 13, 14, 10, 11}, 3);
  report(p, plan(p), 12);
  const Step s = plan(p);
  CHECK_EQ(entry_for(s, 1)->input, (Tokens{13}));  // 1 sample planned, 1 + 1 more allowed
}

TEST(an_ended_sequence_drafts_for_later_requests_until_the_cache_is_flushed) {
  Planner p(config(1000));
  add(p, 1, {30, 31, 32}, 3);
  const Step s1 = plan(p);
  report(p, s1, 33);
  const Step s2 = plan(p);
  report_verify(p, s2, 1, 0, 34);  // nothing to draft from yet: a plain decode
  report(p, plan(p), 35);
  p.finish(1);
  CHECK_EQ(p.stats().ngram_corpus_tokens, 6);

  add(p, 2, {40, 32, 33}, 10);
  report(p, plan(p), 34);  // history ends 33 34, which request 1 continued with 35
  CHECK_EQ(entry_for(plan(p), 2)->input, (Tokens{35}));

  p.flush_cache();
  CHECK_EQ(p.stats().ngram_corpus_tokens, 0);
}

TEST(draft_costs_interpolate_between_measurements_and_extrapolate_past_them) {
  pyserve::DraftCosts c;
  CHECK(!c.known());
  c.set({0.0, 10.0}, 0.0);  // one point: the prior slope
  CHECK(std::abs(c.cost(3) - 12.0) < 1e-9);
  c.set({0.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 20.0}, 0.0);
  CHECK(std::abs(c.cost(5) - 15.0) < 1e-9);
  CHECK(std::abs(c.cost(17) - 30.0) < 1e-9);
  CHECK_THROWS(c.set({0.0, 1.0}, -1.0), ValueError);
}

TEST(drafts_are_as_many_as_the_measured_costs_say_pay) {
  pyserve::DraftCosts c;
  CHECK_EQ(c.length(1, 0, 0.0, 0.5, 8), 8);  // nothing measured: no say
  pyserve::DraftCosts flat;
  flat.set(std::vector<double>(20, 10.0), 0.0);  // a step costs the same whatever its tokens
  CHECK_EQ(flat.length(1, 0, 0.0, 0.5, 8), 8);
  pyserve::DraftCosts doubled;  // a verify doubles the step's wall time
  doubled.set(std::vector<double>(20, 10.0), 10.0);
  CHECK_EQ(doubled.length(1, 0, 0.0, 0.1, 8), 0);  // expects under one more token
  CHECK_EQ(doubled.length(1, 0, 0.0, 0.9, 8), 8);
  std::vector<double> steep(20);  // compute-bound: each token costs as much as the first
  for (size_t t = 1; t < steep.size(); ++t) steep[t] = 10.0 * static_cast<double>(t);
  pyserve::DraftCosts compute_bound;
  compute_bound.set(steep, 0.0);
  CHECK_EQ(compute_bound.length(8, 0, 0.0, 0.9, 4), 0);
  std::vector<double> rising = {0.0, 10.0, 11.0, 12.0, 13.0, 100.0, 100.0, 100.0, 100.0};
  pyserve::DraftCosts knee;  // cheap up to 4 tokens, then dear: the drafts stop at the knee
  knee.set(rising, 0.0);
  CHECK_EQ(knee.length(1, 0, 0.0, 0.9, 8), 3);
  // only verify sizes measured (a draft model drafting every step): no drafts until a plain
  // step is measured, however well they are accepted
  pyserve::DraftCosts verifies_only;
  verifies_only.set({0.0, 0.0, 0.0, 0.0, 0.0, 120.0, 0.0, 90.0, 0.0, 110.0}, 2.0);
  CHECK_EQ(verifies_only.length(1, 0, 0.0, 1.0, 8), 0);
  CHECK_EQ(verifies_only.length(5, 0, 0.0, 1.0, 4), 4);  // its own size measured: weighed

  Planner p(config());
  p.set_decode_costs(steep, 0.0);
  add(p, 1, {10, 11, 12, 13, 14, 10, 11}, 20);
  report(p, plan(p), 12);
  CHECK_EQ(entry_for(plan(p), 1)->num_tokens, 1);  // the prompt matches, but drafts cost more
}

TEST(with_a_draft_model_the_worker_writes_the_drafts_of_each_verify_entry) {
  PlannerConfig c = config();
  c.speculative_ngram = false;
  c.speculative_draft_model = true;
  Planner p(c);
  add(p, 1, {10, 11, 12}, 20);
  const Step prefill = plan(p);
  // planned before the prefill's sample is reported: the worker knows it when it drafts
  const Step s = plan(p);
  CHECK_EQ(static_cast<int>(s.is_decode[0]), 2);
  CHECK_EQ(s.num_tokens[0], 5);  // the first length: 4 drafts
  CHECK(s.input_ids.empty());
  report(p, prefill, 13);
  // any tokens: the core never saw the drafts; 2 accepted, then one more
  const std::vector<int64_t> rids(3, 1);
  const Tokens tokens{40, 41, 42};
  p.report(s.step_id, rids.data(), rids.size(), tokens.data(), tokens.size());
  p.check_invariants();
  CHECK_EQ(p.request(1).output, (Tokens{13, 40, 41, 42}));
  CHECK_EQ(p.request(1).spec_accepted, 2);
  CHECK_EQ(p.request(1).num_computed, 3 + 3);  // rejected positions released
  const Step next = plan(p);
  CHECK_EQ(static_cast<int>(next.is_decode[0]), 2);
  CHECK_EQ(next.start_pos[0], 6);
  CHECK_EQ(next.num_tokens[0], 4);  // shortened to accepted + 1
}

TEST(settings_the_drafter_cannot_use_are_refused) {
  PlannerConfig c = config();
  c.ngram_min_match = 4;  // above max_match
  CHECK_THROWS(Planner{c}, ValueError);
  c = config();
  c.max_draft_tokens = 0;
  CHECK_THROWS(Planner{c}, ValueError);
  c = config();
  c.speculative_token_budget = 0;
  CHECK_THROWS(Planner{c}, ValueError);
  c = config();
  c.speculative_draft_model = true;  // beside speculative_ngram: one or the other
  CHECK_THROWS(Planner{c}, ValueError);
}

int main() { return check::run_all_tests(); }
