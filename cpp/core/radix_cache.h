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
// - Disk tier (set_disk_budget > 0): a node's blocks are either in RAM (block ids) or on disk (one
//   64-bit key per block, chained from the previous block's key and the block's tokens, so equal
//   prefixes get equal keys whoever computes them). Eviction turns an unlocked RAM node with no
//   RAM children into a disk node instead of dropping it, and queues one "save block b as key k"
//   op per block (take_saves): the caller copies the blocks out before anything reuses them. The
//   disk nodes are bounded by the budget (in blocks): LRU disk leaves are dropped past it, their
//   keys queued as drops (take_drops; a save still queued stays before its drop, as a load in
//   the same step may read it: the caller saves, then loads, then drops). A disk node's children
//   are disk nodes, so locks (on RAM nodes only) never reach the disk tier. match_prefix and
//   peek_prefix return RAM blocks only and say how many blocks continue on disk; insert through
//   disk nodes brings them back to RAM, adopting the caller's blocks and reporting them as loads
//   (InsertResult::loads): the caller fills those blocks from the keys (or computed them itself).
//   The tree stays tensor-free.
//
// Invariant (check_invariants): each block in the tree is in exactly one RAM node and the tree
// holds one reference on it; sibling edges start with different blocks; a node's lock count is at
// least the sum of its children's; an unlocked node is not older than its children; the LRU set
// holds exactly the unlocked non-root RAM nodes without RAM children; a disk node is unlocked,
// has only disk children and keys equal to the chain from its path; the disk LRU set holds
// exactly the disk leaves; the cached, evictable and disk block counters equal what the nodes
// hold, and the disk blocks are within the budget.
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
  int64_t disk_blocks = 0;      // blocks after the match that the disk tier holds
};

// A block to copy between the KV pool and the disk tier. A save also names the key of the block
// before it on its path (the chain's seed for a first block) and its tokens: what a restart needs
// to put the block back in the tree (insert_disk).
struct DiskOp {
  BlockId block = -1;
  uint64_t key = 0;
  uint64_t parent = 0;
  std::vector<int32_t> tokens;  // a save's block_size tokens (empty for a load)
};

// What a match would find, without touching the tree.
struct PrefixPeek {
  int64_t num_blocks = 0;
  int64_t unlocked_blocks = 0;  // of those, blocks now in unlocked (evictable) nodes
  int64_t disk_blocks = 0;      // blocks after those that the disk tier holds
};

struct InsertResult {
  int64_t cached_tokens = 0;  // leading tokens that were already in the tree
  NodeId node = kRootNode;    // the node that ends the inserted sequence
  std::vector<DiskOp> loads;  // disk blocks brought back to RAM: the caller's blocks now hold them
};

struct CacheStats {
  int64_t cached_blocks = 0;
  int64_t evictable_blocks = 0;
  int64_t hit_tokens = 0;
  int64_t query_tokens = 0;
  int64_t evicted_blocks = 0;
  int64_t inserted_blocks = 0;
  int64_t disk_blocks = 0;          // blocks the disk tier holds now
  int64_t disk_budget = 0;          // the most it may hold (0: no disk tier)
  int64_t saved_blocks = 0;         // RAM blocks turned into disk blocks
  int64_t loaded_blocks = 0;        // disk blocks brought back to RAM by insert
  int64_t disk_evicted_blocks = 0;  // disk blocks dropped (budget or reset)
};

class RadixCache {
 public:
  // The allocator must outlive the cache.
  RadixCache(int64_t block_size, BlockAllocator& allocator);
  RadixCache(const RadixCache&) = delete;
  RadixCache& operator=(const RadixCache&) = delete;

  int32_t block_size() const { return block_size_; }

  // Longest cached block-aligned prefix of tokens[0, n). Splits an edge that matches only in
  // part (so the returned node ends exactly at the prefix), refreshes LRU times, counts stats
  // (unless count_stats is false: a second match of the same query).
  PrefixMatch match_prefix(const int32_t* tokens, size_t n, bool count_stats = true);
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

  // Evicts unlocked RAM nodes without RAM children in LRU order (ties by node id), whole nodes,
  // until at least num_blocks blocks became free in the allocator or nothing is evictable. With
  // the disk tier on they become disk nodes (queueing saves), else they are dropped. Returns the
  // blocks freed (a block someone else still holds leaves the tree but is not freed).
  int64_t evict(int64_t num_blocks);
  // Drops every unlocked node and every disk node (no saves); clears the queued saves and drops.
  // Returns blocks freed.
  int64_t reset();

  // The disk tier's size in blocks; 0 turns it off. Shrinking drops LRU disk leaves (queued as
  // drops). ValueError for a negative budget.
  void set_disk_budget(int64_t max_blocks);
  int64_t disk_budget() const { return disk_budget_; }
  int64_t disk_blocks() const { return disk_blocks_; }
  // Adds the whole blocks of tokens[0, n) that are not in the tree as disk nodes (what the disk
  // tier holds after a restart), within the budget; returns how many blocks were added. A block
  // already in the tree (RAM or disk) is left alone. Adds nothing with the tier off.
  int64_t insert_disk(const int32_t* tokens, size_t n);
  // Forgets the disk child of `node` whose edge starts with the block at tokens[0, block_size),
  // with everything below it, queueing their keys as drops (a load of one failed: its file is
  // damaged). Returns the disk blocks forgotten (0 if that child is not on disk).
  int64_t forget_disk(NodeId node, const int32_t* tokens);
  // Every disk block's key.
  std::vector<uint64_t> disk_keys() const;
  // Queues drops for keys the tree does not hold (block files found at start but not indexed).
  void queue_drops(const std::vector<uint64_t>& keys);
  // The queued ops, emptied by the call: saves in eviction order; drops are keys whose files
  // are no longer wanted (a key saved and dropped before being taken is in neither).
  std::vector<DiskOp> take_saves();
  std::vector<uint64_t> take_drops();
  // The chained key of every whole block of tokens[0, n), as the disk tier names them.
  std::vector<uint64_t> block_keys(const int32_t* tokens, size_t n) const;

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
  using LruSet = std::set<std::pair<uint64_t, NodeId>>;   // (last access, node id)
  using DiskSet = std::set<std::pair<uint64_t, NodeId>>;  // disk leaves, likewise

  struct Node {
    NodeId parent = -1;
    int64_t depth = 0;
    int32_t lock_count = 0;
    uint64_t last_access = 0;
    bool live = false;
    uint64_t key = 0;             // hash of the first block: this node's key in its parent
    std::vector<BlockId> blocks;  // a RAM node's block ids (empty on disk)
    std::vector<uint64_t> keys;   // a disk node's block keys (empty in RAM)
    bool on_disk = false;
    int32_t ram_children = 0;                            // children in RAM
    bool disk_listed = false;                            // in disk_leaves_
    DiskSet::iterator disk_entry;                        // its entry there, while listed
    std::vector<int32_t> tokens;                         // the edge's tokens, block_size per block
    std::unordered_multimap<uint64_t, NodeId> children;  // by key
    bool listed = false;         // in lru_leaves_ (an unlocked non-root leaf)
    LruSet::iterator lru_entry;  // its entry there, while listed
  };

  struct Walk {
    NodeId node = kRootNode;  // deepest node whose whole edge matched
    int64_t ram_blocks = 0;   // blocks matched before the first disk node (through_disk)
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
            std::vector<BlockId>* collect, bool through_disk = false) const;
  int64_t disk_after(const Walk& w, const int32_t* tokens, int64_t num_full_blocks) const;
  int64_t edge_blocks(const Node& n) const {
    return static_cast<int64_t>(n.tokens.size()) / block_size_;
  }
  uint64_t chain_key(NodeId node) const;  // the key of node's last block (the root: a seed)
  static uint64_t next_key(uint64_t prev, uint64_t block_hash);
  void to_disk(NodeId node);
  void to_ram(NodeId node, const BlockId* ids, std::vector<DiskOp>& loads);
  void disk_relist(NodeId node);
  void disk_unlist(NodeId node);
  void trim_disk(int64_t max_blocks);
  int64_t remove_disk_leaf(NodeId node, bool queue_drops);
  void detach(NodeId node);
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
  DiskSet disk_leaves_;
  int64_t disk_budget_ = 0;
  int64_t disk_blocks_ = 0;
  int64_t saved_blocks_ = 0;
  int64_t loaded_blocks_ = 0;
  int64_t disk_evicted_blocks_ = 0;
  std::vector<DiskOp> pending_saves_;
  std::vector<uint64_t> pending_drops_;
};

}  // namespace pyserve
