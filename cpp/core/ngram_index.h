// N-gram draft lookup for speculative decoding: propose the tokens that followed an earlier
// occurrence of the context's last n tokens.
//
// - NgramIndex is one request's history (prompt + output so far), appended to as tokens
//   arrive. draft() finds the most recent earlier occurrence of the longest suffix of the
//   history (n from max_match down to min_match) and returns the tokens that followed it, up to
//   max_tokens and never past the history's end.
// - NgramCorpus holds completed sequences (what earlier requests ended with), under a token
//   budget with oldest-first eviction, so an agent loop or a repeated template can draft from
//   what other requests already produced. draft(context) returns the continuation, within its
//   own sequence, after the most recent occurrence of the context's longest matching suffix.
// - ngram_draft() combines the two (the longer match wins, see there).
//
// Both keep, for each n in [1, max_ngram], a hash table from an n-gram's hash to the start of
// its most recent occurrence, and per start position a link to the previous occurrence with the
// same hash. A lookup walks that chain comparing tokens, so a hash collision can cost a step but
// never change the answer: the result is exactly what a scan of the whole history would give,
// in O(max_match) expected time. An n-gram is indexed only once a token follows it (in the same
// sequence), so every hit has a continuation and the history's own suffix never matches itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pyserve {

constexpr int32_t kMaxNgram = 64;  // longer n-grams cost memory per token and add nothing

struct NgramDraft {
  int32_t match = 0;            // length of the matched suffix; 0 when nothing matched
  std::vector<int32_t> tokens;  // the proposed continuation
};

// ValueError unless 0 <= max_tokens, 1 <= min_match <= max_match <= max_ngram.
void check_draft_args(int64_t max_tokens, int64_t min_match, int64_t max_match, int32_t max_ngram);

// Tokens at global positions with hashed n-gram chains. Positions keep growing; positions below
// begin() are dropped (their storage is reclaimed in bulk).
class NgramStore {
 public:
  // hash_mask keeps only some bits of each hash: tests narrow it to force collisions.
  NgramStore(int32_t max_ngram, int64_t vocab_size, uint64_t hash_mask = ~0ULL);

  int32_t max_ngram() const { return max_ngram_; }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t begin() const { return begin_; }
  int64_t end() const { return base_ + static_cast<int64_t>(tokens_.size()); }
  int32_t at(int64_t pos) const { return tokens_[static_cast<size_t>(pos - base_)]; }
  const int32_t* data_at(int64_t pos) const { return tokens_.data() + (pos - base_); }

  // ValueError naming the first token outside [0, vocab_size).
  void check_tokens(const int32_t* tokens, size_t n, const char* what) const;
  void push(const int32_t* tokens, size_t n);
  // Indexes the n-grams that end just before `x` (they are followed by the token at x) and start
  // at or after `lo`. Calls must come in increasing x.
  void index_end(int64_t x, int64_t lo);
  // Forgets the chain heads index_end(x, lo) set that nothing newer replaced (before a drop).
  void unindex_end(int64_t x, int64_t lo);
  // The start of the most recent indexed occurrence of key[0, n) at or after begin(), or -1.
  // hash is ngram_hash(key, n).
  int64_t find(const int32_t* key, int32_t n, uint64_t hash) const;
  void drop_before(int64_t pos);
  void clear();

  // hashes[n - 1] = hash of the n tokens ending just before `last_end`, for n = 1..count.
  void suffix_hashes(const int32_t* last_end, int32_t count, uint64_t* hashes) const;
  // The longest suffix of the `top` tokens ending just before `last_end` (n from top down to
  // min_match) that occurs indexed: {start of its most recent occurrence, n}, or {-1, 0}.
  std::pair<int64_t, int32_t> longest_match(const int32_t* last_end, int32_t top,
                                            int64_t min_match) const;

 private:
  int32_t max_ngram_;
  int64_t vocab_size_;
  uint64_t hash_mask_;
  int64_t base_ = 0;   // global position of tokens_[0]
  int64_t begin_ = 0;  // first live position
  std::vector<int32_t> tokens_;
  // Per n - 1: hash -> start of the most recent occurrence.
  std::vector<std::unordered_map<uint64_t, int64_t>> heads_;
  // Per n - 1, parallel to tokens_ by start: distance back to the previous start with the same
  // hash, 0 for none. 32 bits: a live window never spans 2**31 tokens, so a longer distance
  // points at a dropped position and is stored as none.
  std::vector<std::vector<uint32_t>> prev_;
};

class NgramIndex {
 public:
  explicit NgramIndex(int32_t max_ngram, int64_t vocab_size = 2147483647,
                      uint64_t hash_mask = ~0ULL);

  int32_t max_ngram() const { return store_.max_ngram(); }
  int64_t size() const { return store_.end(); }
  const int32_t* data() const { return store_.data_at(0); }

  // O(n * max_ngram); ValueError (nothing appended) for a token out of range.
  void append(const int32_t* tokens, size_t n);
  NgramDraft draft(int64_t max_tokens, int64_t min_match, int64_t max_match) const;
  // The same for the history followed by extra[0, n_extra), tokens not (yet) in it: drafts
  // behind tokens assumed to come, such as drafts still being verified.
  NgramDraft draft_after(const int32_t* extra, size_t n_extra, int64_t max_tokens,
                         int64_t min_match, int64_t max_match) const;
  // The last min(count, size() + n_extra) tokens of the history followed by extra.
  std::vector<int32_t> tail(const int32_t* extra, size_t n_extra, size_t count) const;

 private:
  NgramStore store_;
};

class NgramCorpus {
 public:
  NgramCorpus(int32_t max_ngram, int64_t token_budget, int64_t vocab_size = 2147483647,
              uint64_t hash_mask = ~0ULL);

  int32_t max_ngram() const { return store_.max_ngram(); }
  int64_t token_budget() const { return token_budget_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_sequences() const { return static_cast<int64_t>(sequences_.size()); }

  // Adds a completed sequence, then evicts the oldest sequences until the corpus fits its
  // budget. A sequence longer than the whole budget keeps only its last token_budget tokens (the
  // output end is what a later request is likeliest to repeat); an empty one is not stored.
  // ValueError (nothing changed) for a token out of range.
  void add_sequence(const int32_t* tokens, size_t n);
  // Drafts for a request whose history ends with context[0, n) (only its last max_match tokens
  // are read).
  NgramDraft draft(const int32_t* context, size_t n, int64_t max_tokens, int64_t min_match,
                   int64_t max_match) const;
  void clear();

 private:
  void evict_oldest();

  NgramStore store_;
  int64_t token_budget_;
  int64_t num_tokens_ = 0;
  std::deque<std::pair<int64_t, int64_t>>
      sequences_;  // [start, end) global positions, oldest first
};

// The combined policy: the request's own history and the corpus are both looked up, and the
// longer matched suffix wins, because a longer match is stronger evidence that the continuation
// repeats whichever history it comes from; on a tie the request's own history wins, as it
// reflects this request's content (its variable names, its quoted text). corpus may be null.
NgramDraft ngram_draft(const NgramIndex& request, const NgramCorpus* corpus, int64_t max_tokens,
                       int64_t min_match, int64_t max_match);
// The same for the request's history followed by extra[0, n_extra) (NgramIndex::draft_after).
NgramDraft ngram_draft_after(const NgramIndex& request, const int32_t* extra, size_t n_extra,
                             const NgramCorpus* corpus, int64_t max_tokens, int64_t min_match,
                             int64_t max_match);

}  // namespace pyserve
