// Whole spans: runs of prompt positions (an image whose positions attend to each other) that one
// forward pass must compute whole. No prefill chunk ends strictly inside one, as a specification.
#include <string>

#include "check.h"
#include "errors.h"
#include "planner.h"
#include "planner_driver.h"

using namespace driver;
using pyserve::ValueError;

namespace {

PlannerConfig config(int64_t num_blocks, int64_t block_size, int64_t chunk, int64_t budget) {
  PlannerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.vocab_size = 1000;
  c.chunked_prefill_size = chunk;
  c.max_prefill_tokens = budget;
  return c;
}

void add_spans(Planner& p, int64_t rid, const Tokens& prompt, int64_t max_new_tokens,
               const Tokens& spans, bool match_prefix = true) {
  p.add_request(rid, prompt, max_new_tokens, match_prefix, spans);
  p.check_invariants();
}

using Chunk = std::vector<int32_t>;  // {start, num_tokens}

// rid's entry in s as {start, num_tokens}; {-1, 0} if it has none.
Chunk chunk_of(const Step& s, int64_t rid) {
  const auto e = entry_for(s, rid);
  return e ? Chunk{e->start, e->num_tokens} : Chunk{-1, 0};
}

}  // namespace

TEST(a_chunk_that_would_end_inside_a_span_ends_at_its_start_and_the_next_takes_it_whole) {
  Planner p(config(16, 4, /*chunk=*/4, /*budget=*/100));
  Worker w;
  add_spans(p, 1, range(100, 12), 1, {2, 9});
  Step s = plan(p);
  w.run(s, 4);
  CHECK_EQ(chunk_of(s, 1), (Chunk{0, 2}));  // [0, 4) would split [2, 9)
  report(p, s);
  s = plan(p);
  w.run(s, 4);
  CHECK_EQ(chunk_of(s, 1), (Chunk{2, 7}));  // the whole span, past chunked_prefill_size
  CHECK_EQ(entry_for(s, 1)->input, range(102, 7));
  CHECK(!entry_for(s, 1)->sample);
  report(p, s);
  s = plan(p);
  CHECK_EQ(chunk_of(s, 1), (Chunk{9, 3}));
  CHECK(entry_for(s, 1)->sample);
  report(p, s);
}

TEST(a_span_longer_than_the_step_budget_is_computed_in_one_step_that_exceeds_it) {
  Planner p(config(16, 2, /*chunk=*/3, /*budget=*/3));
  add_spans(p, 1, range(100, 10), 1, {0, 8});
  add(p, 2, range(200, 2), 1);
  Step s = plan(p);
  CHECK_EQ(chunk_of(s, 1), (Chunk{0, 8}));   // a span at position 0, longer than both budgets
  CHECK_EQ(s.num_prefill_tokens, 8);         // 5 past max_prefill_tokens: less than one span
  CHECK_EQ(chunk_of(s, 2), (Chunk{-1, 0}));  // the budget is spent: nobody else is admitted
  report(p, s);
  s = plan(p);
  CHECK_EQ(chunk_of(s, 1), (Chunk{8, 2}));
  CHECK_EQ(chunk_of(s, 2), (Chunk{0, 1}));  // what the budget has left
  report(p, s);
}

TEST(a_continued_chunk_starting_at_a_span_runs_past_the_budget_left_in_the_step) {
  Planner p(config(32, 2, /*chunk=*/4, /*budget=*/5));
  add_spans(p, 1, range(100, 6), 1, {4, 6});
  add_spans(p, 2, range(200, 10), 1, {3, 9});
  Step s = plan(p);
  CHECK_EQ(chunk_of(s, 1), (Chunk{0, 4}));  // ends at the span's start
  CHECK_EQ(chunk_of(s, 2), (Chunk{0, 1}));  // the budget's last token, clear of [3, 9)
  report(p, s);
  s = plan(p);
  CHECK_EQ(chunk_of(s, 1), (Chunk{4, 2}));
  CHECK_EQ(chunk_of(s, 2), (Chunk{1, 2}));  // 3 left: [1, 4) would split [3, 9)
  report(p, s);
  s = plan(p);
  CHECK_EQ(chunk_of(s, 2), (Chunk{3, 6}));  // the whole span, though only 4 tokens a chunk
  report(p, s);
}

TEST(touching_spans_are_computed_one_after_the_other) {
  Planner p(config(16, 4, /*chunk=*/4, /*budget=*/100));
  add_spans(p, 1, range(100, 11), 1, {0, 3, 3, 6, 6, 9});
  Chunk chunks;  // one {start, num_tokens} after the other
  for (int i = 0; i < 4; ++i) {
    const Step s = plan(p);
    for (int32_t v : chunk_of(s, 1)) chunks.push_back(v);
    report(p, s);
  }
  CHECK_EQ(chunks, (Chunk{0, 3, 3, 3, 6, 4, 10, 1}));  // [6, 10) ends clear of every span
}

TEST(a_prefix_hit_that_ends_inside_a_span_is_kept_and_the_chunk_runs_to_the_span_end) {
  Planner p(config(32, 4, /*chunk=*/2, /*budget=*/100));
  add(p, 1, range(100, 12), 1);
  while (p.request(1).num_computed < 12) report(p, plan(p));
  p.finish(1);
  // Positions [0, 8) are cached: the hit ends inside the span [6, 14) (its K/V was computed
  // with whatever computed it), and the first chunk completes the span past chunked_prefill_size.
  Tokens prompt = range(100, 8);
  for (int32_t t : range(500, 8)) prompt.push_back(t);
  add_spans(p, 2, prompt, 1, {6, 14});
  const Step s = plan(p);
  CHECK_EQ(chunk_of(s, 2), (Chunk{8, 6}));
  CHECK_EQ(p.request(2).cached_tokens, 8);
  report(p, s);
}

TEST(a_span_the_pool_cannot_hold_now_waits_whole_and_never_splits) {
  PlannerConfig c = config(7, 2, /*chunk=*/2, /*budget=*/100);
  c.init_reserve_ratio = 0.0;  // request 1's decodes take blocks admission did not reserve
  c.min_reserve_ratio = 0.0;
  c.enable_radix_cache = false;
  Planner p(c);
  Worker w;
  add(p, 1, range(100, 4), 8);
  add_spans(p, 2, range(200, 10), 1, {4, 10});
  Chunk chunks;  // request 2's entries: {start, num_tokens}, {-1, 0} for none
  for (int i = 0; i < 4; ++i) {
    const Step s = plan(p);
    w.run(s, 2);
    for (int32_t v : chunk_of(s, 2)) chunks.push_back(v);
    report(p, s);
  }
  // Steps 2 and 3: request 1's decode at position 4 left 2 free blocks; [4, 6) would fit, but
  // the span needs 3 blocks at once: it waits rather than split.
  CHECK_EQ(chunks, (Chunk{0, 2, 2, 2, -1, 0, -1, 0}));
  CHECK_EQ(p.num_free_blocks(), 2);
  p.finish(1);
  const Step s = plan(p);
  CHECK_EQ(chunk_of(s, 2), (Chunk{4, 6}));
  report(p, s);
}

TEST(spans_stay_with_a_retracted_request_and_bound_its_recompute) {
  PlannerConfig c = config(5, 2, /*chunk=*/2, /*budget=*/100);
  c.init_reserve_ratio = 0.0;
  c.min_reserve_ratio = 0.0;
  c.enable_radix_cache = false;
  Planner p(c);
  add(p, 1, {1, 2}, 6);
  add_spans(p, 2, {3, 4, 5}, 4, {0, 3});
  Step s = plan(p);
  CHECK_EQ(chunk_of(s, 2), (Chunk{0, 3}));
  for (int i = 0; i < 3; ++i) {
    report(p, s);
    s = plan(p);
  }
  CHECK_EQ(s.retracted, (std::vector<int64_t>{2}));  // request 1's decode at 6 needs a block
  report(p, s);
  p.finish(1);
  // The recompute covers prompt + output [0, 6) in chunks of 2, but the first runs over the span.
  Chunk chunks;
  for (int i = 0; i < 3; ++i) {
    s = plan(p);
    for (int32_t v : chunk_of(s, 2)) chunks.push_back(v);
    report(p, s);
  }
  CHECK_EQ(chunks, (Chunk{0, 3, 3, 2, 5, 1}));
}

TEST(add_request_rejects_bad_spans_naming_them) {
  Planner p(config(4, 2, 4, 8));
  const Tokens prompt = range(1, 4);
  for (const Tokens& bad :
       std::vector<Tokens>{{1}, {2, 2}, {3, 1}, {0, 5}, {-1, 2}, {0, 2, 1, 3}, {2, 4, 0, 1}}) {
    CHECK_THROWS(p.add_request(1, prompt, 1, true, bad), ValueError);
  }
  // A span the whole pool (4 blocks of 2) cannot hold with the positions before it.
  std::string message;
  try {
    p.add_request(2, range(1, 10), 1, true, {4, 10});
  } catch (const ValueError& e) {
    message = e.what();
  }
  CHECK(message.find("whole_spans[0] = [4, 10)") != std::string::npos);
  CHECK_EQ(p.num_waiting(), 0);
  add_spans(p, 3, prompt, 1, {0, 2, 2, 4});  // touching spans, one at position 0
  CHECK_EQ(p.num_waiting(), 1);
}

int main() { return check::run_all_tests(); }
