// Planner admission, chunked prefill, prefix reuse and decoding, as a specification.
// Retraction, aborts, overlap and errors are in test_planner_lifecycle.cpp.
#include "planner.h"

#include <algorithm>

#include "check.h"
#include "errors.h"
#include "planner_driver.h"

using namespace driver;

namespace {

PlannerConfig config(int64_t num_blocks, int64_t block_size) {
  PlannerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.vocab_size = 1000;
  return c;
}

}  // namespace

TEST(nothing_to_do_plans_nothing) {
  Planner p(config(8, 2));
  CHECK(!p.plan().has_value());
  CHECK_EQ(p.num_inflight_steps(), 0);
}

TEST(a_new_request_is_prefilled_then_decoded_one_token_a_step) {
  Planner p(config(8, 4));
  Worker w;
  add(p, 1, {10, 11, 12, 13, 14}, 3);
  Step s = plan(p);
  w.run(s, 4);
  CHECK_EQ(s.step_id, 0);
  Entry e = *entry_for(s, 1);
  CHECK_EQ(e.start, 0);
  CHECK_EQ(e.num_tokens, 5);
  CHECK(!e.decode);
  CHECK(e.sample);
  CHECK_EQ(e.input, (Tokens{10, 11, 12, 13, 14}));
  CHECK_EQ(e.block_offset, 0);
  CHECK_EQ(e.blocks.size(), size_t{2});
  CHECK_EQ(s.num_prefill_tokens, 5);
  report(p, s, 20);

  s = plan(p);
  w.run(s, 4);
  e = *entry_for(s, 1);
  CHECK(e.decode);
  CHECK(e.sample);
  CHECK_EQ(e.start, 5);
  CHECK_EQ(e.num_tokens, 1);
  CHECK(e.input.empty());
  CHECK_EQ(s.num_decode_tokens, 1);
  report(p, s, 21);
  report(p, plan(p), 22);
  CHECK_EQ(p.request(1).output, (Tokens{20, 21, 22}));
  CHECK(!p.plan().has_value());  // all max_new_tokens samples planned: it waits for finish
  p.finish(1);
  s = plan(p);
  CHECK_EQ(s.num_entries(), size_t{0});
  CHECK_EQ(s.dropped, (std::vector<int64_t>{1}));
  report(p, s);
}

TEST(admission_stops_at_max_running_requests) {
  PlannerConfig c = config(32, 2);
  c.max_running_requests = 2;
  Planner p(c);
  for (int64_t rid = 1; rid <= 3; ++rid) add(p, rid, range(100 * static_cast<int32_t>(rid), 3), 4);
  Step s = plan(p);
  CHECK_EQ(rids(s), (std::vector<int64_t>{1, 2}));
  report(p, s);
  s = plan(p);
  CHECK_EQ(rids(s), (std::vector<int64_t>{1, 2}));  // decodes only; 3 still waits
  CHECK_EQ(p.num_waiting(), 1);
  report(p, s);
  p.finish(1);
  s = plan(p);
  CHECK_EQ(rids(s), (std::vector<int64_t>{2, 3}));
  CHECK(!entry_for(s, 3)->decode);
  report(p, s);
}

TEST(prefill_tokens_per_step_stay_under_max_prefill_tokens) {
  PlannerConfig c = config(32, 2);
  c.max_prefill_tokens = 10;
  Planner p(c);
  add(p, 1, range(1, 6), 4);
  add(p, 2, range(50, 6), 4);
  Step s = plan(p);
  CHECK_EQ(s.num_prefill_tokens, 10);
  CHECK_EQ(entry_for(s, 1)->num_tokens, 6);
  CHECK(entry_for(s, 1)->sample);
  CHECK_EQ(entry_for(s, 2)->num_tokens, 4);  // the rest of the budget, as a first chunk
  CHECK(!entry_for(s, 2)->sample);
  report(p, s);
  s = plan(p);
  CHECK(entry_for(s, 1)->decode);
  CHECK_EQ(entry_for(s, 2)->start, 4);
  CHECK_EQ(entry_for(s, 2)->num_tokens, 2);
  CHECK(entry_for(s, 2)->sample);
  report(p, s);
}

TEST(a_long_prompt_is_chunked_and_its_full_blocks_become_shareable) {
  PlannerConfig c = config(32, 2);
  c.chunked_prefill_size = 4;
  Planner p(c);
  Worker w;
  const Tokens prompt = range(1, 10);
  add(p, 1, prompt, 2);
  Step s = plan(p);
  w.run(s, 2);
  CHECK_EQ(entry_for(s, 1)->num_tokens, 4);
  CHECK(!entry_for(s, 1)->sample);
  CHECK_EQ(p.cache().cached_blocks(), 0);  // nothing is cached before it is reported
  report(p, s);
  CHECK_EQ(p.cache().cached_blocks(), 2);
  CHECK_EQ(p.request(1).num_computed, 4);

  // A request sharing the first chunk reuses its blocks while request 1 is still prefilling.
  Tokens other = range(1, 4);
  other.push_back(99);
  add(p, 2, other, 2);
  s = plan(p);
  w.run(s, 2);
  const Entry chunk = *entry_for(s, 1);
  CHECK_EQ(chunk.start, 4);
  CHECK_EQ(chunk.num_tokens, 4);
  CHECK_EQ(chunk.block_offset, 2);
  const Entry hit = *entry_for(s, 2);
  CHECK_EQ(hit.start, 4);
  CHECK_EQ(hit.input, (Tokens{99}));
  CHECK_EQ(p.request(2).cached_tokens, 4);
  CHECK_EQ(Ids(w.tables[2].begin(), w.tables[2].begin() + 2),
           Ids(w.tables[1].begin(), w.tables[1].begin() + 2));
  report(p, s);
  s = plan(p);
  CHECK_EQ(entry_for(s, 1)->num_tokens, 2);
  CHECK(entry_for(s, 1)->sample);
  report(p, s);
  const Tokens whole = range(1, 10);
  CHECK_EQ(p.cache().match_prefix(whole.data(), whole.size()).num_tokens, 10);
}

TEST(a_cached_prefix_is_not_computed_again) {
  Planner p(config(32, 2));
  Worker w;
  add(p, 1, range(1, 7), 1);
  Step s = plan(p);
  w.run(s, 2);
  report(p, s);
  p.finish(1);  // positions 0..5 computed: three whole blocks go to the cache
  CHECK_EQ(p.cache().cached_blocks(), 3);
  const Ids cached = Ids(w.tables[1].begin(), w.tables[1].begin() + 3);

  Tokens prompt = range(1, 6);
  prompt.push_back(42);
  prompt.push_back(43);  // {1..6} cached, then new tokens
  add(p, 2, prompt, 2);
  s = plan(p);
  w.run(s, 2);
  const Entry e = *entry_for(s, 2);
  CHECK_EQ(e.start, 6);
  CHECK_EQ(e.input, (Tokens{42, 43}));
  CHECK_EQ(e.block_offset, 0);  // a first prefill replaces the table: cached blocks + new
  CHECK_EQ(Ids(e.blocks.begin(), e.blocks.begin() + 3), cached);
  CHECK_EQ(e.blocks.size(), size_t{4});
  CHECK_EQ(p.request(2).cached_tokens, 6);
  CHECK_EQ(p.stats().cache.hit_tokens, 6);
  report(p, s);
}

TEST(a_request_that_does_not_match_prefixes_computes_every_position_and_caches_nothing) {
  Planner p(config(32, 2));
  Worker w;
  add(p, 1, range(1, 7), 1);
  report(p, plan(p));
  p.finish(1);
  CHECK_EQ(p.cache().cached_blocks(), 3);

  p.add_request(2, range(1, 7), 1, /*match_prefix=*/false);
  p.check_invariants();
  Step s = plan(p);
  w.run(s, 2);
  const Entry e = *entry_for(s, 2);
  CHECK_EQ(e.start, 0);
  CHECK_EQ(e.input, range(1, 7));
  for (BlockId b : e.blocks) CHECK(!p.cache().in_tree(b));  // its own blocks, none shared
  CHECK_EQ(p.request(2).cached_tokens, 0);
  report(p, s);
  p.check_invariants();
  for (BlockId b : e.blocks) CHECK(!p.cache().in_tree(b));  // computed, still not cached
  CHECK_EQ(p.cache().stats().inserted_blocks, 3);
  p.finish(2);
  p.check_invariants();
  CHECK_EQ(p.cache().cached_blocks(), 3);
  CHECK_EQ(p.num_free_blocks() + p.cache().cached_blocks(), 32);  // its blocks are free again
}

TEST(a_fully_cached_prompt_recomputes_its_last_block) {
  Planner p(config(32, 2));
  Worker w;
  add(p, 1, {5, 6, 7, 8}, 2);
  report(p, plan(p));
  report(p, plan(p));  // the decode computes position 3's neighbour: {5,6},{7,8} are cached
  p.finish(1);
  CHECK_EQ(p.cache().cached_blocks(), 2);
  report(p, plan(p));  // the step that drops request 1

  add(p, 2, {5, 6, 7, 8}, 2);
  Step s = plan(p);
  w.run(s, 2);
  const Entry e = *entry_for(s, 2);
  CHECK_EQ(e.start, 2);
  CHECK_EQ(e.input, (Tokens{7, 8}));
  CHECK(!p.cache().in_tree(e.blocks[1]));  // written into a fresh block, never a cached one
  CHECK_EQ(p.request(2).cached_tokens, 2);
  report(p, s);

  // A prompt one token past the cached blocks computes only that token.
  add(p, 3, {5, 6, 7, 8, 9}, 2);
  s = plan(p);
  CHECK_EQ(entry_for(s, 3)->start, 4);
  CHECK_EQ(entry_for(s, 3)->input, (Tokens{9}));
  report(p, s);
}

TEST(decodes_allocate_a_block_exactly_when_they_start_one) {
  Planner p(config(16, 4));
  Worker w;
  add(p, 1, {1, 2, 3}, 6);
  Step s = plan(p);
  w.run(s, 4);
  CHECK_EQ(entry_for(s, 1)->blocks.size(), size_t{1});
  report(p, s);
  s = plan(p);  // position 3: still block 0
  w.run(s, 4);
  CHECK_EQ(entry_for(s, 1)->start, 3);
  CHECK(entry_for(s, 1)->blocks.empty());
  CHECK_EQ(entry_for(s, 1)->block_offset, 1);
  report(p, s);
  s = plan(p);  // position 4 starts block 1
  w.run(s, 4);
  CHECK_EQ(entry_for(s, 1)->start, 4);
  CHECK_EQ(entry_for(s, 1)->blocks.size(), size_t{1});
  CHECK_EQ(entry_for(s, 1)->block_offset, 1);
  CHECK_EQ(w.tables[1].size(), size_t{2});
  report(p, s);
  CHECK_EQ(p.request(1).num_blocks, 2);
}

TEST(decode_blocks_enter_the_cache_as_they_fill) {
  Planner p(config(16, 2));
  add(p, 1, {1, 2, 3}, 4);
  report(p, plan(p), 4);  // computes 0..2, samples 4
  CHECK_EQ(p.cache().cached_blocks(), 1);
  report(p, plan(p), 5);  // computes position 3 (token 4)
  CHECK_EQ(p.cache().cached_blocks(), 2);
  const auto m = p.cache().match_prefix(Tokens{1, 2, 3, 4}.data(), 4);
  CHECK_EQ(m.num_tokens, 4);
}

TEST(admission_keeps_room_for_the_tokens_running_requests_will_need) {
  PlannerConfig c = config(8, 2);
  c.init_reserve_ratio = 1.0;  // reserve every future token
  c.min_reserve_ratio = 1.0;
  Planner p(c);
  add(p, 1, {1, 2}, 8);  // will need blocks for 2 + 8 tokens: 5 blocks
  add(p, 2, {3, 4}, 6);  // would need 4 more: 5 + 4 > 8
  add(p, 3, {5, 6}, 1);  // would fit, but fcfs does not pass request 2
  Step s = plan(p);
  CHECK_EQ(rids(s), (std::vector<int64_t>{1}));
  report(p, s);
  s = plan(p);
  CHECK_EQ(rids(s), (std::vector<int64_t>{1}));
  report(p, s);
  p.finish(1);
  s = plan(p);
  CHECK_EQ(rids(s), (std::vector<int64_t>{2, 3}));
  report(p, s);
}

TEST(a_lower_reserve_ratio_admits_more) {
  PlannerConfig c = config(8, 2);
  c.init_reserve_ratio = 0.25;
  c.min_reserve_ratio = 0.25;
  Planner p(c);
  add(p, 1, {1, 2}, 8);
  add(p, 2, {3, 4}, 6);
  CHECK_EQ(rids(plan(p)), (std::vector<int64_t>{1, 2}));
}

TEST(lpm_admits_the_longest_cached_prefix_first_and_fcfs_keeps_arrival_order) {
  for (const char* policy : {"lpm", "fcfs"}) {
    PlannerConfig c = config(32, 2);
    c.policy = policy;
    c.max_running_requests = 1;
    Planner p(c);
    add(p, 1, {1, 2, 3, 4, 5}, 1);
    report(p, plan(p));
    p.finish(1);  // {1,2},{3,4} cached
    add(p, 2, {9, 9, 9}, 1);
    add(p, 3, {1, 2, 3, 4, 8}, 1);
    const Step s = plan(p);
    const int64_t first = std::string(policy) == "lpm" ? 3 : 2;
    CHECK_EQ(rids(s), (std::vector<int64_t>{first}));
  }
}

TEST(without_the_radix_cache_nothing_is_shared_and_finish_frees_everything) {
  PlannerConfig c = config(16, 2);
  c.enable_radix_cache = false;
  Planner p(c);
  add(p, 1, {1, 2, 3, 4}, 2);
  report(p, plan(p));
  report(p, plan(p));
  p.finish(1);
  CHECK_EQ(p.num_free_blocks(), 16);
  add(p, 2, {1, 2, 3, 4}, 2);
  const Step s = plan(p);
  CHECK_EQ(entry_for(s, 2)->start, 0);
  CHECK_EQ(p.cache().cached_blocks(), 0);
}

TEST(block_states_tell_free_owned_and_cached_apart) {
  Planner p(config(8, 2));
  add(p, 1, {1, 2, 3}, 2);
  report(p, plan(p));  // block 0 (positions 0,1) cached, block 1 owned by request 1
  CHECK_EQ(count_state(p, 2), 1);
  CHECK_EQ(count_state(p, 1), 1);
  CHECK_EQ(count_state(p, 0), 6);
  p.finish(1);
  CHECK_EQ(count_state(p, 1), 0);
  CHECK_EQ(count_state(p, 2), 1);
  CHECK_EQ(p.flush_cache(), 1);
  CHECK_EQ(count_state(p, 0), 8);
  p.check_invariants();
}

int main() { return check::run_all_tests(); }

TEST(with_a_disk_budget_a_step_that_reuses_evicted_blocks_carries_their_saves_first) {
  PlannerConfig c = config(4, 2);
  c.disk_budget_blocks = 8;
  Planner p(c);
  Worker w;
  add(p, 1, {1, 2, 3, 4, 5}, 1);
  Step s = plan(p);
  w.run(s, 2);
  CHECK(s.save_blocks.empty());
  report(p, s, 9);
  p.finish(1);
  CHECK_EQ(p.cache().cached_blocks(), 2);  // {1,2} {3,4}

  add(p, 2, {7, 8, 9, 10, 11, 12, 13}, 1);  // needs all 4 blocks: both cached ones go to disk
  s = plan(p);
  w.run(s, 2);
  CHECK_EQ(s.save_blocks.size(), size_t{2});
  const Tokens prefix{1, 2, 3, 4};
  CHECK_EQ(s.save_keys, p.cache().block_keys(prefix.data(), prefix.size()));
  CHECK(s.drop_keys.empty());
  const Entry e = *entry_for(s, 2);
  for (BlockId b : s.save_blocks) {  // the step writes into the blocks it saves
    CHECK(std::find(e.blocks.begin(), e.blocks.end(), b) != e.blocks.end());
  }
  CHECK_EQ(p.cache().disk_blocks(), 2);
  CHECK_EQ(p.cache().cached_blocks(), 0);
  p.check_invariants();
}

TEST(a_disk_budget_needs_the_radix_cache_and_cannot_be_negative) {
  PlannerConfig c = config(4, 2);
  c.disk_budget_blocks = -1;
  CHECK_THROWS(Planner{c}, pyserve::ValueError);
  c.disk_budget_blocks = 4;
  c.enable_radix_cache = false;
  CHECK_THROWS(Planner{c}, pyserve::ValueError);
}
