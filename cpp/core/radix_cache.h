// RadixCache: a prefix tree over token ids at block granularity, holding KV blocks for reuse.
//
// Design (after TGI's radix allocator):
// - Nodes live in an arena (a vector) and are addressed by ids; freed ids are reused. Node 0 is
//   the root, whose edge is empty. Every other node's edge is a run of whole blocks: a list of
//   block ids, each standing for `block_size` tokens.
// - A node stores its edge's tokens contiguously next to its block ids, so a fully matching edge
//   costs one memcmp however many blocks it holds.
// - A node's children are keyed by a 64-bit hash of their first block's tokens; a lookup
//   compares the tokens too, so a hash collision can never produce a wrong match.
// - Unlocked leaves sit in an ordered set keyed by (last access, node id): LRU eviction pops the
//   front. A listed node keeps its entry's iterator, so a used leaf is re-keyed to the back of
//   the set without a search or an allocation. Access times come from a logical clock that ticks
//   once per match, insert or release, each stamping the whole root→node path, so an unlocked
//   parent is never older than its children. (insert_from below a locked node stamps only from that
//   node down, to stay independent of depth; the lock holder's release() stamps the rest.)
// - A lock on a node counts on every node of its root→node path, so an unlocked node's subtree
//   is entirely unlocked and `evictable_blocks` (blocks in unlocked nodes) can all be released
//   by repeated leaf eviction.
//
// Invariant (check_invariants): each block in the tree is in exactly one node and the tree holds
// one reference on it; sibling edges start with different blocks; a node's lock count is at least
// the sum of its children's; an unlocked node is not older than its children; the LRU set holds
// exactly the unlocked non-root leaves; the cached and evictable block counters equal what the
// nodes hold.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "block_allocator.h"

namespace pyserve {

using NodeId = int32_t;
constexpr NodeId kRootNode = 0;

struct PrefixMatch {
  int64_t num_tokens = 0;       // == blocks.size() * block_size
  std::vector<BlockId> blocks;  // the cached blocks of the prefix, in order
  NodeId node = kRootNode;      // the deepest matched node (a handle for lock/unlock)
};

// What a match would find, without touching the tree.
struct PrefixPeek {
  int64_t num_blocks = 0;
  int64_t unlocked_blocks = 0;  // of those, blocks now in unlocked (evictable) nodes
};

struct InsertResult {
  int64_t cached_tokens = 0;  // leading tokens that were already in the tree
  NodeId node = kRootNode;    // the node that ends the inserted sequence
};

struct CacheStats {
  int64_t cached_blocks = 0;
  int64_t evictable_blocks = 0;
  int64_t hit_tokens = 0;
  int64_t query_tokens = 0;
  int64_t evicted_blocks = 0;
  int64_t inserted_blocks = 0;
};

class RadixCache {
 public:
  // The allocator must outlive the cache.
  RadixCache(int64_t block_size, BlockAllocator& allocator);
  RadixCache(const RadixCache&) = delete;
  RadixCache& operator=(const RadixCache&) = delete;

  int32_t block_size() const { return block_size_; }

  // Longest cached block-aligned prefix of tokens[0, n). Splits an edge that matches only in
  // part (so the returned node ends exactly at the prefix), refreshes LRU times, counts stats.
  PrefixMatch match_prefix(const int32_t* tokens, size_t n);
  // How many blocks match_prefix would find; changes nothing.
  PrefixPeek peek_prefix(const int32_t* tokens, size_t n) const;

  // Inserts the whole blocks of tokens[0, n) with their KV blocks blocks[0, n / block_size)
  // (num_ids may be larger; the rest is ignored). The tree increfs the blocks it adopts; the
  // caller's blocks for the already-cached part are left alone (the caller frees them).
  // ValueError (and nothing changed) for too few ids, an id out of range, a free block, or a
  // block adopted twice.
  InsertResult insert(const int32_t* tokens, size_t n, const BlockId* ids, size_t num_ids) {
    return insert_from(kRootNode, tokens, n, ids, num_ids);
  }
  // Same, continuing below `start`: tokens[0] is the token at position depth(start). Its cost
  // is independent of depth(start): it stamps LRU times only from `start` down, so the caller
  // must hold a lock on `start` and stamp the whole path later with release(). When `start` is
  // a leaf whose only lock is the caller's, the new blocks extend its edge in place (the result
  // is `start` itself): a decoding request grows one node instead of a chain of them.
  InsertResult insert_from(NodeId start, const int32_t* tokens, size_t n, const BlockId* ids,
                           size_t num_ids);

  // Lock counts on the root→node path; a locked node is never evicted. ValueError for an
  // unknown node or an unlock below 0.
  void lock(NodeId node);
  void unlock(NodeId node);
  // lock(to) + unlock(from) for `to` at or below `from`, touching only the nodes in between.
  void move_lock(NodeId from, NodeId to);
  // unlock(node), and stamps the root→node path as just used (pairs with insert_from).
  void release(NodeId node);

  // Evicts unlocked leaves in LRU order (ties by node id), whole leaves, until at least
  // num_blocks blocks became free in the allocator or nothing is evictable. Returns the blocks
  // freed (a block someone else still holds leaves the tree but is not freed).
  int64_t evict(int64_t num_blocks);
  // Drops every unlocked node. Returns blocks freed.
  int64_t reset();

  int64_t cached_blocks() const { return cached_blocks_; }
  int64_t evictable_blocks() const { return evictable_blocks_; }
  CacheStats stats() const;

  bool in_tree(BlockId id) const { return block_node_[id] >= 0; }
  bool is_live(NodeId node) const;
  int32_t lock_count(NodeId node) const;  // ValueError for an unknown node
  int64_t depth(NodeId node) const;       // tokens from the root to the end of node's edge
  int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size() - free_nodes_.size()); }
  // Node ids are below this; with is_live and parent, lets a caller visit every node.
  NodeId node_id_limit() const { return static_cast<NodeId>(nodes_.size()); }
  NodeId parent(NodeId node) const;  // -1 for the root
  // The blocks on the root→node path, in order.
  std::vector<BlockId> path_blocks(NodeId node) const;

  // InvariantError naming the first broken invariant.
  void check_invariants() const;

 private:
  using LruSet = std::set<std::pair<uint64_t, NodeId>>;  // (last access, node id)

  struct Node {
    NodeId parent = -1;
    int64_t depth = 0;
    int32_t lock_count = 0;
    uint64_t last_access = 0;
    bool live = false;
    uint64_t key = 0;  // hash of the first block: this node's key in its parent
    std::vector<BlockId> blocks;
    std::vector<int32_t> tokens;                         // the edge's tokens, block_size per block
    std::unordered_multimap<uint64_t, NodeId> children;  // by key
    bool listed = false;         // in lru_leaves_ (an unlocked non-root leaf)
    LruSet::iterator lru_entry;  // its entry there, while listed
  };

  struct Walk {
    NodeId node = kRootNode;  // deepest node whose whole edge matched
    int64_t blocks = 0;       // blocks matched from the start, a partial edge included
    NodeId partial = -1;      // the child whose edge matched only in part, or -1
    int64_t partial_blocks = 0;
    int64_t unlocked_blocks = 0;
  };

  uint64_t hash_tokens(const int32_t* tokens) const;
  bool same_block(const int32_t* a, const int32_t* b) const;
  int64_t matching_blocks(const Node& child, const int32_t* tokens, int64_t max_blocks) const;
  NodeId find_child(const Node& node, const int32_t* tokens) const;
  Walk walk(NodeId start, const int32_t* tokens, int64_t num_full_blocks,
            std::vector<BlockId>* collect) const;
  NodeId split(NodeId child, int64_t keep_blocks);
  void adopt(NodeId node, const BlockId* ids, size_t count);
  NodeId new_node();
  void touch(NodeId node, NodeId stop = -1);
  void unlist(NodeId node);
  void relist(NodeId node);
  int64_t remove_leaf(NodeId node);  // returns blocks freed
  void check_node(NodeId node, const char* what) const;

  int32_t block_size_;
  BlockAllocator& allocator_;
  std::vector<Node> nodes_;
  std::vector<NodeId> free_nodes_;
  LruSet lru_leaves_;                  // unlocked non-root leaves
  std::vector<NodeId> block_node_;     // node holding the block, or -1
  std::vector<uint8_t> scratch_mark_;  // per block, for duplicate checks
  uint64_t clock_ = 0;
  int64_t cached_blocks_ = 0;
  int64_t evictable_blocks_ = 0;
  int64_t hit_tokens_ = 0;
  int64_t query_tokens_ = 0;
  int64_t evicted_blocks_ = 0;
  int64_t inserted_blocks_ = 0;
};

}  // namespace pyserve
