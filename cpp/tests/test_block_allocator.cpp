// BlockAllocator, as a specification.
#include "block_allocator.h"

#include <vector>

#include "check.h"
#include "errors.h"

using pyserve::BlockAllocator;
using pyserve::BlockId;
using pyserve::ProtocolError;
using pyserve::ValueError;
using Ids = std::vector<BlockId>;

TEST(a_fresh_pool_hands_out_ascending_ids_with_refcount_one) {
  BlockAllocator a(4);
  CHECK_EQ(a.num_blocks(), 4);
  CHECK_EQ(a.num_free(), 4);
  CHECK_EQ(a.allocate(3), (Ids{0, 1, 2}));
  CHECK_EQ(a.num_free(), 1);
  for (BlockId id : {0, 1, 2}) CHECK_EQ(a.refcount(id), 1);
  CHECK_EQ(a.refcount(3), 0);
  a.check_invariants();
}

TEST(allocate_zero_is_empty_and_negative_is_a_value_error) {
  BlockAllocator a(2);
  CHECK(a.allocate(0).empty());
  CHECK_THROWS(a.allocate(-1), ValueError);
  CHECK_EQ(a.num_free(), 2);
}

TEST(exhaustion_raises_and_allocates_nothing) {
  BlockAllocator a(3);
  a.allocate(2);
  CHECK_THROWS(a.allocate(2), ProtocolError);
  CHECK_EQ(a.num_free(), 1);
  CHECK_EQ(a.allocate(1), (Ids{2}));
  CHECK_THROWS(a.allocate(1), ProtocolError);
  a.check_invariants();
}

TEST(decref_to_zero_frees_and_the_last_freed_block_is_reused_first) {
  BlockAllocator a(4);
  a.allocate(4);
  a.decref(Ids{1, 3}.data(), 2);
  CHECK_EQ(a.num_free(), 2);
  CHECK_EQ(a.refcount(1), 0);
  CHECK_EQ(a.allocate(1), (Ids{3}));
  CHECK_EQ(a.allocate(1), (Ids{1}));
  a.check_invariants();
}

TEST(shared_blocks_are_freed_by_their_last_owner) {
  BlockAllocator a(2);
  const Ids ids = a.allocate(1);
  a.incref(ids[0]);
  a.incref(ids[0]);
  CHECK_EQ(a.refcount(ids[0]), 3);
  a.decref(ids[0]);
  a.decref(ids[0]);
  CHECK_EQ(a.num_free(), 1);
  a.decref(ids[0]);
  CHECK_EQ(a.num_free(), 2);
  a.check_invariants();
}

TEST(double_free_is_a_value_error) {
  BlockAllocator a(2);
  const Ids ids = a.allocate(1);
  a.decref(ids[0]);
  CHECK_THROWS(a.decref(ids[0]), ValueError);
  CHECK_EQ(a.refcount(ids[0]), 0);
  CHECK_EQ(a.num_free(), 2);
  a.check_invariants();
}

TEST(a_failing_batch_decref_changes_nothing) {
  BlockAllocator a(4);
  a.allocate(3);  // 0, 1, 2 with count 1
  // 0 and 1 would be freed before the second decref of 1 underflows: all of it is undone.
  const Ids batch{0, 1, 1};
  CHECK_THROWS(a.decref(batch.data(), batch.size()), ValueError);
  CHECK_EQ(a.refcount(0), 1);
  CHECK_EQ(a.refcount(1), 1);
  CHECK_EQ(a.num_free(), 1);
  a.check_invariants();
  // A repeated id is fine while the count allows it.
  a.incref(1);
  a.decref(batch.data() + 1, 2);
  CHECK_EQ(a.refcount(1), 0);
  a.check_invariants();
}

TEST(incref_of_a_free_block_and_ids_out_of_range_are_value_errors) {
  BlockAllocator a(2);
  a.allocate(1);
  CHECK_THROWS(a.incref(1), ValueError);
  CHECK_THROWS(a.incref(2), ValueError);
  CHECK_THROWS(a.incref(-1), ValueError);
  CHECK_THROWS(a.decref(7), ValueError);
  CHECK_THROWS(a.refcount(2), ValueError);
  const Ids mixed{0, 5};  // validated before anything changes
  CHECK_THROWS(a.incref(mixed.data(), mixed.size()), ValueError);
  CHECK_EQ(a.refcount(0), 1);
  a.check_invariants();
}

TEST(pool_size_must_be_positive) {
  CHECK_THROWS(BlockAllocator(0), ValueError);
  CHECK_THROWS(BlockAllocator(-5), ValueError);
  CHECK_THROWS(BlockAllocator(int64_t{1} << 40), ValueError);
}

int main() { return check::run_all_tests(); }
