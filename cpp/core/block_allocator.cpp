#include "block_allocator.h"

#include <string>

#include "errors.h"

namespace pyserve {

BlockAllocator::BlockAllocator(int64_t num_blocks) {
  if (num_blocks < 1 || num_blocks > INT32_MAX) {
    throw ValueError("num_blocks must be in [1, 2**31-1], got " + std::to_string(num_blocks));
  }
  refcounts_.assign(static_cast<size_t>(num_blocks), 0);
  free_list_.reserve(static_cast<size_t>(num_blocks));
  for (int64_t id = num_blocks - 1; id >= 0; --id) free_list_.push_back(static_cast<BlockId>(id));
}

void BlockAllocator::allocate(int64_t n, std::vector<BlockId>& out) {
  if (n < 0) throw ValueError("cannot allocate a negative number of blocks: " + std::to_string(n));
  if (n > num_free()) {
    throw ProtocolError("out of KV blocks: asked for " + std::to_string(n) + ", " +
                        std::to_string(num_free()) + " of " + std::to_string(num_blocks()) +
                        " are free");
  }
  out.reserve(out.size() + static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const BlockId id = free_list_.back();
    free_list_.pop_back();
    refcounts_[id] = 1;
    out.push_back(id);
  }
}

std::vector<BlockId> BlockAllocator::allocate(int64_t n) {
  std::vector<BlockId> out;
  allocate(n, out);
  return out;
}

void BlockAllocator::check_id(BlockId id, const char* what) const {
  if (id < 0 || id >= num_blocks()) {
    throw ValueError(std::string(what) + ": block id " + std::to_string(id) +
                     " is out of range [0, " + std::to_string(num_blocks()) + ")");
  }
}

void BlockAllocator::incref(const BlockId* ids, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    check_id(ids[i], "incref");
    if (refcounts_[ids[i]] == 0) {
      throw ValueError("incref: block " + std::to_string(ids[i]) +
                       " is free; only a held block can gain an owner");
    }
  }
  for (size_t i = 0; i < count; ++i) ++refcounts_[ids[i]];
}

void BlockAllocator::decref(const BlockId* ids, size_t count) {
  for (size_t i = 0; i < count; ++i) check_id(ids[i], "decref");
  // Apply in order; on an underflow undo what was done (in reverse, so the blocks pushed on the
  // free list come off it again) and throw. Repeated ids in one call are handled naturally.
  for (size_t i = 0; i < count; ++i) {
    const BlockId id = ids[i];
    if (refcounts_[id] == 0) {
      for (size_t j = i; j-- > 0;) {
        if (refcounts_[ids[j]] == 0) free_list_.pop_back();
        ++refcounts_[ids[j]];
      }
      throw ValueError("decref: block " + std::to_string(id) +
                       " has refcount 0 (double free?); counts never go below 0");
    }
    if (--refcounts_[id] == 0) free_list_.push_back(id);
  }
}

int32_t BlockAllocator::refcount(BlockId id) const {
  check_id(id, "refcount");
  return refcounts_[id];
}

void BlockAllocator::check_invariants() const {
  std::vector<uint8_t> on_free_list(refcounts_.size(), 0);
  for (BlockId id : free_list_) {
    if (id < 0 || id >= num_blocks()) {
      throw InvariantError("free list holds out-of-range block " + std::to_string(id));
    }
    if (on_free_list[id]) {
      throw InvariantError("block " + std::to_string(id) + " is on the free list twice");
    }
    on_free_list[id] = 1;
    if (refcounts_[id] != 0) {
      throw InvariantError("block " + std::to_string(id) + " is on the free list with refcount " +
                           std::to_string(refcounts_[id]));
    }
  }
  for (size_t id = 0; id < refcounts_.size(); ++id) {
    if (refcounts_[id] < 0) {
      throw InvariantError("block " + std::to_string(id) + " has negative refcount " +
                           std::to_string(refcounts_[id]));
    }
    if (refcounts_[id] == 0 && !on_free_list[id]) {
      throw InvariantError("block " + std::to_string(id) +
                           " has refcount 0 but is not on the free list");
    }
  }
}

}  // namespace pyserve
