// The planner's own n-gram drafts (speculative_ngram): what it drafts from, ahead of an
// unreported token, within the step's budget, and how it backs off.
#include <string>

#include "check.h"
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

TEST(with_a_plain_decode_in_flight_the_drafts_skip_the_token_being_sampled) {
  Planner p(config());
  add(p, 1, {10, 11, 12, 13, 14, 15, 10, 11}, 20);
  const Step prefill = plan(p);
  report(p, prefill, 12);
  const Step decode = plan(p);  // 10 11 12 is followed by 13 14 15 10 in the prompt
  CHECK_EQ(entry_for(decode, 1)->input, (Tokens{13, 14, 15, 10}));
  report_verify(p, decode, 1, 0, 13);  // nothing accepted: backs off for two decode entries
  const Step plain1 = plan(p);
  CHECK_EQ(entry_for(plain1, 1)->num_tokens, 1);
  const Step plain2 = plan(p);  // planned before plain1 is reported: overlap
  CHECK_EQ(entry_for(plain2, 1)->num_tokens, 1);
  report(p, plain1, 14);
  // plain2 samples the token after 12 13 14; the drafts guess it (15) and start after it, one
  // draft long since the miss.
  const Step ahead = plan(p);
  CHECK_EQ(entry_for(ahead, 1)->input, (Tokens{10}));
  report(p, plain2, 15);
  report_verify(p, ahead, 1, 1, 11);
  CHECK_EQ(p.request(1).output, (Tokens{12, 13, 14, 15, 10, 11}));
  // Every draft accepted: the next verify drafts half as many again.
  const Step longer = plan(p);
  CHECK_EQ(entry_for(longer, 1)->input, (Tokens{12, 13}));
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
}

int main() { return check::run_all_tests(); }
