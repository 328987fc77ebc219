// RadixCache, as a specification. Block size 2 unless said otherwise: tokens {1,2, 3,4, 5}
// are two whole blocks and one token that is never cached.
#include "radix_cache.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "check.h"
#include "errors.h"

using pyserve::BlockAllocator;
using pyserve::BlockId;
using pyserve::NodeId;
using pyserve::RadixCache;
using pyserve::ValueError;
using Ids = std::vector<BlockId>;
using Tokens = std::vector<int32_t>;

namespace {

struct Fixture {
  BlockAllocator allocator;
  RadixCache cache;
  explicit Fixture(int64_t num_blocks = 16, int64_t block_size = 2)
      : allocator(num_blocks), cache(block_size, allocator) {}

  // Inserts with fresh blocks, then drops the caller's references, as a finished request does.
  int64_t insert_fresh(const Tokens& tokens) {
    const Ids ids = allocator.allocate(static_cast<int64_t>(tokens.size()) / cache.block_size());
    const int64_t cached =
        cache.insert(tokens.data(), tokens.size(), ids.data(), ids.size()).cached_tokens;
    allocator.decref(ids.data(), ids.size());
    check();
    return cached;
  }
  pyserve::PrefixMatch match(const Tokens& tokens) {
    auto m = cache.match_prefix(tokens.data(), tokens.size());
    check();
    return m;
  }
  void check() {
    allocator.check_invariants();
    cache.check_invariants();
  }
};

}  // namespace

TEST(an_empty_cache_matches_nothing_at_the_root) {
  Fixture f;
  const auto m = f.match({1, 2, 3, 4});
  CHECK_EQ(m.num_tokens, 0);
  CHECK(m.blocks.empty());
  CHECK_EQ(m.node, pyserve::kRootNode);
  CHECK_EQ(f.cache.stats().query_tokens, 4);
  CHECK_EQ(f.cache.stats().hit_tokens, 0);
}

TEST(insert_caches_whole_blocks_and_match_returns_them) {
  Fixture f;
  const Ids ids = f.allocator.allocate(2);
  const Tokens tokens{1, 2, 3, 4, 5};
  CHECK_EQ(f.cache.insert(tokens.data(), tokens.size(), ids.data(), ids.size()).cached_tokens, 0);
  CHECK_EQ(f.cache.cached_blocks(), 2);
  CHECK_EQ(f.allocator.refcount(ids[0]), 2);  // the caller's reference and the tree's
  f.check();

  auto m = f.match({1, 2, 3, 4, 5, 6});
  CHECK_EQ(m.num_tokens, 4);
  CHECK_EQ(m.blocks, ids);
  m = f.match({1, 2, 3});  // only whole blocks match
  CHECK_EQ(m.num_tokens, 2);
  CHECK_EQ(m.blocks, Ids{ids[0]});
  m = f.match({1, 9, 3, 4});  // a block matches only when all its tokens do
  CHECK_EQ(m.num_tokens, 0);
  CHECK_EQ(f.cache.stats().hit_tokens, 6);
}

TEST(insert_reports_the_already_cached_part_whose_blocks_the_caller_frees) {
  Fixture f;
  CHECK_EQ(f.insert_fresh({1, 2, 3, 4}), 0);
  const Ids mine = f.allocator.allocate(3);
  const Tokens longer{1, 2, 3, 4, 5, 6};
  CHECK_EQ(f.cache.insert(longer.data(), longer.size(), mine.data(), mine.size()).cached_tokens, 4);
  // The tree adopted only the third block; the first two are the caller's duplicates.
  CHECK_EQ(f.allocator.refcount(mine[0]), 1);
  CHECK_EQ(f.allocator.refcount(mine[2]), 2);
  f.allocator.decref(mine.data(), mine.size());
  CHECK_EQ(f.allocator.num_free(), 16 - 3);
  CHECK_EQ(f.cache.stats().inserted_blocks, 3);
  CHECK_EQ(f.match({1, 2, 3, 4, 5, 6}).num_tokens, 6);
}

TEST(a_diverging_insert_splits_the_edge) {
  Fixture f;
  f.insert_fresh({1, 2, 3, 4, 5, 6});
  CHECK_EQ(f.cache.num_nodes(), 2);
  CHECK_EQ(f.insert_fresh({1, 2, 3, 4, 7, 8}), 4);
  CHECK_EQ(f.cache.num_nodes(), 4);  // root, shared {1,2,3,4}, two leaves
  CHECK_EQ(f.cache.cached_blocks(), 4);
  CHECK_EQ(f.match({1, 2, 3, 4, 7, 8}).num_tokens, 6);
  CHECK_EQ(f.match({1, 2, 3, 4, 5, 6}).num_tokens, 6);
}

TEST(siblings_are_told_apart_by_their_whole_first_block) {
  Fixture f(16, 4);
  f.insert_fresh({1, 2, 3, 4});
  CHECK_EQ(f.insert_fresh({1, 2, 3, 5}), 0);  // same first token, different block
  CHECK_EQ(f.match({1, 2, 3, 5}).num_tokens, 4);
  CHECK_EQ(f.match({1, 2, 3, 4}).num_tokens, 4);
  CHECK_EQ(f.match({1, 2, 3, 6}).num_tokens, 0);
}

TEST(a_match_inside_an_edge_splits_it_so_the_handle_ends_at_the_prefix) {
  Fixture f;
  f.insert_fresh({1, 2, 3, 4, 5, 6});
  const auto m = f.match({1, 2, 3, 4, 9, 9});
  CHECK_EQ(m.num_tokens, 4);
  CHECK_EQ(f.cache.depth(m.node), 4);
  // Locking that handle protects the prefix only; the tail {5,6} is still evictable.
  f.cache.lock(m.node);
  CHECK_EQ(f.cache.evictable_blocks(), 1);
  CHECK_EQ(f.cache.evict(10), 1);
  CHECK_EQ(f.match({1, 2, 3, 4, 5, 6}).num_tokens, 4);
  f.cache.unlock(m.node);
  f.check();
}

TEST(invalid_inserts_raise_and_change_nothing) {
  Fixture f;
  const Ids held = f.allocator.allocate(2);
  const Tokens four{1, 2, 3, 4};
  CHECK_THROWS(f.cache.insert(four.data(), 4, held.data(), 1), ValueError);  // too few ids
  const Ids out_of_range{held[0], 99};
  CHECK_THROWS(f.cache.insert(four.data(), 4, out_of_range.data(), 2), ValueError);
  const Ids negative{-1, held[0]};
  CHECK_THROWS(f.cache.insert(four.data(), 4, negative.data(), 2), ValueError);
  const Ids free_block{held[0], 5};  // block 5 was never allocated
  CHECK_THROWS(f.cache.insert(four.data(), 4, free_block.data(), 2), ValueError);
  const Ids twice{held[0], held[0]};
  CHECK_THROWS(f.cache.insert(four.data(), 4, twice.data(), 2), ValueError);
  CHECK_EQ(f.cache.cached_blocks(), 0);
  CHECK_EQ(f.allocator.refcount(held[0]), 1);
  f.check();
  // A block can live in only one place in the tree.
  f.cache.insert(four.data(), 4, held.data(), 2);
  const Tokens other{7, 8};
  CHECK_THROWS(f.cache.insert(other.data(), 2, held.data(), 1), ValueError);
  f.check();
}

TEST(every_block_size_tells_blocks_apart_by_every_token) {
  // Children are keyed by a hash of their first block, read in token pairs and lanes of eight:
  // block sizes below, at and around those widths must still see every token.
  for (int64_t bs : {1, 2, 3, 7, 8, 9, 16, 17}) {
    Fixture f(64, bs);
    Tokens base(static_cast<size_t>(2 * bs));
    for (size_t i = 0; i < base.size(); ++i) base[i] = static_cast<int32_t>(i);
    CHECK_EQ(f.insert_fresh(base), 0);
    for (int64_t p = 0; p < bs; ++p) {  // differs from base at position p of the first block
      Tokens other = base;
      other[static_cast<size_t>(p)] = 1000 + static_cast<int32_t>(p);
      CHECK_EQ(f.insert_fresh(other), 0);
      CHECK_EQ(f.match(other).num_tokens, 2 * bs);
    }
    CHECK_EQ(f.match(base).num_tokens, 2 * bs);
    CHECK_EQ(f.cache.num_nodes(), 2 + bs);  // the root, base and one sibling a position
  }
}

TEST(leaves_are_evicted_in_the_order_they_were_last_used) {
  Fixture f(16, 2);
  for (int32_t t = 1; t <= 8; ++t) f.insert_fresh({t, t});
  const NodeId locked = f.match({3, 3}).node;
  f.cache.lock(locked);
  for (int32_t t : {5, 1, 7, 3, 2}) f.match({t, t});  // 3 is used while locked
  f.cache.unlock(locked);
  // Oldest first: 4, 6, 8 were never used again, then 5, 1, 7, 3, 2 in the order of use.
  const int32_t order[] = {4, 6, 8, 5, 1, 7, 3, 2};
  for (size_t i = 0; i < 8; ++i) {
    CHECK_EQ(f.cache.evict(1), 1);
    for (size_t j = 0; j < 8; ++j) {
      CHECK_EQ(f.cache.in_tree(order[j] - 1), j > i);  // {t, t} holds block t - 1
    }
    f.check();
  }
}

TEST(locked_nodes_are_never_evicted_and_unlock_below_zero_raises) {
  Fixture f;
  f.insert_fresh({1, 2, 3, 4});
  const NodeId handle = f.match({1, 2, 3, 4}).node;
  f.cache.lock(handle);
  f.cache.lock(handle);
  CHECK_EQ(f.cache.evictable_blocks(), 0);
  CHECK_EQ(f.cache.evict(100), 0);
  CHECK_EQ(f.cache.reset(), 0);
  f.cache.unlock(handle);
  CHECK_EQ(f.cache.evict(100), 0);  // still locked once
  f.cache.unlock(handle);
  CHECK_THROWS(f.cache.unlock(handle), ValueError);
  CHECK_EQ(f.cache.lock_count(handle), 0);
  CHECK_EQ(f.cache.evict(100), 2);
  CHECK_EQ(f.allocator.num_free(), 16);
  CHECK_THROWS(f.cache.lock(handle), ValueError);  // the node is gone
  CHECK_THROWS(f.cache.lock(12345), ValueError);
  f.check();
}

TEST(eviction_pops_least_recently_used_leaves_first) {
  Fixture f;
  f.insert_fresh({1, 1});  // oldest
  f.insert_fresh({2, 2});
  f.insert_fresh({3, 3});
  f.match({1, 1});  // now {2,2} is the oldest
  CHECK_EQ(f.cache.evict(1), 1);
  CHECK_EQ(f.match({2, 2}).num_tokens, 0);
  CHECK_EQ(f.cache.evict(1), 1);
  CHECK_EQ(f.match({3, 3}).num_tokens, 0);
  CHECK_EQ(f.match({1, 1}).num_tokens, 2);
  CHECK_EQ(f.cache.stats().evicted_blocks, 2);
}

TEST(eviction_takes_whole_leaves_and_then_their_parents) {
  Fixture f;
  f.insert_fresh({1, 2, 3, 4, 5, 6});
  f.insert_fresh({1, 2, 3, 4, 7, 8});  // shared {1,2,3,4} with two one-block leaves
  CHECK_EQ(f.cache.evict(1), 1);       // the older leaf {5,6}
  CHECK_EQ(f.match({1, 2, 3, 4, 5, 6}).num_tokens, 4);
  CHECK_EQ(f.cache.evict(2), 3);  // leaf {7,8}, then the two-block parent, whole
  CHECK_EQ(f.cache.cached_blocks(), 0);
  CHECK_EQ(f.allocator.num_free(), 16);
  f.check();
}

TEST(a_block_still_held_by_its_caller_is_not_freed_by_eviction) {
  Fixture f;
  const Ids ids = f.allocator.allocate(1);
  const Tokens t{1, 2};
  f.cache.insert(t.data(), 2, ids.data(), 1);
  CHECK_EQ(f.cache.evict(1), 0);  // nothing became free...
  CHECK_EQ(f.cache.cached_blocks(), 0);
  CHECK_EQ(f.allocator.refcount(ids[0]), 1);  // ...the tree let go; the caller still holds it
  f.allocator.decref(ids[0]);
  f.check();
}

TEST(reset_drops_everything_unlocked) {
  Fixture f;
  f.insert_fresh({1, 2, 3, 4});
  f.insert_fresh({5, 6});
  const NodeId handle = f.match({1, 2}).node;  // splits {1,2 | 3,4}
  f.cache.lock(handle);
  CHECK_EQ(f.cache.reset(), 2);  // {3,4} and {5,6}
  CHECK_EQ(f.cache.cached_blocks(), 1);
  f.cache.unlock(handle);
  CHECK_EQ(f.cache.reset(), 1);
  CHECK_EQ(f.cache.num_nodes(), 1);
  CHECK_EQ(f.allocator.num_free(), 16);
  f.check();
}

TEST(insert_from_continues_below_a_node) {
  Fixture f;
  const Ids first = f.allocator.allocate(1);
  const Tokens a{1, 2};
  const NodeId node = f.cache.insert(a.data(), 2, first.data(), 1).node;
  const Ids second = f.allocator.allocate(1);
  const Tokens b{3, 4};
  const auto r = f.cache.insert_from(node, b.data(), 2, second.data(), 1);
  CHECK_EQ(r.cached_tokens, 0);
  CHECK_EQ(f.cache.depth(r.node), 4);
  CHECK_EQ(f.cache.path_blocks(r.node), (Ids{first[0], second[0]}));
  CHECK_EQ(f.match({1, 2, 3, 4}).blocks, (Ids{first[0], second[0]}));
}

TEST(insert_from_below_a_privately_locked_leaf_extends_it_in_place) {
  Fixture f;
  const Ids ids = f.allocator.allocate(3);
  const Tokens t{1, 2, 3, 4, 5, 6};
  const NodeId leaf = f.cache.insert(t.data(), 2, ids.data(), 1).node;
  f.cache.lock(leaf);  // the caller's lock is the only one
  const auto r = f.cache.insert_from(leaf, t.data() + 2, 4, ids.data() + 1, 2);
  CHECK_EQ(r.node, leaf);
  CHECK_EQ(f.cache.num_nodes(), 2);
  CHECK_EQ(f.cache.depth(leaf), 6);
  f.check();
  // A second lock on the node means someone else relies on where it ends: a new child instead.
  f.cache.lock(leaf);
  const Ids more = f.allocator.allocate(1);
  const Tokens next{7, 8};
  const NodeId child = f.cache.insert_from(leaf, next.data(), 2, more.data(), 1).node;
  CHECK(child != leaf);
  CHECK_EQ(f.cache.num_nodes(), 3);
  f.cache.unlock(leaf);
  f.cache.move_lock(leaf, child);  // the lock follows the sequence down
  CHECK_EQ(f.cache.lock_count(child), 1);
  CHECK_EQ(f.cache.lock_count(leaf), 1);
  CHECK_THROWS(f.cache.move_lock(child, leaf), ValueError);  // only downwards
  f.cache.release(child);
  CHECK_EQ(f.cache.evictable_blocks(), 4);
  f.check();
}

TEST(release_stamps_the_whole_path_as_just_used) {
  Fixture f;
  f.insert_fresh({1, 1});
  const NodeId held = f.match({2, 2}).node;  // root: nothing cached yet
  CHECK_EQ(held, pyserve::kRootNode);
  f.insert_fresh({2, 2});
  const NodeId two = f.match({2, 2}).node;
  f.cache.lock(two);
  f.insert_fresh({3, 3});
  f.cache.release(two);  // {2,2} is now the most recently used leaf
  CHECK_EQ(f.cache.evict(2), 2);
  CHECK_EQ(f.match({2, 2}).num_tokens, 2);
  CHECK_EQ(f.match({1, 1}).num_tokens, 0);
  CHECK_EQ(f.match({3, 3}).num_tokens, 0);
}

TEST(bad_block_size_is_a_value_error) {
  BlockAllocator a(4);
  CHECK_THROWS(RadixCache(0, a), ValueError);
  CHECK_THROWS(RadixCache(-2, a), ValueError);
}

// The disk tier: blocks evicted from RAM stay in the tree under 64-bit keys.

std::vector<uint64_t> keys_of(const std::vector<pyserve::DiskOp>& ops) {
  std::vector<uint64_t> keys;
  for (const auto& op : ops) keys.push_back(op.key);
  return keys;
}

TEST(eviction_with_a_disk_budget_turns_ram_nodes_into_disk_nodes_and_queues_saves) {
  Fixture f;
  f.cache.set_disk_budget(8);
  const Tokens tokens{1, 2, 3, 4, 5, 6};
  const Ids ids = f.allocator.allocate(3);
  f.cache.insert(tokens.data(), tokens.size(), ids.data(), ids.size());
  f.allocator.decref(ids.data(), ids.size());
  CHECK_EQ(f.cache.evict(16), 3);
  f.check();
  CHECK_EQ(f.allocator.num_free(), 16);
  CHECK_EQ(f.cache.cached_blocks(), 0);
  CHECK_EQ(f.cache.disk_blocks(), 3);
  const auto saves = f.cache.take_saves();
  CHECK_EQ(saves.size(), size_t{3});
  CHECK_EQ(saves[0].block, ids[0]);
  CHECK_EQ(saves[2].block, ids[2]);
  CHECK_EQ(keys_of(saves), f.cache.block_keys(tokens.data(), tokens.size()));
  CHECK(f.cache.take_saves().empty());  // taken once

  // A match returns RAM blocks only and says how much continues on disk.
  const auto m = f.match({1, 2, 3, 4, 5, 6, 7});
  CHECK_EQ(m.num_tokens, 0);
  CHECK_EQ(m.disk_blocks, 3);
  CHECK_EQ(f.cache.peek_prefix(tokens.data(), 4).disk_blocks, 2);

  // Inserting through the disk nodes brings them back into the caller's blocks, as loads.
  const Ids fresh = f.allocator.allocate(2);
  const auto r = f.cache.insert(tokens.data(), 4, fresh.data(), fresh.size());
  f.allocator.decref(fresh.data(), fresh.size());
  f.check();
  CHECK_EQ(r.cached_tokens, 0);
  CHECK_EQ(r.loads.size(), size_t{2});
  CHECK_EQ(r.loads[0].block, fresh[0]);
  CHECK_EQ(r.loads[1].block, fresh[1]);
  CHECK_EQ(r.loads[1].key, saves[1].key);
  CHECK_EQ(f.cache.disk_blocks(), 1);  // the edge was split: {5,6} stays on disk
  CHECK_EQ(f.cache.cached_blocks(), 2);
  const auto again = f.match(tokens);
  CHECK_EQ(again.num_tokens, 4);
  CHECK_EQ(again.disk_blocks, 1);
  CHECK_EQ(f.cache.stats().loaded_blocks, 2);
  CHECK_EQ(f.cache.stats().saved_blocks, 3);
}

TEST(the_disk_budget_drops_lru_disk_leaves_and_a_save_not_yet_taken_stays_before_its_drop) {
  Fixture f;
  f.cache.set_disk_budget(2);
  f.insert_fresh({1, 2, 3, 4});
  f.insert_fresh({5, 6});
  f.match({5, 6});                // {1,2,3,4} is older
  CHECK_EQ(f.cache.evict(2), 2);  // {1,2,3,4} to disk
  const auto saved = f.cache.take_saves();
  CHECK_EQ(saved.size(), size_t{2});
  CHECK_EQ(f.cache.evict(1), 1);  // {5,6} to disk: {1,2,3,4} (the LRU disk leaf) is dropped
  f.check();
  CHECK_EQ(f.cache.disk_blocks(), 1);
  CHECK_EQ(f.cache.take_drops(), keys_of(saved));
  CHECK_EQ(f.cache.take_saves().size(), size_t{1});
  CHECK_EQ(f.cache.stats().disk_evicted_blocks, 2);

  // Saved and dropped before the caller took the save: the save stays, its drop after it (a
  // load in the same step may read the key between them).
  f.insert_fresh({7, 8, 9, 10, 11, 12});
  f.cache.set_disk_budget(1);
  CHECK_EQ(f.cache.evict(16), 3);
  f.check();
  const auto unsaved = f.cache.take_saves();
  CHECK_EQ(unsaved.size(), size_t{3});
  const auto drops = f.cache.take_drops();  // {5,6}, whose save was taken, then the three
  CHECK_EQ(drops.size(), size_t{4});
  CHECK_EQ(std::vector<uint64_t>(drops.begin() + 1, drops.end()), keys_of(unsaved));
  CHECK_EQ(f.cache.disk_blocks(), 0);
  CHECK_THROWS(f.cache.set_disk_budget(-1), ValueError);
}

TEST(insert_disk_rebuilds_what_a_restart_finds_with_the_same_keys) {
  Fixture before;
  before.cache.set_disk_budget(8);
  before.insert_fresh({1, 2, 3, 4});
  before.insert_fresh({1, 2, 5, 6});
  before.cache.evict(16);
  const auto saves = before.cache.take_saves();
  CHECK_EQ(saves.size(), size_t{3});

  Fixture after;
  CHECK_EQ(after.cache.insert_disk(Tokens{1, 2, 3, 4}.data(), 4), 0);  // no tier: nothing
  after.cache.set_disk_budget(3);
  CHECK_EQ(after.cache.insert_disk(Tokens{1, 2, 3, 4}.data(), 4), 2);
  CHECK_EQ(after.cache.insert_disk(Tokens{1, 2, 5, 6, 7, 8}.data(), 6), 1);  // budget: 1 left
  after.check();
  CHECK_EQ(after.cache.disk_blocks(), 3);
  CHECK_EQ(after.match({1, 2, 5, 6, 7, 8}).disk_blocks, 2);
  const Ids fresh = after.allocator.allocate(2);
  const auto r = after.cache.insert(Tokens{1, 2, 5, 6}.data(), 4, fresh.data(), fresh.size());
  after.allocator.decref(fresh.data(), fresh.size());
  after.check();
  std::vector<uint64_t> expected;
  for (const auto& op : saves) expected.push_back(op.key);
  const std::vector<uint64_t> loaded = keys_of(r.loads);
  CHECK_EQ(loaded.size(), size_t{2});
  CHECK(std::find(expected.begin(), expected.end(), loaded[0]) != expected.end());
  CHECK(std::find(expected.begin(), expected.end(), loaded[1]) != expected.end());
  CHECK_EQ(after.cache.reset(), 2);
  after.check();
  CHECK_EQ(after.cache.disk_blocks(), 0);
  CHECK_EQ(after.cache.num_nodes(), 1);
}

int main() { return check::run_all_tests(); }
