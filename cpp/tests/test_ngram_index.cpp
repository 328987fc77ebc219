// NgramIndex, NgramCorpus and ngram_draft, as a specification, then against a brute-force scan
// on random histories over a tiny vocabulary (so n-grams repeat and hashes share chains).
#include "ngram_index.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "check.h"
#include "errors.h"

using pyserve::NgramCorpus;
using pyserve::NgramIndex;
using pyserve::ValueError;
using Tokens = std::vector<int32_t>;

namespace {

NgramIndex index_of(const Tokens& tokens, int32_t max_ngram = 4) {
  NgramIndex index(max_ngram);
  index.append(tokens.data(), tokens.size());
  return index;
}

Tokens draft(const NgramIndex& index, int64_t max_tokens, int64_t min_match, int64_t max_match) {
  return index.draft(max_tokens, min_match, max_match).tokens;
}

Tokens corpus_draft(const NgramCorpus& corpus, const Tokens& context, int64_t max_tokens,
                    int64_t min_match, int64_t max_match) {
  return corpus.draft(context.data(), context.size(), max_tokens, min_match, max_match).tokens;
}

void add(NgramCorpus& corpus, const Tokens& tokens) {
  corpus.add_sequence(tokens.data(), tokens.size());
}

// The obvious scan: for n from max_match down, the latest start p with p + n < the end of the
// same sequence whose n tokens equal the context's last n.
Tokens scan(const std::vector<Tokens>& sequences, const Tokens& context, bool exclude_self,
            int64_t max_tokens, int64_t min_match, int64_t max_match) {
  if (max_tokens == 0) return {};
  const int64_t len = static_cast<int64_t>(context.size());
  for (int64_t n = std::min(max_match, len); n >= min_match; --n) {
    for (auto seq = sequences.rbegin(); seq != sequences.rend(); ++seq) {
      const int64_t seq_len = static_cast<int64_t>(seq->size());
      for (int64_t p = seq_len - n - 1; p >= 0; --p) {
        if (exclude_self && p + n >= len) continue;
        if (std::equal(seq->begin() + p, seq->begin() + p + n, context.end() - n)) {
          const int64_t to = std::min(p + n + max_tokens, seq_len);
          return Tokens(seq->begin() + p + n, seq->begin() + to);
        }
      }
    }
  }
  return {};
}

}  // namespace

TEST(request_drafts_the_continuation_of_the_latest_longest_match) {
  // ... 1 2 3 [4 5] ... 9 2 3 [7] ... 2 3: the 2-gram "2 3" last occurred before 7.
  const Tokens h = {1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3};
  NgramIndex index = index_of(h);
  CHECK_EQ(draft(index, 3, 1, 4), (Tokens{7, 8, 2}));
  // A longer suffix wins over a more recent shorter one: "1 2 3" occurs only at the start.
  const Tokens g = {1, 2, 3, 4, 5, 2, 3, 6, 1, 2, 3};
  CHECK_EQ(draft(index_of(g), 2, 1, 3), (Tokens{4, 5}));
  CHECK_EQ(draft(index_of(g), 2, 1, 2), (Tokens{6, 1}));
}

TEST(request_draft_stops_at_the_history_end) {
  // The earlier "5 5" overlaps the suffix; its continuation is only the history's last token.
  CHECK_EQ(draft(index_of({5, 5, 5}), 4, 1, 4), (Tokens{5}));
  CHECK_EQ(draft(index_of({1, 2, 1, 2}), 10, 2, 2), (Tokens{1, 2}));
}

TEST(request_edge_cases) {
  NgramIndex empty(4);
  CHECK_EQ(draft(empty, 4, 1, 4), Tokens{});
  CHECK_EQ(draft(index_of({7}), 4, 1, 4), Tokens{});
  // The suffix occurs only at the very end: nothing earlier to copy.
  CHECK_EQ(draft(index_of({1, 2, 3}), 4, 1, 4), Tokens{});
  CHECK_EQ(draft(index_of({1, 2, 1, 2}), 0, 1, 4), Tokens{});
  CHECK_EQ(index_of({1, 2, 1, 2}).draft(3, 1, 4).match, 2);
  // min_match longer than any repeat.
  CHECK_EQ(draft(index_of({1, 2, 1, 3, 1}), 4, 2, 4), Tokens{});
}

TEST(request_appends_incrementally) {
  NgramIndex index(3);
  const Tokens h = {4, 1, 2, 4, 1, 3, 4, 1};
  for (size_t i = 0; i < h.size(); ++i) {
    index.append(&h[i], 1);
    const Tokens prefix(h.begin(), h.begin() + static_cast<std::ptrdiff_t>(i + 1));
    CHECK_EQ(draft(index, 3, 1, 3), scan({prefix}, prefix, true, 3, 1, 3));
  }
  CHECK_EQ(draft(index, 3, 1, 3), (Tokens{3, 4, 1}));
}

TEST(bad_arguments_raise_value_error) {
  NgramIndex index = index_of({1, 2, 1, 2}, 4);
  CHECK_THROWS(index.draft(-1, 1, 4), ValueError);
  CHECK_THROWS(index.draft(2, 0, 4), ValueError);
  CHECK_THROWS(index.draft(2, 3, 2), ValueError);
  CHECK_THROWS(index.draft(2, 1, 5), ValueError);  // beyond max_ngram
  CHECK_THROWS(NgramIndex(0), ValueError);
  CHECK_THROWS(NgramIndex(pyserve::kMaxNgram + 1), ValueError);
  CHECK_THROWS(NgramCorpus(4, -1), ValueError);
  NgramIndex small(2, 10);
  const Tokens bad = {1, 10};
  CHECK_THROWS(small.append(bad.data(), bad.size()), ValueError);
  CHECK_EQ(small.size(), 0);  // nothing appended
  const Tokens negative = {-1};
  CHECK_THROWS(small.append(negative.data(), negative.size()), ValueError);
  NgramCorpus corpus(2, 100, 10);
  CHECK_THROWS(add(corpus, bad), ValueError);
  CHECK_EQ(corpus.num_tokens(), 0);
  CHECK_THROWS(corpus_draft(corpus, bad, 2, 1, 2), ValueError);
}

TEST(corpus_drafts_within_one_sequence_latest_first) {
  NgramCorpus corpus(4, 100);
  add(corpus, {1, 2, 3, 4});
  add(corpus, {9, 2, 3, 5, 6});
  add(corpus, {1, 2});  // "1 2" here has nothing after it
  CHECK_EQ(corpus_draft(corpus, {7, 2, 3}, 2, 1, 4), (Tokens{5, 6}));
  CHECK_EQ(corpus_draft(corpus, {1, 2, 3}, 9, 1, 4), (Tokens{4}));
  CHECK_EQ(corpus_draft(corpus, {8, 8, 1, 2}, 9, 1, 4), (Tokens{3, 4}));
  CHECK_EQ(corpus_draft(corpus, {6}, 9, 1, 4), Tokens{});  // never followed by anything
  CHECK_EQ(corpus_draft(corpus, {}, 9, 1, 4), Tokens{});
  CHECK_EQ(corpus.draft(nullptr, 0, 9, 1, 4).match, 0);
}

TEST(corpus_evicts_oldest_first_under_its_budget) {
  NgramCorpus corpus(2, 6);
  add(corpus, {1, 2, 3});
  add(corpus, {1, 2, 4});
  CHECK_EQ(corpus.num_sequences(), 2);
  CHECK_EQ(corpus_draft(corpus, {1}, 2, 1, 2), (Tokens{2, 4}));
  add(corpus, {5, 1});  // 8 tokens: the first sequence goes
  CHECK_EQ(corpus.num_tokens(), 5);
  CHECK_EQ(corpus.num_sequences(), 2);
  CHECK_EQ(corpus_draft(corpus, {2}, 2, 1, 2), (Tokens{4}));
  CHECK_EQ(corpus_draft(corpus, {5}, 2, 1, 2), (Tokens{1}));
  add(corpus, {7, 8, 9, 7, 8, 9, 7, 1});  // longer than the budget: its last 6 tokens stay
  CHECK_EQ(corpus.num_tokens(), 6);
  CHECK_EQ(corpus.num_sequences(), 1);
  CHECK_EQ(corpus_draft(corpus, {7, 8}, 9, 1, 2), (Tokens{9, 7, 1}));
  CHECK_EQ(corpus_draft(corpus, {2}, 2, 1, 2), Tokens{});
  corpus.clear();
  CHECK_EQ(corpus.num_tokens(), 0);
  CHECK_EQ(corpus_draft(corpus, {7, 8}, 9, 1, 2), Tokens{});
  NgramCorpus none(2, 0);
  add(none, {1, 2, 1});
  CHECK_EQ(none.num_sequences(), 0);
}

TEST(combined_draft_prefers_the_longer_match_then_the_request) {
  NgramCorpus corpus(4, 100);
  add(corpus, {1, 2, 3, 9, 9});
  NgramIndex index = index_of({5, 3, 6, 1, 2, 3});  // own match: "3" -> 6
  CHECK_EQ(pyserve::ngram_draft(index, &corpus, 2, 1, 4).tokens, (Tokens{9, 9}));
  CHECK_EQ(pyserve::ngram_draft(index, nullptr, 2, 1, 4).tokens, (Tokens{6, 1}));
  NgramCorpus same(4, 100);
  add(same, {3, 8});  // as long as the request's own match: the request wins
  CHECK_EQ(pyserve::ngram_draft(index, &same, 2, 1, 4).tokens, (Tokens{6, 1}));
  NgramCorpus narrow(2, 100);
  CHECK_THROWS(pyserve::ngram_draft(index, &narrow, 2, 1, 3), ValueError);
}

// hash_mask 3 puts every n-gram in one of four chains: lookups must still be exact.
static void random_histories(uint64_t hash_mask, uint32_t seed) {
  std::mt19937 rng(seed);
  for (int trial = 0; trial < 300; ++trial) {
    const int32_t vocab = 1 + static_cast<int32_t>(rng() % 4);
    const int32_t max_ngram = 1 + static_cast<int32_t>(rng() % 5);
    const int64_t budget = static_cast<int64_t>(rng() % 40);
    NgramIndex index(max_ngram, 2147483647, hash_mask);
    NgramCorpus corpus(max_ngram, budget, 2147483647, hash_mask);
    Tokens history;
    std::vector<Tokens> kept;  // what the corpus should hold
    int64_t kept_tokens = 0;
    for (int op = 0; op < 40; ++op) {
      Tokens chunk(rng() % 6);
      for (auto& t : chunk) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
      if (rng() % 3 == 0) {
        add(corpus, chunk);
        if (static_cast<int64_t>(chunk.size()) > budget) {
          chunk.erase(chunk.begin(), chunk.end() - budget);
        }
        if (!chunk.empty()) {
          kept_tokens += static_cast<int64_t>(chunk.size());
          kept.push_back(chunk);
          while (kept_tokens > budget) {
            kept_tokens -= static_cast<int64_t>(kept.front().size());
            kept.erase(kept.begin());
          }
        }
        CHECK_EQ(corpus.num_tokens(), kept_tokens);
      } else {
        index.append(chunk.data(), chunk.size());
        history.insert(history.end(), chunk.begin(), chunk.end());
      }
      const int64_t max_match = 1 + static_cast<int64_t>(rng() % max_ngram);
      const int64_t min_match = 1 + static_cast<int64_t>(rng() % max_match);
      const int64_t max_tokens = static_cast<int64_t>(rng() % 5);
      CHECK_EQ(draft(index, max_tokens, min_match, max_match),
               scan({history}, history, true, max_tokens, min_match, max_match));
      // behind tokens not in the history (drafts assumed accepted): occurrences in it only
      Tokens extra(rng() % 4);
      for (int32_t& t : extra) t = static_cast<int32_t>(rng() % 4);
      Tokens context = history;
      context.insert(context.end(), extra.begin(), extra.end());
      CHECK_EQ(
          index.draft_after(extra.data(), extra.size(), max_tokens, min_match, max_match).tokens,
          scan({history}, context, extra.empty(), max_tokens, min_match, max_match));
      CHECK_EQ(corpus_draft(corpus, history, max_tokens, min_match, max_match),
               scan(kept, history, false, max_tokens, min_match, max_match));
    }
  }
}

TEST(random_histories_match_a_scan) { random_histories(~0ULL, 12345); }

TEST(random_histories_match_a_scan_when_hashes_collide) {
  random_histories(3, 777);
  random_histories(0, 778);
}

int main() { return check::run_all_tests(); }
