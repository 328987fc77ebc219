#include "radix_cache.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "errors.h"

namespace pyserve {

RadixCache::RadixCache(int64_t block_size, BlockAllocator& allocator) : allocator_(allocator) {
  if (block_size < 1 || block_size > (1 << 20)) {
    throw ValueError("block_size must be in [1, 2**20], got " + std::to_string(block_size));
  }
  block_size_ = static_cast<int32_t>(block_size);
  const size_t num_blocks = static_cast<size_t>(allocator.num_blocks());
  block_node_.assign(num_blocks, -1);
  scratch_mark_.assign(num_blocks, 0);
  nodes_.emplace_back();
  nodes_[kRootNode].live = true;
}

uint64_t RadixCache::hash_tokens(const int32_t* tokens) const {
  // Multiply-xorshift over token pairs in four independent lanes, so that the multiplies of a
  // block overlap instead of forming one long dependency chain (every lookup hashes a block at
  // each tree level it passes); then the odd tail, and a final mix of the lanes.
  constexpr uint64_t kMul = 0xBF58476D1CE4E5B9ULL;
  auto mix = [](uint64_t h, uint64_t v) {
    h = (h ^ v) * kMul;
    return h ^ (h >> 29);
  };
  uint64_t lane[4] = {0x9E3779B97F4A7C15ULL, 0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL,
                      0x27D4EB2F165667C5ULL};
  const size_t n = static_cast<size_t>(block_size_);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (size_t k = 0; k < 4; ++k) {
      uint64_t pair;
      std::memcpy(&pair, tokens + i + 2 * k, sizeof(pair));
      lane[k] = mix(lane[k], pair);
    }
  }
  uint64_t h = mix(mix(mix(lane[0], lane[1]), lane[2]), lane[3]);
  for (; i < n; ++i) h = mix(h, static_cast<uint32_t>(tokens[i]));
  return mix(h, n);
}

bool RadixCache::same_block(const int32_t* a, const int32_t* b) const {
  return std::memcmp(a, b, sizeof(int32_t) * static_cast<size_t>(block_size_)) == 0;
}

NodeId RadixCache::find_child(const Node& node, const int32_t* tokens) const {
  if (node.children.empty()) return -1;
  auto range = node.children.equal_range(hash_tokens(tokens));
  for (auto it = range.first; it != range.second; ++it) {
    if (same_block(nodes_[it->second].tokens.data(), tokens)) return it->second;
  }
  return -1;
}

// How many leading blocks of child's edge equal tokens (at most max_blocks); the first block is
// known to match. One memcmp when the whole span matches, block by block only to find a mismatch.
int64_t RadixCache::matching_blocks(const Node& child, const int32_t* tokens,
                                    int64_t max_blocks) const {
  const int64_t span = std::min(edge_blocks(child), max_blocks);
  const size_t bytes = sizeof(int32_t) * static_cast<size_t>(span * block_size_);
  if (std::memcmp(child.tokens.data(), tokens, bytes) == 0) return span;
  int64_t j = 1;
  while (j < span && same_block(child.tokens.data() + j * block_size_, tokens + j * block_size_)) {
    ++j;
  }
  return j;
}

// Without through_disk the walk stops before the first disk node; with it, ram_blocks says where
// the disk nodes (always below the RAM ones) begin.
RadixCache::Walk RadixCache::walk(NodeId start, const int32_t* tokens, int64_t num_full_blocks,
                                  std::vector<BlockId>* collect, bool through_disk) const {
  Walk w;
  w.node = start;
  w.ram_blocks = -1;
  int64_t pos = 0;
  while (pos < num_full_blocks) {
    const NodeId child = find_child(nodes_[w.node], tokens + pos * block_size_);
    if (child < 0) break;
    const Node& c = nodes_[child];
    if (c.on_disk) {
      if (!through_disk) break;
      if (w.ram_blocks < 0) w.ram_blocks = pos;
    }
    const int64_t edge = edge_blocks(c);
    const int64_t j = matching_blocks(c, tokens + pos * block_size_, num_full_blocks - pos);
    if (!c.on_disk) {
      if (collect) collect->insert(collect->end(), c.blocks.begin(), c.blocks.begin() + j);
      if (c.lock_count == 0) w.unlocked_blocks += j;
    }
    pos += j;
    if (j < edge) {
      w.partial = child;
      w.partial_blocks = j;
      break;
    }
    w.node = child;
  }
  w.blocks = pos;
  if (w.ram_blocks < 0) w.ram_blocks = pos;
  return w;
}

// Blocks the disk tier holds right after a walk that stopped before disk nodes.
int64_t RadixCache::disk_after(const Walk& w, const int32_t* tokens,
                               int64_t num_full_blocks) const {
  if (disk_blocks_ == 0 || w.partial >= 0) return 0;
  int64_t pos = w.blocks;
  NodeId x = w.node;
  while (pos < num_full_blocks) {
    const NodeId child = find_child(nodes_[x], tokens + pos * block_size_);
    if (child < 0 || !nodes_[child].on_disk) break;
    const int64_t j =
        matching_blocks(nodes_[child], tokens + pos * block_size_, num_full_blocks - pos);
    pos += j;
    if (j < edge_blocks(nodes_[child])) break;
    x = child;
  }
  return pos - w.blocks;
}

NodeId RadixCache::new_node() {
  NodeId id;
  if (!free_nodes_.empty()) {
    id = free_nodes_.back();
    free_nodes_.pop_back();
  } else {
    if (nodes_.size() >= static_cast<size_t>(std::numeric_limits<NodeId>::max())) {
      throw ProtocolError("radix cache: too many nodes");
    }
    id = static_cast<NodeId>(nodes_.size());
    nodes_.emplace_back();
  }
  nodes_[id].live = true;
  return id;
}

// Cuts `child`'s edge after keep_blocks blocks: a new node takes the first part and becomes the
// child's parent. The child keeps its id (handles to it stay valid), its depth and its LRU entry.
NodeId RadixCache::split(NodeId child, int64_t keep_blocks) {
  const NodeId mid = new_node();  // may grow nodes_: take references only after this
  Node& c = nodes_[child];
  Node& m = nodes_[mid];
  Node& p = nodes_[c.parent];
  const size_t keep_tokens = static_cast<size_t>(keep_blocks * block_size_);
  m.key = c.key;
  m.parent = c.parent;
  m.lock_count = c.lock_count;
  m.last_access = c.last_access;
  m.on_disk = c.on_disk;
  m.ram_children = c.on_disk ? 0 : 1;
  m.depth = c.depth - (edge_blocks(c) - keep_blocks) * block_size_;
  if (c.on_disk) {
    m.keys.assign(c.keys.begin(), c.keys.begin() + keep_blocks);
    c.keys.erase(c.keys.begin(), c.keys.begin() + keep_blocks);
  } else {
    m.blocks.assign(c.blocks.begin(), c.blocks.begin() + keep_blocks);
    c.blocks.erase(c.blocks.begin(), c.blocks.begin() + keep_blocks);
  }
  m.tokens.assign(c.tokens.begin(), c.tokens.begin() + static_cast<int64_t>(keep_tokens));
  c.tokens.erase(c.tokens.begin(), c.tokens.begin() + static_cast<int64_t>(keep_tokens));
  c.key = hash_tokens(c.tokens.data());
  c.parent = mid;
  for (BlockId b : m.blocks) block_node_[b] = mid;
  auto range = p.children.equal_range(m.key);
  for (auto it = range.first; it != range.second; ++it) {
    if (it->second == child) {
      it->second = mid;
      break;
    }
  }
  m.children.emplace(c.key, child);
  return mid;
}

void RadixCache::unlist(NodeId node) {
  Node& n = nodes_[node];
  if (n.listed) {
    lru_leaves_.erase(n.lru_entry);
    n.listed = false;
  }
}

void RadixCache::relist(NodeId node) {
  Node& n = nodes_[node];
  if (!n.listed && node != kRootNode && n.live && !n.on_disk && n.ram_children == 0 &&
      n.lock_count == 0) {
    // Mostly the newest entry (a leaf just used): the hint makes that insertion O(1).
    n.lru_entry = lru_leaves_.emplace_hint(lru_leaves_.end(), n.last_access, node);
    n.listed = true;
  }
}

// Stamps node and its ancestors up to `stop` (inclusive; -1: up to the root) with the clock.
// Only `node` itself can be a listed leaf (its ancestors have children); its LRU entry is re-keyed
// in place, without an allocation, and goes to the end: no entry is newer than the clock.
void RadixCache::touch(NodeId node, NodeId stop) {
  for (NodeId x = node; x >= 0; x = nodes_[x].parent) {
    nodes_[x].last_access = clock_;
    if (x == stop) break;
  }
  Node& n = nodes_[node];
  if (n.listed) {
    auto entry = lru_leaves_.extract(n.lru_entry);
    entry.value().first = clock_;
    n.lru_entry = lru_leaves_.insert(lru_leaves_.end(), std::move(entry));
  } else {
    relist(node);
  }
}

PrefixMatch RadixCache::match_prefix(const int32_t* tokens, size_t n, bool count_stats) {
  PrefixMatch result;
  const int64_t num_full = static_cast<int64_t>(n / static_cast<size_t>(block_size_));
  result.blocks.reserve(static_cast<size_t>(num_full));
  const Walk w = walk(kRootNode, tokens, num_full, &result.blocks);
  result.node = w.partial >= 0 ? split(w.partial, w.partial_blocks) : w.node;
  result.num_tokens = w.blocks * block_size_;
  result.disk_blocks = disk_after(w, tokens, num_full);
  ++clock_;
  touch(result.node);
  if (count_stats) {
    query_tokens_ += static_cast<int64_t>(n);
    hit_tokens_ += result.num_tokens;
  }
  return result;
}

PrefixPeek RadixCache::peek_prefix(const int32_t* tokens, size_t n) const {
  const int64_t num_full = static_cast<int64_t>(n / static_cast<size_t>(block_size_));
  const Walk w = walk(kRootNode, tokens, num_full, nullptr);
  return PrefixPeek{w.blocks, w.unlocked_blocks, disk_after(w, tokens, num_full)};
}

InsertResult RadixCache::insert_from(NodeId start, const int32_t* tokens, size_t n,
                                     const BlockId* ids, size_t num_ids) {
  check_node(start, "insert");
  const size_t num_full = n / static_cast<size_t>(block_size_);
  if (num_ids < num_full) {
    throw ValueError("insert: " + std::to_string(n) + " tokens make " + std::to_string(num_full) +
                     " whole blocks but only " + std::to_string(num_ids) + " block ids were given");
  }
  BlockId lowest = 0;
  BlockId highest = 0;
  for (size_t i = 0; i < num_full; ++i) {  // branch-free, so that it vectorizes
    lowest = std::min(lowest, ids[i]);
    highest = std::max(highest, ids[i]);
  }
  if (lowest < 0 || highest >= allocator_.num_blocks()) {
    const BlockId bad = lowest < 0 ? lowest : highest;
    throw ValueError("insert: block id " + std::to_string(bad) + " is out of range [0, " +
                     std::to_string(allocator_.num_blocks()) + ")");
  }
  const Walk w = walk(start, tokens, static_cast<int64_t>(num_full), nullptr, true);
  const size_t cached = static_cast<size_t>(w.ram_blocks);  // in RAM; then disk up to w.blocks
  const size_t matched = static_cast<size_t>(w.blocks);

  // Validate the blocks to adopt before changing anything.
  std::string error;
  for (size_t i = cached; i < num_full && error.empty(); ++i) {
    const BlockId b = ids[i];
    if (allocator_.refcounts()[b] == 0) {
      error = "insert: block " + std::to_string(b) + " is free; insert needs blocks holding KV";
    } else if (block_node_[b] >= 0) {
      error = "insert: block " + std::to_string(b) + " is already in the cache";
    } else if (scratch_mark_[b]) {
      error = "insert: block " + std::to_string(b) + " is given twice";
    }
    scratch_mark_[b] = 1;
  }
  for (size_t i = cached; i < num_full; ++i) scratch_mark_[ids[i]] = 0;
  if (!error.empty()) throw ValueError(error);

  ++clock_;
  InsertResult result;
  NodeId node = w.partial >= 0 ? split(w.partial, w.partial_blocks) : w.node;
  if (matched > cached) {  // bring the matched disk nodes back to RAM, top down
    std::vector<NodeId> path;
    for (NodeId x = node; nodes_[x].on_disk; x = nodes_[x].parent) path.push_back(x);
    const int64_t base = nodes_[start].depth;
    for (auto it = path.rbegin(); it != path.rend(); ++it) {
      const Node& d = nodes_[*it];
      const int64_t first = (d.depth - edge_blocks(d) * block_size_ - base) / block_size_;
      to_ram(*it, ids + first, result.loads);
    }
  }
  if (matched < num_full) {
    const size_t count = num_full - matched;
    const int32_t* new_tokens = tokens + matched * static_cast<size_t>(block_size_);
    Node& own = nodes_[node];
    if (node == start && node != kRootNode && own.children.empty() && own.lock_count == 1) {
      own.blocks.insert(own.blocks.end(), ids + matched, ids + num_full);
      own.tokens.insert(own.tokens.end(), new_tokens, new_tokens + count * block_size_);
      own.depth += static_cast<int64_t>(count) * block_size_;
      adopt(node, ids + matched, count);  // locked: not evictable
    } else {
      const NodeId leaf = new_node();
      unlist(node);  // it gains a child, so it is no longer a leaf
      Node& parent = nodes_[node];
      Node& l = nodes_[leaf];
      l.parent = node;
      l.blocks.assign(ids + matched, ids + num_full);
      l.tokens.assign(new_tokens, new_tokens + count * block_size_);
      l.key = hash_tokens(new_tokens);
      l.depth = parent.depth + static_cast<int64_t>(count) * block_size_;
      adopt(leaf, ids + matched, count);
      parent.children.emplace(l.key, leaf);
      ++parent.ram_children;
      evictable_blocks_ += static_cast<int64_t>(count);
      node = leaf;
    }
  }
  touch(node, start);
  result.cached_tokens = static_cast<int64_t>(cached) * block_size_;
  result.node = node;
  return result;
}

// Maps blocks joining `node` to it and takes the tree's reference on them.
void RadixCache::adopt(NodeId node, const BlockId* ids, size_t count) {
  for (size_t i = 0; i < count; ++i) block_node_[ids[i]] = node;
  allocator_.incref(ids, count);
  cached_blocks_ += static_cast<int64_t>(count);
  inserted_blocks_ += static_cast<int64_t>(count);
}

void RadixCache::check_node(NodeId node, const char* what) const {
  if (!is_live(node)) {
    throw ValueError(std::string(what) + ": " + std::to_string(node) +
                     " is not a live cache node handle");
  }
}

bool RadixCache::is_live(NodeId node) const {
  return node >= 0 && static_cast<size_t>(node) < nodes_.size() && nodes_[node].live;
}

int32_t RadixCache::lock_count(NodeId node) const {
  check_node(node, "lock_count");
  return nodes_[node].lock_count;
}

NodeId RadixCache::parent(NodeId node) const {
  check_node(node, "parent");
  return nodes_[node].parent;
}

int64_t RadixCache::depth(NodeId node) const {
  check_node(node, "depth");
  return nodes_[node].depth;
}

std::vector<BlockId> RadixCache::path_blocks(NodeId node) const {
  check_node(node, "path_blocks");
  std::vector<NodeId> path;
  for (NodeId x = node; x > kRootNode; x = nodes_[x].parent) path.push_back(x);
  std::vector<BlockId> blocks;
  for (auto it = path.rbegin(); it != path.rend(); ++it) {
    blocks.insert(blocks.end(), nodes_[*it].blocks.begin(), nodes_[*it].blocks.end());
  }
  return blocks;
}

void RadixCache::lock(NodeId node) {
  check_node(node, "lock");
  if (nodes_[node].on_disk) {
    throw ValueError("lock: node " + std::to_string(node) + " is on disk; only RAM nodes lock");
  }
  for (NodeId x = node; x >= 0; x = nodes_[x].parent) {
    Node& n = nodes_[x];
    if (n.lock_count == 0 && x != kRootNode) {
      unlist(x);
      evictable_blocks_ -= static_cast<int64_t>(n.blocks.size());
    }
    ++n.lock_count;
  }
}

void RadixCache::unlock(NodeId node) {
  check_node(node, "unlock");
  if (nodes_[node].lock_count <= 0) {
    throw ValueError("unlock: node " + std::to_string(node) +
                     " is not locked; lock counts never go below 0");
  }
  for (NodeId x = node; x >= 0; x = nodes_[x].parent) {
    Node& n = nodes_[x];
    if (--n.lock_count == 0 && x != kRootNode) {
      evictable_blocks_ += static_cast<int64_t>(n.blocks.size());
      relist(x);
    }
  }
}

void RadixCache::move_lock(NodeId from, NodeId to) {
  check_node(from, "move_lock");
  check_node(to, "move_lock");
  if (nodes_[from].lock_count <= 0) {
    throw ValueError("move_lock: node " + std::to_string(from) + " is not locked");
  }
  NodeId x = to;
  while (x != from && x >= 0) x = nodes_[x].parent;
  if (x != from) {
    throw ValueError("move_lock: node " + std::to_string(to) + " is not below node " +
                     std::to_string(from));
  }
  for (x = to; x != from; x = nodes_[x].parent) {
    Node& n = nodes_[x];
    if (n.lock_count++ == 0) {
      unlist(x);
      evictable_blocks_ -= static_cast<int64_t>(n.blocks.size());
    }
  }
}

void RadixCache::release(NodeId node) {
  unlock(node);
  ++clock_;
  touch(node);
}

int64_t RadixCache::remove_leaf(NodeId node) {
  Node& n = nodes_[node];
  const NodeId parent_id = n.parent;
  unlist(node);
  int64_t freed = 0;
  for (BlockId b : n.blocks) {
    block_node_[b] = -1;
    allocator_.decref(b);
    freed += allocator_.refcounts()[b] == 0 ? 1 : 0;
  }
  const int64_t dropped = static_cast<int64_t>(n.blocks.size());
  cached_blocks_ -= dropped;
  evictable_blocks_ -= dropped;
  evicted_blocks_ += dropped;
  --nodes_[parent_id].ram_children;
  detach(node);
  relist(parent_id);
  return freed;
}

// Takes a node out of its parent's children and frees its id; the caller fixed the counters.
void RadixCache::detach(NodeId node) {
  Node& n = nodes_[node];
  Node& p = nodes_[n.parent];
  auto range = p.children.equal_range(n.key);
  for (auto it = range.first; it != range.second; ++it) {
    if (it->second == node) {
      p.children.erase(it);
      break;
    }
  }
  // Reset for reuse, keeping the vectors' capacity: the next split or leaf skips a malloc.
  n.parent = -1;
  n.depth = 0;
  n.lock_count = 0;
  n.last_access = 0;
  n.live = false;
  n.key = 0;
  n.on_disk = false;
  n.ram_children = 0;
  n.blocks.clear();
  n.keys.clear();
  n.tokens.clear();
  n.children.clear();
  free_nodes_.push_back(node);
}

uint64_t RadixCache::next_key(uint64_t prev, uint64_t block_hash) {
  uint64_t h = (prev ^ block_hash) * 0x94D049BB133111EBULL;
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ULL;
  return h ^ (h >> 29);
}

uint64_t RadixCache::chain_key(NodeId node) const {
  constexpr uint64_t kSeed = 0x6A09E667F3BCC908ULL;
  if (node == kRootNode) return kSeed;
  const Node& n = nodes_[node];
  if (n.on_disk) return n.keys.back();
  uint64_t key = chain_key(n.parent);
  for (int64_t i = 0; i < edge_blocks(n); ++i)
    key = next_key(key, hash_tokens(&n.tokens[i * block_size_]));
  return key;
}

std::vector<uint64_t> RadixCache::block_keys(const int32_t* tokens, size_t n) const {
  const size_t num_full = n / static_cast<size_t>(block_size_);
  std::vector<uint64_t> keys(num_full);
  uint64_t key = chain_key(kRootNode);
  for (size_t i = 0; i < num_full; ++i) {
    key = next_key(key, hash_tokens(tokens + i * static_cast<size_t>(block_size_)));
    keys[i] = key;
  }
  return keys;
}

void RadixCache::disk_relist(NodeId node) {
  Node& n = nodes_[node];
  if (!n.disk_listed && n.live && n.on_disk && n.children.empty()) {
    n.disk_entry = disk_leaves_.emplace(n.last_access, node).first;
    n.disk_listed = true;
  }
}

void RadixCache::disk_unlist(NodeId node) {
  Node& n = nodes_[node];
  if (n.disk_listed) {
    disk_leaves_.erase(n.disk_entry);
    n.disk_listed = false;
  }
}

// An unlocked RAM node without RAM children becomes a disk node: its blocks are freed and one
// save per block is queued (the blocks' contents stay valid until the caller reuses them).
void RadixCache::to_disk(NodeId node) {
  uint64_t key = chain_key(nodes_[node].parent);
  Node& n = nodes_[node];
  const int64_t count = edge_blocks(n);
  n.keys.resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const BlockId b = n.blocks[i];
    const uint64_t parent = key;
    key = next_key(key, hash_tokens(&n.tokens[i * block_size_]));
    n.keys[i] = key;
    const auto first = n.tokens.begin() + i * block_size_;
    pending_saves_.push_back(
        DiskOp{b, key, parent, std::vector<int32_t>(first, first + block_size_)});
    block_node_[b] = -1;
    allocator_.decref(b);
  }
  unlist(node);
  n.blocks.clear();
  n.on_disk = true;
  cached_blocks_ -= count;
  evictable_blocks_ -= count;
  evicted_blocks_ += count;
  saved_blocks_ += count;
  disk_blocks_ += count;
  --nodes_[n.parent].ram_children;
  relist(n.parent);
  disk_relist(node);
}

// A disk node takes the caller's blocks ids[0, edge) and queues them as loads.
void RadixCache::to_ram(NodeId node, const BlockId* ids, std::vector<DiskOp>& loads) {
  Node& n = nodes_[node];
  const int64_t count = edge_blocks(n);
  for (int64_t i = 0; i < count; ++i) loads.push_back(DiskOp{ids[i], n.keys[i], 0, {}});
  disk_unlist(node);
  n.keys.clear();
  n.on_disk = false;
  n.blocks.assign(ids, ids + count);
  for (int64_t i = 0; i < count; ++i) block_node_[ids[i]] = node;
  allocator_.incref(ids, static_cast<size_t>(count));
  cached_blocks_ += count;
  evictable_blocks_ += count;  // a disk node is never locked
  disk_blocks_ -= count;
  loaded_blocks_ += count;
  ++nodes_[n.parent].ram_children;
  unlist(n.parent);
  relist(node);
}

int64_t RadixCache::remove_disk_leaf(NodeId node, bool queue_drops) {
  Node& n = nodes_[node];
  const NodeId parent_id = n.parent;
  const int64_t count = edge_blocks(n);
  // A save not yet taken stays, its drop after it: a load planned in the same step may name the
  // key (the worker saves, loads, then drops), and cancelling the save would leave it unreadable.
  if (queue_drops) pending_drops_.insert(pending_drops_.end(), n.keys.begin(), n.keys.end());
  disk_unlist(node);
  disk_blocks_ -= count;
  disk_evicted_blocks_ += count;
  detach(node);
  disk_relist(parent_id);
  return count;
}

void RadixCache::trim_disk(int64_t max_blocks) {
  while (disk_blocks_ > max_blocks && !disk_leaves_.empty()) {
    remove_disk_leaf(disk_leaves_.begin()->second, true);
  }
}

void RadixCache::set_disk_budget(int64_t max_blocks) {
  if (max_blocks < 0) {
    throw ValueError("set_disk_budget: max_blocks must be >= 0, got " + std::to_string(max_blocks));
  }
  disk_budget_ = max_blocks;
  trim_disk(max_blocks);
}

int64_t RadixCache::insert_disk(const int32_t* tokens, size_t n) {
  const int64_t num_full = static_cast<int64_t>(n / static_cast<size_t>(block_size_));
  const Walk w = walk(kRootNode, tokens, num_full, nullptr, true);
  const int64_t count = std::min(num_full - w.blocks, disk_budget_ - disk_blocks_);
  if (count <= 0) return 0;
  ++clock_;
  const NodeId node = w.partial >= 0 ? split(w.partial, w.partial_blocks) : w.node;
  const NodeId leaf = new_node();
  disk_unlist(node);  // it gains a child
  const uint64_t prev = chain_key(node);
  Node& parent = nodes_[node];
  Node& l = nodes_[leaf];
  const int32_t* new_tokens = tokens + w.blocks * block_size_;
  l.parent = node;
  l.on_disk = true;
  l.tokens.assign(new_tokens, new_tokens + count * block_size_);
  l.key = hash_tokens(new_tokens);
  l.depth = parent.depth + count * block_size_;
  l.keys.resize(static_cast<size_t>(count));
  uint64_t key = prev;
  for (int64_t i = 0; i < count; ++i) {
    key = next_key(key, hash_tokens(new_tokens + i * block_size_));
    l.keys[i] = key;
  }
  parent.children.emplace(l.key, leaf);
  disk_blocks_ += count;
  // Stamp the path, newest at the leaf, so that no unlocked node is older than its child: the
  // deepest RAM node through touch (its LRU entry is the only one on the path to re-key), the
  // disk nodes below it directly (none of them is a disk leaf any more).
  NodeId ram = node;
  while (nodes_[ram].on_disk) {
    nodes_[ram].last_access = clock_;
    ram = nodes_[ram].parent;
  }
  touch(ram);
  l.last_access = clock_;
  disk_relist(leaf);
  return count;
}

int64_t RadixCache::forget_disk(NodeId node, const int32_t* tokens) {
  check_node(node, "forget_disk");
  const NodeId child = find_child(nodes_[node], tokens);
  if (child < 0 || !nodes_[child].on_disk) return 0;
  std::vector<NodeId> order{child};  // parents before children: removed in reverse
  for (size_t i = 0; i < order.size(); ++i) {
    for (const auto& entry : nodes_[order[i]].children) order.push_back(entry.second);
  }
  int64_t forgotten = 0;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    forgotten += remove_disk_leaf(*it, true);
  }
  return forgotten;
}

std::vector<uint64_t> RadixCache::disk_keys() const {
  std::vector<uint64_t> keys;
  keys.reserve(static_cast<size_t>(disk_blocks_));
  for (const Node& n : nodes_) {
    if (n.live && n.on_disk) keys.insert(keys.end(), n.keys.begin(), n.keys.end());
  }
  return keys;
}

void RadixCache::queue_drops(const std::vector<uint64_t>& keys) {
  pending_drops_.insert(pending_drops_.end(), keys.begin(), keys.end());
}

std::vector<DiskOp> RadixCache::take_saves() {
  std::vector<DiskOp> out;
  out.swap(pending_saves_);
  return out;
}

std::vector<uint64_t> RadixCache::take_drops() {
  std::vector<uint64_t> out;
  out.swap(pending_drops_);
  return out;
}

int64_t RadixCache::evict(int64_t num_blocks) {
  if (num_blocks < 0) {
    throw ValueError("evict: num_blocks must be >= 0, got " + std::to_string(num_blocks));
  }
  int64_t released = 0;
  while (released < num_blocks && !lru_leaves_.empty()) {
    const NodeId victim = lru_leaves_.begin()->second;
    if (disk_budget_ == 0) {
      released += remove_leaf(victim);
      continue;
    }
    const int64_t before = allocator_.num_free();
    to_disk(victim);
    released += allocator_.num_free() - before;
    trim_disk(disk_budget_);
  }
  return released;
}

int64_t RadixCache::reset() {
  while (!disk_leaves_.empty()) remove_disk_leaf(disk_leaves_.begin()->second, false);
  pending_saves_.clear();
  pending_drops_.clear();
  int64_t released = 0;
  while (!lru_leaves_.empty()) released += remove_leaf(lru_leaves_.begin()->second);
  return released;
}

CacheStats RadixCache::stats() const {
  return CacheStats{cached_blocks_,  evictable_blocks_, hit_tokens_,         query_tokens_,
                    evicted_blocks_, inserted_blocks_,  disk_blocks_,        disk_budget_,
                    saved_blocks_,   loaded_blocks_,    disk_evicted_blocks_};
}

void RadixCache::check_invariants() const {
  auto fail = [](const std::string& msg) { throw InvariantError("radix cache: " + msg); };
  const Node& root = nodes_[kRootNode];
  if (!root.live || root.parent != -1 || !root.blocks.empty() || root.depth != 0) {
    fail("the root must be live, parentless and empty");
  }
  int64_t cached = 0;
  int64_t evictable = 0;
  int64_t on_disk = 0;
  int64_t live = 0;
  size_t listed = 0;
  size_t disk_listed = 0;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const NodeId id = static_cast<NodeId>(i);
    const Node& n = nodes_[i];
    if (!n.live) continue;
    ++live;
    const std::string name = "node " + std::to_string(id);
    if (n.lock_count < 0) fail(name + " has a negative lock count");
    int64_t child_locks = 0;
    int32_t ram_children = 0;
    for (const auto& [key, child_id] : n.children) {
      if (!is_live(child_id) || nodes_[child_id].parent != id) {
        fail(name + " lists child " + std::to_string(child_id) + " that is not its child");
      }
      const Node& c = nodes_[child_id];
      if (key != c.key || c.key != hash_tokens(c.tokens.data())) {
        fail(name + " keys a child by the wrong hash");
      }
      if (n.lock_count == 0 && c.last_access > n.last_access) {
        fail(name + " is unlocked and older than its child");
      }
      child_locks += c.lock_count;
      ram_children += c.on_disk ? 0 : 1;
      if (n.on_disk && !c.on_disk) fail(name + " is on disk with a child in RAM");
      auto range = n.children.equal_range(key);
      for (auto it = range.first; it != range.second; ++it) {
        if (it->second != child_id &&
            same_block(nodes_[it->second].tokens.data(), c.tokens.data())) {
          fail(name + " has two children starting with the same block");
        }
      }
    }
    if (child_locks > n.lock_count) fail(name + " has fewer locks than its children together");
    if (ram_children != n.ram_children) fail(name + " miscounts its RAM children");
    const bool should_list =
        id != kRootNode && !n.on_disk && ram_children == 0 && n.lock_count == 0;
    const bool listed_now = lru_leaves_.count({n.last_access, id}) > 0;
    if (should_list != listed_now) {
      fail(name + (should_list ? " is an unlocked leaf missing from" : " must not be in") +
           " the LRU set");
    }
    if (n.listed != listed_now || (n.listed && *n.lru_entry != std::make_pair(n.last_access, id))) {
      fail(name + " has a stale LRU entry");
    }
    listed += listed_now ? 1 : 0;
    const bool disk_should_list = n.on_disk && n.children.empty();
    const bool disk_listed_now = disk_leaves_.count({n.last_access, id}) > 0;
    if (disk_should_list != disk_listed_now || n.disk_listed != disk_listed_now) {
      fail(name + (disk_should_list ? " is a disk leaf missing from" : " must not be in") +
           " the disk LRU set");
    }
    disk_listed += disk_listed_now ? 1 : 0;
    if (id == kRootNode) {
      if (n.on_disk) fail("the root is on disk");
      continue;
    }
    if (!is_live(n.parent)) fail(name + " has a dead parent");
    const size_t held = n.on_disk ? n.keys.size() : n.blocks.size();
    if (held == 0) fail(name + " has an empty edge");
    if ((n.on_disk && !n.blocks.empty()) || (!n.on_disk && !n.keys.empty())) {
      fail(name + " holds both block ids and disk keys");
    }
    const int64_t edge_tokens = static_cast<int64_t>(held) * block_size_;
    if (n.depth != nodes_[n.parent].depth + edge_tokens) fail(name + " has a wrong depth");
    if (static_cast<int64_t>(n.tokens.size()) != edge_tokens) {
      fail(name + " holds " + std::to_string(n.tokens.size()) + " tokens for " +
           std::to_string(held) + " blocks");
    }
    if (n.on_disk) {
      if (n.lock_count != 0) fail(name + " is on disk and locked");
      uint64_t key = chain_key(n.parent);
      for (size_t k = 0; k < n.keys.size(); ++k) {
        key = next_key(key, hash_tokens(&n.tokens[k * static_cast<size_t>(block_size_)]));
        if (n.keys[k] != key) fail(name + " has a disk key that is not its path's");
      }
      on_disk += static_cast<int64_t>(n.keys.size());
    }
    for (BlockId b : n.blocks) {
      if (block_node_[b] != id) fail("block " + std::to_string(b) + " is not mapped to " + name);
      if (allocator_.refcounts()[b] < 1) {
        fail("block " + std::to_string(b) + " is in the tree with refcount 0");
      }
    }
    cached += static_cast<int64_t>(n.blocks.size());
    if (n.lock_count == 0) evictable += static_cast<int64_t>(n.blocks.size());
  }
  if (listed != lru_leaves_.size()) fail("the LRU set holds stale entries");
  if (disk_listed != disk_leaves_.size()) fail("the disk LRU set holds stale entries");
  if (on_disk != disk_blocks_) fail("disk_blocks counter is off");
  if (disk_blocks_ > disk_budget_) fail("the disk tier holds more blocks than its budget");
  if (live != num_nodes()) fail("the free node list is inconsistent");
  int64_t mapped = 0;
  for (NodeId owner : block_node_) mapped += owner >= 0 ? 1 : 0;
  if (mapped != cached) fail("blocks mapped to nodes differ from blocks in nodes");
  if (cached != cached_blocks_) fail("cached_blocks counter is off");
  if (evictable != evictable_blocks_) fail("evictable_blocks counter is off");
  // Every live node must hang off the root.
  std::vector<NodeId> stack{kRootNode};
  int64_t reachable = 0;
  while (!stack.empty()) {
    const NodeId x = stack.back();
    stack.pop_back();
    ++reachable;
    for (const auto& entry : nodes_[x].children) stack.push_back(entry.second);
  }
  if (reachable != live) fail("some live nodes are not reachable from the root");
}

}  // namespace pyserve
