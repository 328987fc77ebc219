// The disk tier's loads, as a specification: a waiting request whose prefix continues on disk
// loads it in a step of its own, then is admitted with it as a cache hit; a failed load is
// recomputed and its files dropped; an abort while loading gives everything back.
#include <optional>
#include <vector>

#include "check.h"
#include "errors.h"
#include "planner.h"
#include "planner_driver.h"

using namespace driver;
using pyserve::ProtocolError;
using pyserve::ValueError;

namespace {

PlannerConfig disk_config() {
  PlannerConfig c;
  c.num_blocks = 8;
  c.block_size = 4;
  c.vocab_size = 1000;
  c.disk_budget_blocks = 16;
  return c;
}

// Runs rid's prompt to its one sample and finishes it: its whole blocks stay cached.
void run_alone(Planner& p, int64_t rid, const Tokens& prompt) {
  add(p, rid, prompt, 1);
  report(p, plan(p));
  p.finish(rid);
}

// Plans and reports until nothing is left to do (drops, saves).
void drain(Planner& p) {
  while (std::optional<Step> s = p.plan()) report(p, *s);
}

// The first request's four blocks, evicted to disk by a second request.
void with_prefix_on_disk(Planner& p, const Tokens& prompt) {
  run_alone(p, 1, prompt);
  run_alone(p, 2, range(500, 25));  // needs seven of the eight blocks: evicts the first's
  drain(p);
  CHECK_EQ(p.stats().cache.disk_blocks, int64_t{4});
}

// Request 3 of `prompt`, whose four whole blocks are on disk: the step that loads them.
Step loading(Planner& p, const Tokens& prompt) {
  with_prefix_on_disk(p, prompt);
  add(p, 3, prompt, 2);
  Step load = plan(p);
  CHECK_EQ(load.num_entries(), size_t{0});  // it waits for its loads
  CHECK_EQ(load.load_blocks.size(), size_t{4});
  return load;
}

}  // namespace

TEST(a_prefix_on_disk_is_loaded_in_a_step_then_admitted_as_a_hit) {
  Planner p(disk_config());
  const Tokens prompt = range(10, 17);  // four whole blocks before its last token
  const Step load = loading(p, prompt);
  const std::vector<uint64_t> keys = p.cache().block_keys(prompt.data(), 16);
  CHECK(load.load_keys == keys);
  CHECK_EQ(p.request(3).inflight_steps, 1);
  CHECK(!p.plan().has_value());  // passed over until the report
  report(p, load);
  CHECK_EQ(p.stats().disk_loaded_blocks, int64_t{4});
  const Step admit = plan(p);
  const auto e = entry_for(admit, 3);
  CHECK(e.has_value());
  CHECK_EQ(e->start, 16);  // the loaded prefix is a cache hit
  CHECK_EQ(p.request(3).cached_tokens, int64_t{16});
}

TEST(a_failed_load_is_recomputed_and_its_files_dropped) {
  Planner p(disk_config());
  const Tokens prompt = range(10, 17);
  const Step load = loading(p, prompt);
  CHECK_THROWS(p.fail_loads(load.step_id + 1, {load.load_blocks[0]}), ProtocolError);
  CHECK_THROWS(p.fail_loads(load.step_id, {9999}), ValueError);
  p.fail_loads(load.step_id, {load.load_blocks[2]});  // the third of four is damaged
  report(p, load);
  CHECK_EQ(p.stats().disk_loaded_blocks, int64_t{2});
  CHECK_EQ(p.stats().disk_failed_blocks, int64_t{2});
  const pyserve::PrefixPeek peek = p.cache().peek_prefix(prompt.data(), 16);
  CHECK_EQ(peek.num_blocks, int64_t{2});   // the two good blocks are cached
  CHECK_EQ(peek.disk_blocks, int64_t{0});  // the rest of the prefix is forgotten
  const Step admit = plan(p);
  CHECK_EQ(admit.drop_keys.size(), size_t{2});  // their files go
  const auto e = entry_for(admit, 3);
  CHECK(e.has_value());
  CHECK_EQ(e->start, 8);  // the two good blocks are a hit; the rest is computed
}

TEST(an_abort_while_loading_gives_the_blocks_and_the_lock_back) {
  Planner p(disk_config());
  const Tokens prompt = range(10, 17);
  const Step load = loading(p, prompt);
  const int64_t free_before = p.num_free_blocks();
  CHECK(p.abort(3));
  p.check_invariants();
  CHECK_EQ(p.num_free_blocks(), free_before + 4);
  report(p, load);  // the worker filled blocks nobody holds: nothing joins the tree
  CHECK_EQ(p.stats().disk_loaded_blocks, int64_t{0});
  CHECK_EQ(p.stats().num_requests, int64_t{0});
}

TEST(spill_saves_every_unlocked_cached_block_and_flush_clears_the_disk) {
  Planner p(disk_config());
  run_alone(p, 1, range(10, 17));
  drain(p);
  CHECK_EQ(p.spill_to_disk(), int64_t{4});
  CHECK_EQ(p.stats().cache.cached_blocks, int64_t{0});
  Step s = plan(p);
  CHECK_EQ(s.save_blocks.size(), size_t{4});
  CHECK_EQ(s.save_tokens.size(), size_t{16});
  CHECK_EQ(s.save_parents.size(), size_t{4});
  CHECK_EQ(s.save_parents[1], s.save_keys[0]);  // each block names the one before it
  report(p, s);
  p.flush_cache();
  CHECK_EQ(p.stats().cache.disk_blocks, int64_t{0});
  const Step clear = plan(p);
  CHECK(clear.clear_disk);
  report(p, clear);
  CHECK(!p.plan().has_value());
}
int main() { return check::run_all_tests(); }
