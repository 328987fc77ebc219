// Random interleavings of add / plan / report (up to two steps in flight) / finish / abort /
// evict / flush, checked after every operation. A shadow worker executes each Step on a shadow
// KV pool that records which token each slot holds, and demands what the real worker relies on:
// every position a step reads holds exactly that request's token, prefill inputs are the
// request's tokens, and tables cover what is written; with whole spans, no prefill entry ends
// strictly inside one, and only an entry that completes a span passes the budgets. Runs under
// the sanitizers in CI.
#include <deque>
#include <map>
#include <random>
#include <set>
#include <string>

#include "check.h"
#include "errors.h"
#include "planner.h"
#include "planner_driver.h"

using namespace driver;

namespace {

constexpr int32_t kEos = 0;

struct Soak {
  Planner planner;
  int32_t block_size;
  std::mt19937 rng;
  std::vector<int32_t> kv;             // token held by each slot, -1 unwritten
  std::map<int64_t, Tokens> sequence;  // the worker's view: prompt + every sampled token
  std::map<int64_t, Ids> tables;
  std::map<int64_t, int64_t> max_new;
  std::deque<std::pair<Step, std::vector<std::pair<int64_t, int32_t>>>> inflight;
  std::set<int64_t> live;  // added and not finished or aborted by us
  int64_t next_rid = 0;
  bool with_spans = false;
  std::map<int64_t, Tokens> spans;  // each request's whole spans, flat [start, end) pairs

  Soak(const PlannerConfig& c, uint32_t seed)
      : planner(c),
        block_size(static_cast<int32_t>(c.block_size)),
        rng(seed),
        kv(static_cast<size_t>(c.num_blocks * c.block_size), -1) {}

  int32_t pick(int32_t n) { return static_cast<int32_t>(rng() % static_cast<uint32_t>(n)); }

  void add() {
    static const Tokens prefixes[] = {{}, {5, 6, 7, 8, 9, 10}, {5, 6, 7, 8, 1, 2, 3}, {4, 4, 4}};
    Tokens prompt = prefixes[pick(4)];
    for (int32_t n = pick(6); n >= 0; --n) prompt.push_back(1 + pick(6));
    const int64_t rid = next_rid++;
    const int64_t max_new_tokens = 1 + pick(8);
    Tokens flat;
    const int32_t len = static_cast<int32_t>(prompt.size());
    // Spans at 0 now and then, touching or apart, some longer than a chunk.
    for (int32_t pos = pick(3); with_spans && pos < len;) {
      const int32_t end = std::min(len, pos + 1 + pick(6));
      if (pick(3) > 0) {
        flat.push_back(pos);
        flat.push_back(end);
      }
      pos = end + pick(2);
    }
    planner.add_request(rid, prompt, max_new_tokens, true, flat);
    spans[rid] = flat;
    sequence[rid] = prompt;
    max_new[rid] = max_new_tokens;
    live.insert(rid);
  }

  size_t slot(int64_t rid, int64_t pos) {
    const Ids& t = tables[rid];
    CHECK(pos / block_size < static_cast<int64_t>(t.size()));
    return static_cast<size_t>(t[static_cast<size_t>(pos / block_size)]) * block_size +
           static_cast<size_t>(pos % block_size);
  }

  // The worker: reads the cached positions, writes the new ones, samples.
  void execute(const Step& s) {
    for (int64_t rid : s.dropped) {
      tables.erase(rid);
      sequence.erase(rid);
    }
    std::vector<std::pair<int64_t, int32_t>> sampled;
    for (const Entry& e : entries(s)) {
      Ids& t = tables[e.rid];
      CHECK(e.block_offset <= static_cast<int32_t>(t.size()));
      t.resize(static_cast<size_t>(e.block_offset));
      t.insert(t.end(), e.blocks.begin(), e.blocks.end());
      const Tokens& seq = sequence.at(e.rid);
      CHECK(e.start + e.num_tokens <= static_cast<int32_t>(seq.size()));
      for (int32_t pos = 0; pos < e.start; ++pos) {
        CHECK_EQ(kv[slot(e.rid, pos)], seq[static_cast<size_t>(pos)]);
      }
      if (e.decode) {
        CHECK_EQ(e.start + 1, static_cast<int32_t>(seq.size()));
      } else {
        CHECK_EQ(e.input, Tokens(seq.begin() + e.start, seq.begin() + e.start + e.num_tokens));
      }
      for (int32_t pos = e.start; pos < e.start + e.num_tokens; ++pos) {
        kv[slot(e.rid, pos)] = seq[static_cast<size_t>(pos)];
      }
      if (e.sample) sampled.emplace_back(e.rid, pick(7));  // small vocab: prefixes collide
    }
    for (const auto& [rid, token] : sampled) sequence[rid].push_back(token);
    inflight.emplace_back(s, sampled);
  }

  void plan() {
    std::optional<Step> s = planner.plan();
    if (!s) return;
    CHECK(static_cast<int64_t>(s->num_entries()) <= planner.config().max_running_requests);
    const PlannerConfig& c = planner.config();
    int64_t before_last = 0;  // prefill tokens before the last prefill entry
    std::optional<Entry> last;
    for (const Entry& e : entries(*s)) {
      if (e.decode) continue;
      const Tokens& sp = spans.at(e.rid);
      bool completes = false;  // starts inside a span (or at its start), ends at its end
      for (size_t i = 0; i < sp.size(); i += 2) {
        CHECK(!(sp[i] < e.start + e.num_tokens && e.start + e.num_tokens < sp[i + 1]));
        completes = completes || (sp[i] <= e.start && e.start + e.num_tokens == sp[i + 1]);
      }
      CHECK(e.num_tokens <= c.chunked_prefill_size || completes);
      if (last) before_last += last->num_tokens;
      last = e;
    }
    if (s->num_prefill_tokens > c.max_prefill_tokens) {
      const Tokens& sp = spans.at(last->rid);
      bool completes = false;
      for (size_t i = 0; i < sp.size(); i += 2) {
        completes =
            completes || (sp[i] <= last->start && last->start + last->num_tokens == sp[i + 1]);
      }
      CHECK(completes && before_last < c.max_prefill_tokens);
    }
    execute(*s);
  }

  // Main's side of a StepDone: report, then finish what hit EOS or its length.
  void report() {
    auto [s, sampled] = inflight.front();
    inflight.pop_front();
    std::vector<int64_t> rids_;
    Tokens tokens;
    for (const auto& [rid, token] : sampled) {
      rids_.push_back(rid);
      tokens.push_back(token);
    }
    planner.report(s.step_id, rids_.data(), rids_.size(), tokens.data(), tokens.size());
    for (const auto& [rid, token] : sampled) {
      if (!live.count(rid)) continue;
      const auto info = planner.request(rid);
      if (token == kEos || info.output_len >= max_new.at(rid)) finish(rid);
    }
  }

  void finish(int64_t rid) {
    planner.finish(rid);
    live.erase(rid);
  }

  void random_op() {
    const int32_t op = pick(100);
    if (op < 20) {
      add();
    } else if (op < 55) {
      if (inflight.size() < 2) plan();
    } else if (op < 85) {
      if (!inflight.empty()) report();
    } else if (op < 90) {
      const int64_t rid = pick(static_cast<int32_t>(next_rid + 2));
      const bool was_live = live.erase(rid) > 0;
      CHECK_EQ(planner.abort(rid), was_live);
    } else if (op < 97) {
      planner.cache().evict(pick(4));
    } else {
      planner.flush_cache();
    }
    planner.check_invariants();
  }

  void drain() {
    for (int n = 0; n < 10000 && (!live.empty() || !inflight.empty()); ++n) {
      if (inflight.size() < 2) plan();
      if (!inflight.empty()) report();
      planner.check_invariants();
    }
    CHECK(live.empty());
    while (!inflight.empty() || planner.num_inflight_steps() == 0) {
      if (!inflight.empty()) report();
      std::optional<Step> s = planner.plan();  // hands over the last dropped rids
      if (!s) break;
      execute(*s);
    }
    while (!inflight.empty()) report();
    planner.flush_cache();
    planner.check_invariants();
    CHECK_EQ(planner.num_free_blocks(), planner.allocator().num_blocks());
    CHECK_EQ(planner.stats().num_requests, 0);
  }
};

// Returns the number of retractions, so a test can demand that it exercised them.
int64_t soak(PlannerConfig c, uint32_t seed, int ops, bool with_spans = false) {
  c.vocab_size = 16;
  Soak s(c, seed);
  s.with_spans = with_spans;
  for (int i = 0; i < ops; ++i) s.random_op();
  const int64_t retractions = s.planner.stats().retractions;
  s.drain();
  return retractions;
}

PlannerConfig config(int64_t num_blocks, int64_t block_size) {
  PlannerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  return c;
}

}  // namespace

TEST(random_runs_with_a_roomy_pool) {
  for (uint32_t seed = 1; seed <= 4; ++seed) soak(config(64, 2), seed, 3000);
}

TEST(random_runs_with_a_tight_pool_that_forces_retractions) {
  int64_t retractions = 0;
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    PlannerConfig c = config(11, 2);  // the longest request (14 + 8 tokens) just fits
    c.init_reserve_ratio = 0.2;
    c.min_reserve_ratio = 0.0;
    c.reserve_decay = 0.05;
    retractions += soak(c, seed, 3000);
  }
  CHECK(retractions > 0);
}

TEST(random_runs_with_small_chunks_and_lpm) {
  for (uint32_t seed = 1; seed <= 4; ++seed) {
    PlannerConfig c = config(24, 1);
    c.policy = "lpm";
    c.chunked_prefill_size = 3;
    c.max_prefill_tokens = 5;
    c.max_running_requests = 3;
    soak(c, seed, 3000);
  }
}

TEST(random_runs_without_the_radix_cache) {
  for (uint32_t seed = 1; seed <= 3; ++seed) {
    PlannerConfig c = config(16, 4);
    c.enable_radix_cache = false;
    soak(c, seed, 1000);
  }
}

TEST(random_runs_with_whole_spans) {
  int64_t retractions = 0;
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    const int64_t block_size = seed % 3 ? 2 : 1;
    PlannerConfig c = config(22 / block_size, block_size);  // the longest request just fits
    c.policy = seed % 2 ? "fcfs" : "lpm";
    c.chunked_prefill_size = 1 + seed % 3;
    c.max_prefill_tokens = 2 + seed % 4;
    c.init_reserve_ratio = 0.2;
    c.min_reserve_ratio = 0.0;
    c.reserve_decay = 0.05;
    c.enable_radix_cache = seed != 5;
    retractions += soak(c, seed, 3000, /*with_spans=*/true);
  }
  CHECK(retractions > 0);
}

int main() { return check::run_all_tests(); }
