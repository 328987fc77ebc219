// Speculative decoding in the planner: verify entries of 1 + k positions, the release of rejected
// positions on report, and the rules around them, as a specification.
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

PlannerConfig config(int64_t num_blocks, int64_t block_size, bool radix = true) {
  PlannerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.vocab_size = 1000;
  c.max_draft_tokens = 4;
  c.enable_radix_cache = radix;
  c.init_reserve_ratio = 0.0;  // admission counts no future decode blocks: pools stay small
  c.min_reserve_ratio = 0.0;
  return c;
}

void report_tokens(Planner& p, const Step& s, const std::vector<int64_t>& rids,
                   const Tokens& tokens) {
  p.report(s.step_id, rids.data(), rids.size(), tokens.data(), tokens.size());
  p.check_invariants();
}

// Request rid, prefilled and reported, so that its next entry is a decode.
Step prefill(Planner& p, int64_t rid, const Tokens& prompt, int64_t max_new) {
  add(p, rid, prompt, max_new);
  const Step s = plan(p);
  report(p, s, 50);
  return s;
}

}  // namespace

TEST(a_verify_entry_crossing_a_block_boundary_gets_blocks_for_all_its_positions) {
  Planner p(config(8, 4));
  prefill(p, 1, range(1, 6), 10);  // positions 0..5 in 2 blocks; the sample sits at 6
  const int64_t free_before = p.num_free_blocks();
  p.set_draft(1, {60, 61, 62});
  CHECK_EQ(p.request(1).draft_len, 3);
  p.check_invariants();

  const Step s = plan(p);
  const Entry e = *entry_for(s, 1);
  CHECK(e.decode);
  CHECK(e.sample);
  CHECK_EQ(e.start, 6);
  CHECK_EQ(e.num_tokens, 4);  // the last sampled token, then 3 drafts: positions 6..9
  CHECK_EQ(e.input, (Tokens{60, 61, 62}));
  CHECK_EQ(e.block_offset, 2);
  CHECK_EQ(e.blocks.size(), size_t{1});  // position 8 starts a third block
  CHECK_EQ(s.num_decode_tokens, 4);
  CHECK_EQ(s.num_prefill_tokens, 0);
  CHECK_EQ(p.num_free_blocks(), free_before - 1);
  CHECK_EQ(p.request(1).num_scheduled, 10);
  CHECK_EQ(p.request(1).planned_samples, 5);  // the prefill's sample plus up to 4 here
  CHECK_EQ(p.request(1).verifying, 3);
  CHECK_EQ(p.request(1).draft_len, 0);
}

TEST(rejecting_every_draft_frees_the_blocks_wholly_past_the_new_computed_length) {
  Planner p(config(8, 4));
  prefill(p, 1, range(1, 6), 10);
  p.set_draft(1, {60, 61, 62});
  const Step s = plan(p);
  const BlockId third = entry_for(s, 1)->blocks[0];
  const int64_t free_during = p.num_free_blocks();

  report_tokens(p, s, {1}, {70});  // no draft accepted: only position 6 is computed
  CHECK_EQ(p.request(1).output, (Tokens{50, 70}));
  CHECK_EQ(p.request(1).num_computed, 7);
  CHECK_EQ(p.request(1).num_scheduled, 7);
  CHECK_EQ(p.request(1).num_blocks, 2);
  CHECK_EQ(p.request(1).planned_samples, 2);
  CHECK_EQ(p.num_free_blocks(), free_during + 1);
  CHECK_EQ(p.block_states()[static_cast<size_t>(third)], 0);

  // The next decode continues at position 7, in the second block.
  const Entry e = *entry_for(plan(p), 1);
  CHECK_EQ(e.start, 7);
  CHECK_EQ(e.num_tokens, 1);
  CHECK(e.blocks.empty());
}

TEST(accepted_drafts_stay_computed_and_only_whole_computed_blocks_enter_the_cache) {
  Planner p(config(8, 4));
  prefill(p, 1, range(1, 6), 10);
  p.set_draft(1, {60, 61, 62, 63});  // positions 6..10: three blocks
  Step s = plan(p);
  CHECK_EQ(p.request(1).num_blocks, 3);

  // Two drafts accepted, then a token of its own: positions 6..8 are computed.
  report_tokens(p, s, {1, 1, 1}, {60, 61, 99});
  CHECK_EQ(p.request(1).output, (Tokens{50, 60, 61, 99}));
  CHECK_EQ(p.request(1).num_computed, 9);
  CHECK_EQ(p.request(1).num_scheduled, 9);
  CHECK_EQ(p.request(1).num_blocks, 3);  // position 8 keeps the third block
  CHECK_EQ(count_state(p, 2), 2);        // positions 0..7, never the partly rejected third

  // Every draft accepted, plus one: k + 1 tokens.
  p.set_draft(1, {5, 6});
  s = plan(p);
  CHECK_EQ(entry_for(s, 1)->start, 9);
  report_tokens(p, s, {1, 1, 1}, {5, 6, 7});
  CHECK_EQ(p.request(1).output, (Tokens{50, 60, 61, 99, 5, 6, 7}));
  CHECK_EQ(p.request(1).num_computed, 12);
  CHECK_EQ(p.request(1).num_scheduled, 12);
  CHECK_EQ(count_state(p, 2), 3);
}

TEST(a_report_must_name_a_verify_entry_once_to_k_plus_one_times_with_its_accepted_drafts) {
  Planner p(config(8, 4));
  prefill(p, 1, range(1, 6), 10);
  p.set_draft(1, {60, 61});
  const Step s = plan(p);
  const int64_t r = 1;
  const int32_t t = 60;
  std::vector<int64_t> four(4, r);
  Tokens four_tokens{60, 61, 62, 63};
  CHECK_THROWS(p.report(s.step_id, four.data(), 4, four_tokens.data(), 4), ProtocolError);
  Tokens wrong{61, 60, 5};  // a token before the last is not its draft
  std::vector<int64_t> three(3, r);
  CHECK_THROWS(p.report(s.step_id, three.data(), 3, wrong.data(), 3), ProtocolError);
  CHECK_THROWS(p.report(s.step_id, &r, 0, &t, 0), ProtocolError);  // its sample left out
  p.check_invariants();
  CHECK_EQ(p.request(1).output, (Tokens{50}));
  report_tokens(p, s, {1, 1}, {60, 7});
  CHECK_EQ(p.request(1).output, (Tokens{50, 60, 7}));
}

TEST(a_request_verifying_drafts_gets_no_entry_until_that_step_is_reported) {
  Planner p(config(16, 4));
  add(p, 1, range(1, 6), 10);
  add(p, 2, range(100, 6), 10);
  report(p, plan(p), 50);
  p.set_draft(1, {60, 61});

  const Step a = plan(p);
  CHECK_EQ(rids(a), (std::vector<int64_t>{1, 2}));
  CHECK_EQ(entry_for(a, 1)->num_tokens, 3);
  const Step b = plan(p);  // planned ahead of a's report: request 2 keeps overlapping
  CHECK_EQ(rids(b), (std::vector<int64_t>{2}));
  CHECK_THROWS((p.set_draft(1, {5})), ValueError);  // its drafts would follow an unknown token

  report_tokens(p, a, {1, 1, 2}, {60, 8, 9});
  const Step c = plan(p);
  CHECK_EQ(rids(c), (std::vector<int64_t>{1, 2}));
  CHECK_EQ(entry_for(c, 1)->start, 8);  // after position 6 and the accepted draft at 7
  CHECK_EQ(entry_for(c, 1)->num_tokens, 1);
  report(p, b);
  report(p, c);
}

TEST(drafts_that_do_not_fit_beside_the_plain_decodes_fall_back_to_a_plain_decode) {
  // Block size 2, no cache: request 1 decodes at position 3 (block 1), request 2 at position 4,
  // which needs a new block. One block is free: it goes to request 2, not to request 1's drafts.
  Planner p(config(5, 2, /*radix=*/false));
  add(p, 1, range(1, 3), 6);
  add(p, 2, range(10, 4), 6);
  report(p, plan(p), 50);
  CHECK_EQ(p.num_free_blocks(), 1);
  p.set_draft(1, {60, 61});

  const Step s = plan(p);
  CHECK(s.retracted.empty());
  const Entry e1 = *entry_for(s, 1);
  CHECK_EQ(e1.num_tokens, 1);
  CHECK(e1.input.empty());
  CHECK(e1.blocks.empty());
  CHECK_EQ(entry_for(s, 2)->blocks.size(), size_t{1});
  CHECK_EQ(p.request(1).draft_len, 0);  // consumed: drafts are for one plan only
  CHECK_EQ(p.request(1).verifying, 0);
  CHECK_EQ(p.request(1).planned_samples, 2);
  report(p, s);
}

TEST(a_full_pool_gives_a_plain_decode_instead_of_retracting_anyone) {
  Planner p(config(3, 4, /*radix=*/false));
  add(p, 1, range(1, 7), 5);   // positions 0..6: two blocks
  add(p, 2, range(20, 2), 1);  // one block, done sampling after its prefill
  report(p, plan(p), 50);
  CHECK_EQ(p.num_free_blocks(), 0);
  p.set_draft(1, {60, 61});  // positions 7..9 would need a third block

  const Step s = plan(p);
  CHECK(s.retracted.empty());
  CHECK_EQ(rids(s), (std::vector<int64_t>{1}));
  CHECK_EQ(entry_for(s, 1)->num_tokens, 1);
  CHECK_EQ(std::string(p.request(2).state), "running");
  report(p, s);
}

TEST(aborting_a_request_mid_speculation_leaves_the_pool_idle) {
  Planner p(config(8, 4, /*radix=*/false));
  prefill(p, 1, range(1, 6), 10);
  p.set_draft(1, {60, 61, 62});
  const Step s = plan(p);
  CHECK_EQ(p.num_free_blocks(), 5);
  CHECK(p.abort(1));
  p.check_invariants();
  CHECK_EQ(p.num_free_blocks(), 8);
  report_tokens(p, s, {}, {});  // the worker dropped it
  CHECK_EQ(p.stats().num_requests, 0);
  const Step d = plan(p);  // only announces the drop
  CHECK_EQ(d.dropped, (std::vector<int64_t>{1}));
  CHECK_EQ(d.num_entries(), size_t{0});
  report_tokens(p, d, {}, {});
  CHECK(!p.plan().has_value());
  CHECK_EQ(p.num_free_blocks(), 8);
}

TEST(finishing_a_request_mid_speculation_ignores_its_tokens_and_frees_everything) {
  Planner p(config(8, 4));
  prefill(p, 1, range(1, 6), 10);
  p.set_draft(1, {60, 61, 62});
  const Step s = plan(p);
  p.finish(1);
  p.check_invariants();
  report_tokens(p, s, {1, 1}, {60, 3});  // the worker may still report it
  CHECK_EQ(p.stats().num_requests, 0);
  p.flush_cache();
  CHECK_EQ(p.num_free_blocks(), 8);
}

TEST(a_request_retracted_mid_speculation_keeps_its_verified_tokens_for_the_recompute) {
  // Block size 2, no cache. Request 2 verifies drafts; request 1, older, needs a block that only
  // request 2's retraction frees. Its report still appends what it sampled.
  Planner p(config(5, 2, /*radix=*/false));
  add(p, 1, range(1, 2), 6);
  add(p, 2, range(10, 3), 6);
  report(p, plan(p), 50);  // 1: positions 0..1 (1 block); 2: 0..2 (2 blocks)
  p.set_draft(2, {60});    // positions 3..4: a third block
  const Step a = plan(p);  // 1 decodes at 2 (new block): 4 of 5 blocks used
  CHECK_EQ(entry_for(a, 2)->num_tokens, 2);
  CHECK_EQ(p.num_free_blocks(), 0);
  const Step b = plan(p);  // 1 at 3 fits; nothing for 2
  CHECK_EQ(rids(b), (std::vector<int64_t>{1}));
  const Step c = plan(p);  // 1 at 4 needs a block: 2 is retracted while verifying
  CHECK_EQ(c.retracted, (std::vector<int64_t>{2}));
  CHECK_EQ(std::string(p.request(2).state), "retracted");
  report_tokens(p, a, {1, 2, 2}, {7, 60, 8});
  CHECK_EQ(p.request(2).output, (Tokens{50, 60, 8}));
  CHECK_EQ(p.request(2).verifying, 0);
  report(p, b);
  report(p, c);
  p.finish(1);
  const Step d = plan(p);  // 2 recomputes prompt + output
  CHECK_EQ(entry_for(d, 2)->input, (Tokens{10, 11, 12, 50, 60, 8}));
  report(p, d);
}

TEST(set_draft_refuses_what_it_cannot_verify_and_an_empty_draft_clears) {
  Planner p(config(8, 4));
  add(p, 1, range(1, 6), 3);
  CHECK_THROWS((p.set_draft(1, {5})), ValueError);     // waiting: no sampled token yet
  CHECK_THROWS((p.set_draft(9, {5})), KeyError);       // unknown
  report(p, plan(p), 50);                              // one sample of 3
  CHECK_THROWS((p.set_draft(1, {5, 6})), ValueError);  // 1 + 2 more samples would make 4 > 3
  CHECK_THROWS((p.set_draft(1, {1000})), ValueError);  // out of the vocabulary
  CHECK_THROWS((p.set_draft(1, {-1})), ValueError);
  p.set_draft(1, {5});
  CHECK_EQ(p.request(1).draft_len, 1);
  p.set_draft(1, {});
  CHECK_EQ(p.request(1).draft_len, 0);
  p.check_invariants();

  PlannerConfig c = config(8, 4);
  c.max_draft_tokens = 2;
  Planner q(c);
  prefill(q, 1, range(1, 6), 10);
  CHECK_THROWS((q.set_draft(1, {1, 2, 3})), ValueError);  // more than max_draft_tokens
  q.finish(1);
  CHECK_THROWS((q.set_draft(1, {1})), KeyError);  // ended
}

TEST(with_no_drafts_a_decode_entry_carries_no_input_ids) {
  Planner p(config(8, 4));
  prefill(p, 1, range(1, 6), 10);
  const Step s = plan(p);
  CHECK(s.input_ids.empty());
  CHECK_EQ(s.num_decode_tokens, 1);
  report(p, s);
}

int main() { return check::run_all_tests(); }
