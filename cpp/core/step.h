// Step: one forward pass as planned by the Planner (the fields of cpp/README.md, "Step").
#pragma once

#include <cstdint>
#include <vector>

namespace pyserve {

struct Step {
  int64_t step_id = 0;
  // One value per entry, in entry order.
  std::vector<int64_t> rids;
  std::vector<int32_t> start_pos;   // tokens already in the KV cache for that request
  std::vector<int32_t> num_tokens;  // tokens computed by the entry (1 + drafts for a decode)
  // The first input is the request's last sampled token; any further inputs are drafted
  // tokens to verify (a sample after each of the 1 + k positions): in input_ids with 1, written
  // by the worker's draft model with 2.
  std::vector<uint8_t> is_decode;
  std::vector<uint8_t> sample;         // a token is sampled after the entry
  std::vector<int32_t> block_offsets;  // where the entry's new block ids go in its table
  std::vector<int32_t> block_counts;   // how many new block ids the entry carries
  // Concatenated in entry order.
  // Tokens of the non-decode entries, and the drafts of the decode entries (num_tokens - 1 each).
  std::vector<int32_t> input_ids;
  std::vector<int32_t> block_ids;
  // Request ids, not entries.
  std::vector<int64_t> dropped;    // finished or aborted since the previous step
  std::vector<int64_t> retracted;  // retracted while planning this step
  // The disk tier (PlannerConfig::disk_budget_blocks), done before this step's forward pass, in
  // this order: with clear_disk, delete every block file (the cache was flushed since the last
  // step: this step's saves are of blocks evicted after it); save block save_blocks[i]'s K/V as
  // save_keys[i] (evicted while planning this step: the step may write into the block, so the
  // copy comes first), its parent key and block_size tokens beside it; fill block
  // load_blocks[i] from the file of load_keys[i] (the report names the blocks whose load failed:
  // Planner::fail_loads); delete the files of drop_keys.
  std::vector<int32_t> save_blocks;
  std::vector<uint64_t> save_keys;
  std::vector<uint64_t> save_parents;
  std::vector<int32_t> save_tokens;
  std::vector<int32_t> load_blocks;
  std::vector<uint64_t> load_keys;
  std::vector<uint64_t> drop_keys;
  bool clear_disk = false;
  int64_t num_prefill_tokens = 0;
  int64_t num_decode_tokens = 0;  // positions computed by decode entries, drafts included

  size_t num_entries() const { return rids.size(); }
};

}  // namespace pyserve
