// Helpers for the planner tests: read a Step as entries, play the worker's side.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "check.h"
#include "planner.h"

namespace driver {

using pyserve::BlockId;
using pyserve::Planner;
using pyserve::PlannerConfig;
using pyserve::Step;
using Ids = std::vector<BlockId>;
using Tokens = std::vector<int32_t>;

struct Entry {
  int64_t rid;
  int32_t start;
  int32_t num_tokens;
  bool decode;
  bool sample;
  Tokens input;
  int32_t block_offset;
  Ids blocks;
};

inline std::vector<Entry> entries(const Step& s) {
  std::vector<Entry> out;
  size_t input_at = 0;
  size_t block_at = 0;
  for (size_t i = 0; i < s.num_entries(); ++i) {
    Entry e{s.rids[i],          s.start_pos[i],
            s.num_tokens[i],    s.is_decode[i] != 0,
            s.sample[i] != 0,   {},
            s.block_offsets[i], {}};
    // A decode entry's inputs are its drafts: every position but the first (none here when
    // the worker's draft model writes them).
    const int32_t num_inputs = s.is_decode[i] == 2 ? 0 : e.decode ? e.num_tokens - 1 : e.num_tokens;
    e.input.assign(s.input_ids.begin() + static_cast<int64_t>(input_at),
                   s.input_ids.begin() + static_cast<int64_t>(input_at) + num_inputs);
    input_at += static_cast<size_t>(num_inputs);
    e.blocks.assign(s.block_ids.begin() + static_cast<int64_t>(block_at),
                    s.block_ids.begin() + static_cast<int64_t>(block_at) + s.block_counts[i]);
    block_at += static_cast<size_t>(s.block_counts[i]);
    out.push_back(e);
  }
  return out;
}

inline std::optional<Entry> entry_for(const Step& s, int64_t rid) {
  for (const Entry& e : entries(s)) {
    if (e.rid == rid) return e;
  }
  return std::nullopt;
}

inline std::vector<int64_t> rids(const Step& s) { return s.rids; }

// The worker's side: block tables rebuilt from the Steps' deltas.
struct Worker {
  std::map<int64_t, Ids> tables;

  void run(const Step& s, int32_t block_size) {
    for (int64_t rid : s.dropped) tables.erase(rid);
    for (const Entry& e : entries(s)) {
      Ids& t = tables[e.rid];
      CHECK(e.block_offset <= static_cast<int32_t>(t.size()));
      t.resize(static_cast<size_t>(e.block_offset));
      t.insert(t.end(), e.blocks.begin(), e.blocks.end());
      // The table must cover every position the entry writes.
      CHECK(static_cast<int64_t>(t.size()) * block_size >= e.start + e.num_tokens);
    }
  }
};

inline Step plan(Planner& p) {
  std::optional<Step> s = p.plan();
  CHECK(s.has_value());
  p.check_invariants();
  return *s;
}

// Reports every sampling entry of s, with token(rid) as its sample.
inline void report(Planner& p, const Step& s, const std::function<int32_t(int64_t)>& token) {
  std::vector<int64_t> sampled;
  Tokens tokens;
  for (size_t i = 0; i < s.num_entries(); ++i) {
    if (!s.sample[i]) continue;
    sampled.push_back(s.rids[i]);
    tokens.push_back(token(s.rids[i]));
  }
  p.report(s.step_id, sampled.data(), sampled.size(), tokens.data(), tokens.size());
  p.check_invariants();
}

inline void report(Planner& p, const Step& s, int32_t token = 7) {
  report(p, s, [token](int64_t) { return token; });
}

inline void add(Planner& p, int64_t rid, const Tokens& prompt, int64_t max_new_tokens) {
  p.add_request(rid, prompt, max_new_tokens);
  p.check_invariants();
}

inline Tokens range(int32_t first, int32_t count) {
  Tokens t;
  for (int32_t i = 0; i < count; ++i) t.push_back(first + i);
  return t;
}

inline int64_t count_state(const Planner& p, uint8_t state) {
  int64_t n = 0;
  for (uint8_t s : p.block_states()) n += s == state ? 1 : 0;
  return n;
}

}  // namespace driver
