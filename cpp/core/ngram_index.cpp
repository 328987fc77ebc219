#include "ngram_index.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>

#include "errors.h"

namespace pyserve {

namespace {

// splitmix64's finalizer: a cheap mix whose output bits all depend on every input bit.
uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

void require(bool ok, const std::string& message) {
  if (!ok) throw ValueError(message);
}

void check_max_ngram(int32_t max_ngram) {
  require(max_ngram >= 1 && max_ngram <= kMaxNgram, "max_ngram must be in [1, " +
                                                        std::to_string(kMaxNgram) + "], got " +
                                                        std::to_string(max_ngram));
}

void check_vocab_size(int64_t vocab_size) {
  require(vocab_size >= 1 && vocab_size <= std::numeric_limits<int32_t>::max(),
          "vocab_size must be in [1, 2**31-1], got " + std::to_string(vocab_size));
}

}  // namespace

void check_draft_args(int64_t max_tokens, int64_t min_match, int64_t max_match, int32_t max_ngram) {
  require(max_tokens >= 0, "max_tokens must be >= 0, got " + std::to_string(max_tokens));
  require(min_match >= 1, "min_match must be >= 1, got " + std::to_string(min_match));
  require(min_match <= max_match, "min_match (" + std::to_string(min_match) +
                                      ") must not exceed max_match (" + std::to_string(max_match) +
                                      ")");
  require(max_match <= max_ngram, "max_match (" + std::to_string(max_match) +
                                      ") exceeds the index's max_ngram (" +
                                      std::to_string(max_ngram) + ")");
}

// ------------------------------------------------------------------------------------------
// NgramStore

NgramStore::NgramStore(int32_t max_ngram, int64_t vocab_size, uint64_t hash_mask)
    : max_ngram_(max_ngram), vocab_size_(vocab_size), hash_mask_(hash_mask) {
  check_max_ngram(max_ngram);
  check_vocab_size(vocab_size);
  heads_.resize(static_cast<size_t>(max_ngram));
  prev_.resize(static_cast<size_t>(max_ngram));
}

void NgramStore::check_tokens(const int32_t* tokens, size_t n, const char* what) const {
  for (size_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_size_) {
      throw ValueError(std::string(what) + "[" + std::to_string(i) +
                       "] = " + std::to_string(tokens[i]) + " is out of range [0, " +
                       std::to_string(vocab_size_) + ")");
    }
  }
}

void NgramStore::suffix_hashes(const int32_t* last_end, int32_t count, uint64_t* hashes) const {
  uint64_t h = 0x9e3779b97f4a7c15ULL;
  for (int32_t n = 1; n <= count; ++n) {
    h = mix(h + static_cast<uint32_t>(last_end[-n]));
    hashes[n - 1] = h & hash_mask_;
  }
}

void NgramStore::push(const int32_t* tokens, size_t n) {
  tokens_.insert(tokens_.end(), tokens, tokens + n);
  for (auto& p : prev_) p.resize(tokens_.size(), 0);
}

void NgramStore::index_end(int64_t x, int64_t lo) {
  const int32_t count = static_cast<int32_t>(std::min<int64_t>(max_ngram_, x - lo));
  if (count <= 0) return;
  uint64_t hashes[kMaxNgram];
  suffix_hashes(data_at(x), count, hashes);
  for (int32_t n = 1; n <= count; ++n) {
    const int64_t start = x - n;
    auto [it, inserted] = heads_[static_cast<size_t>(n - 1)].try_emplace(hashes[n - 1], start);
    if (!inserted) {
      const int64_t back = start - it->second;
      prev_[static_cast<size_t>(n - 1)][static_cast<size_t>(start - base_)] =
          back <= std::numeric_limits<uint32_t>::max() ? static_cast<uint32_t>(back) : 0;
      it->second = start;
    }
  }
}

void NgramStore::unindex_end(int64_t x, int64_t lo) {
  const int32_t count = static_cast<int32_t>(std::min<int64_t>(max_ngram_, x - lo));
  if (count <= 0) return;
  uint64_t hashes[kMaxNgram];
  suffix_hashes(data_at(x), count, hashes);
  for (int32_t n = 1; n <= count; ++n) {
    auto& heads = heads_[static_cast<size_t>(n - 1)];
    auto it = heads.find(hashes[n - 1]);
    // Eviction is oldest first, so a head still at x - n has no live occurrence behind it.
    if (it != heads.end() && it->second == x - n) heads.erase(it);
  }
}

int64_t NgramStore::find(const int32_t* key, int32_t n, uint64_t hash) const {
  const auto& heads = heads_[static_cast<size_t>(n - 1)];
  auto it = heads.find(hash);
  if (it == heads.end()) return -1;
  const auto& prev = prev_[static_cast<size_t>(n - 1)];
  int64_t start = it->second;
  while (start >= begin_) {
    if (std::memcmp(data_at(start), key, static_cast<size_t>(n) * sizeof(int32_t)) == 0) {
      return start;
    }
    const uint32_t back = prev[static_cast<size_t>(start - base_)];
    if (back == 0) return -1;
    start -= back;
  }
  return -1;
}

void NgramStore::drop_before(int64_t pos) {
  begin_ = std::max(begin_, pos);
  const size_t dead = static_cast<size_t>(begin_ - base_);
  // Reclaim in bulk once half the storage is dead: amortized O(1) a token.
  if (dead == 0 || dead * 2 < tokens_.size()) return;
  const auto cut = static_cast<std::ptrdiff_t>(dead);
  tokens_.erase(tokens_.begin(), tokens_.begin() + cut);
  for (auto& p : prev_) p.erase(p.begin(), p.begin() + cut);
  base_ = begin_;
}

void NgramStore::clear() {
  tokens_.clear();
  for (auto& h : heads_) h.clear();
  for (auto& p : prev_) p.clear();
  base_ = begin_ = 0;
}

std::pair<int64_t, int32_t> NgramStore::longest_match(const int32_t* last_end, int32_t top,
                                                      int64_t min_match) const {
  uint64_t hashes[kMaxNgram];
  suffix_hashes(last_end, top, hashes);
  for (int32_t n = top; n >= min_match; --n) {
    const int64_t start = find(last_end - n, n, hashes[n - 1]);
    if (start >= 0) return {start, n};
  }
  return {-1, 0};
}

// ------------------------------------------------------------------------------------------
// NgramIndex

NgramIndex::NgramIndex(int32_t max_ngram, int64_t vocab_size, uint64_t hash_mask)
    : store_(max_ngram, vocab_size, hash_mask) {}

void NgramIndex::append(const int32_t* tokens, size_t n) {
  store_.check_tokens(tokens, n, "tokens");
  const int64_t old_end = store_.end();
  store_.push(tokens, n);
  // Each new token completes the continuation of the n-grams that end just before it.
  for (int64_t x = std::max<int64_t>(old_end, 1); x < store_.end(); ++x) store_.index_end(x, 0);
}

NgramDraft NgramIndex::draft(int64_t max_tokens, int64_t min_match, int64_t max_match) const {
  return draft_after(nullptr, 0, max_tokens, min_match, max_match);
}

std::vector<int32_t> NgramIndex::tail(const int32_t* extra, size_t n_extra, size_t count) const {
  const size_t from_extra = std::min(count, n_extra);
  const size_t from_history =
      std::min(count - from_extra, static_cast<size_t>(store_.end() - store_.begin()));
  std::vector<int32_t> out(store_.data_at(store_.end() - static_cast<int64_t>(from_history)),
                           store_.data_at(store_.end()));
  out.insert(out.end(), extra + n_extra - from_extra, extra + n_extra);
  return out;
}

NgramDraft NgramIndex::draft_after(const int32_t* extra, size_t n_extra, int64_t max_tokens,
                                   int64_t min_match, int64_t max_match) const {
  check_draft_args(max_tokens, min_match, max_match, max_ngram());
  NgramDraft out;
  const int64_t len = store_.end();
  // The whole context cannot occur earlier than itself, hence - 1 (with extra tokens past the
  // history, every occurrence in it is earlier than the context's end).
  const int32_t top =
      static_cast<int32_t>(std::min(max_match, len + static_cast<int64_t>(n_extra) - 1));
  if (max_tokens == 0 || top < min_match) return out;
  std::vector<int32_t> key;  // the context's last `top` tokens, when they are not all stored
  const int32_t* key_end = store_.data_at(len);
  if (n_extra > 0) {
    key = tail(extra, n_extra, static_cast<size_t>(top));
    key_end = key.data() + key.size();
  }
  const auto [start, n] = store_.longest_match(key_end, top, min_match);
  if (start < 0) return out;
  const int64_t from = start + n;
  const int64_t to = std::min(from + max_tokens, len);
  out.match = n;
  out.tokens.assign(store_.data_at(from), store_.data_at(to));
  return out;
}

// ------------------------------------------------------------------------------------------
// NgramCorpus

NgramCorpus::NgramCorpus(int32_t max_ngram, int64_t token_budget, int64_t vocab_size,
                         uint64_t hash_mask)
    : store_(max_ngram, vocab_size, hash_mask), token_budget_(token_budget) {
  // The store's 32-bit back links rely on a live window under 2**31 tokens.
  require(token_budget >= 0 && token_budget <= std::numeric_limits<int32_t>::max(),
          "token_budget must be in [0, 2**31-1], got " + std::to_string(token_budget));
}

void NgramCorpus::add_sequence(const int32_t* tokens, size_t n) {
  store_.check_tokens(tokens, n, "tokens");
  if (static_cast<int64_t>(n) > token_budget_) {
    tokens += n - static_cast<size_t>(token_budget_);
    n = static_cast<size_t>(token_budget_);
  }
  if (n == 0) return;
  const int64_t start = store_.end();
  store_.push(tokens, n);
  const int64_t end = store_.end();
  for (int64_t x = start + 1; x < end; ++x) store_.index_end(x, start);
  sequences_.emplace_back(start, end);
  num_tokens_ += static_cast<int64_t>(n);
  while (num_tokens_ > token_budget_) evict_oldest();
}

void NgramCorpus::evict_oldest() {
  const auto [start, end] = sequences_.front();
  for (int64_t x = start + 1; x < end; ++x) store_.unindex_end(x, start);
  num_tokens_ -= end - start;
  sequences_.pop_front();
  store_.drop_before(end);
}

NgramDraft NgramCorpus::draft(const int32_t* context, size_t n, int64_t max_tokens,
                              int64_t min_match, int64_t max_match) const {
  check_draft_args(max_tokens, min_match, max_match, max_ngram());
  const int32_t top = static_cast<int32_t>(std::min<int64_t>(max_match, static_cast<int64_t>(n)));
  const int32_t* tail = context + n - top;
  store_.check_tokens(tail, static_cast<size_t>(top), "context tail");
  NgramDraft out;
  if (max_tokens == 0 || top < min_match) return out;
  const auto [start, len] = store_.longest_match(context + n, top, min_match);
  if (start < 0) return out;
  // The sequence holding the match: the last one starting at or before it.
  auto seq = std::upper_bound(
      sequences_.begin(), sequences_.end(), start,
      [](int64_t pos, const std::pair<int64_t, int64_t>& s) { return pos < s.first; });
  const int64_t seq_end = std::prev(seq)->second;
  const int64_t from = start + len;
  const int64_t to = std::min(from + max_tokens, seq_end);
  out.match = len;
  out.tokens.assign(store_.data_at(from), store_.data_at(to));
  return out;
}

void NgramCorpus::clear() {
  store_.clear();
  sequences_.clear();
  num_tokens_ = 0;
}

// ------------------------------------------------------------------------------------------

NgramDraft ngram_draft(const NgramIndex& request, const NgramCorpus* corpus, int64_t max_tokens,
                       int64_t min_match, int64_t max_match) {
  return ngram_draft_after(request, nullptr, 0, corpus, max_tokens, min_match, max_match);
}

NgramDraft ngram_draft_after(const NgramIndex& request, const int32_t* extra, size_t n_extra,
                             const NgramCorpus* corpus, int64_t max_tokens, int64_t min_match,
                             int64_t max_match) {
  // Both checked up front, so the arguments' validity never depends on what matched.
  if (corpus != nullptr) check_draft_args(max_tokens, min_match, max_match, corpus->max_ngram());
  NgramDraft own = request.draft_after(extra, n_extra, max_tokens, min_match, max_match);
  // Only a strictly longer match replaces the request's own, so a full-length one needs no
  // corpus lookup.
  if (corpus == nullptr || own.match == max_match) return own;
  // The corpus reads the context's last max_match tokens: the history's own, unless extra
  // tokens follow it.
  std::vector<int32_t> tail;
  const int32_t* context = request.data();
  size_t n = static_cast<size_t>(request.size());
  if (n_extra > 0) {
    tail = request.tail(extra, n_extra, static_cast<size_t>(max_match));
    context = tail.data();
    n = tail.size();
  }
  NgramDraft shared = corpus->draft(context, n, max_tokens, min_match, max_match);
  return shared.match > own.match ? shared : own;
}

}  // namespace pyserve
