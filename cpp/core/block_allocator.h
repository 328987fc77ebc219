// BlockAllocator: a fixed pool of KV-cache blocks with reference counts.
//
// Design: a block with refcount 0 is free and sits on the free list exactly once; any other
// block is held by refcount owners (the radix cache, running requests). allocate pops from the
// free list and incref/decref adjust counts, so every operation is O(1) per block. The free list
// is a stack: a fresh pool hands out 0, 1, 2, ... and a freed block is the next one reused.
// Every batch operation validates first and changes nothing when it throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pyserve {

using BlockId = int32_t;

class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t num_blocks);

  int32_t num_blocks() const { return static_cast<int32_t>(refcounts_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_list_.size()); }

  // Appends n fresh blocks (refcount 1) to `out`. ProtocolError when fewer than n are free
  // (nothing is allocated then); ValueError when n < 0.
  void allocate(int64_t n, std::vector<BlockId>& out);
  std::vector<BlockId> allocate(int64_t n);

  // ValueError for an id out of range or a block that is free (only held blocks gain owners).
  void incref(const BlockId* ids, size_t count);
  // ValueError for an id out of range or a count that would drop below 0. A block whose count
  // reaches 0 returns to the free list.
  void decref(const BlockId* ids, size_t count);
  void incref(BlockId id) { incref(&id, 1); }
  void decref(BlockId id) { decref(&id, 1); }

  int32_t refcount(BlockId id) const;
  const std::vector<int32_t>& refcounts() const { return refcounts_; }

  // InvariantError unless: no count is negative, and the free list holds exactly the blocks
  // with count 0, each once.
  void check_invariants() const;

 private:
  void check_id(BlockId id, const char* what) const;

  std::vector<int32_t> refcounts_;
  std::vector<BlockId> free_list_;  // a stack; back() is allocated next
};

}  // namespace pyserve
