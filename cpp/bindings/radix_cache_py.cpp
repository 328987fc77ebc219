// Python class RadixCache.
#include <string>

#include "arrays.h"
#include "errors.h"
#include "guarded.h"
#include "radix_cache.h"

namespace pyserve_bindings {

using pyserve::BlockAllocator;
using pyserve::NodeId;
using pyserve::RadixCache;
using PyAllocator = Guarded<BlockAllocator>;
using PyCache = Guarded<RadixCache>;

namespace {

// A cache built from Python keeps its allocator alive.
struct StandaloneCache {
  std::shared_ptr<BlockAllocator> allocator;
  RadixCache cache;
  StandaloneCache(std::shared_ptr<BlockAllocator> a, int64_t block_size)
      : allocator(std::move(a)), cache(block_size, *allocator) {}
};

// match_prefix and insert keep the GIL for inputs shorter than this (they take about a
// microsecond there, less than handing the GIL over and back costs); longer ones release it.
constexpr size_t kReleaseGilTokens = 16384;

NodeId to_handle(int64_t handle) {
  if (handle < 0 || handle > INT32_MAX) {
    throw pyserve::ValueError(std::to_string(handle) + " is not a live cache node handle");
  }
  return static_cast<NodeId>(handle);
}

}  // namespace

py::dict cache_stats_dict(const pyserve::CacheStats& s) {
  py::dict d;
  d["cached_blocks"] = s.cached_blocks;
  d["evictable_blocks"] = s.evictable_blocks;
  d["hit_tokens"] = s.hit_tokens;
  d["query_tokens"] = s.query_tokens;
  d["evicted_blocks"] = s.evicted_blocks;
  d["inserted_blocks"] = s.inserted_blocks;
  return d;
}

void bind_radix_cache(py::module_& m) {
  py::class_<PyCache>(m, "RadixCache",
                      "A prefix tree over token ids at block granularity (cpp/README.md).")
      .def(py::init([](int64_t block_size, PyAllocator& allocator) {
             auto owner = std::make_shared<StandaloneCache>(allocator.obj, block_size);
             return PyCache{std::shared_ptr<RadixCache>(owner, &owner->cache), allocator.mutex};
           }),
           py::arg("block_size"), py::arg("allocator"))
      .def_property_readonly(
          "block_size", [](PyCache& c) { return c.held([](auto& x) { return x.block_size(); }); })
      .def_property_readonly(
          "evictable_blocks",
          [](PyCache& c) { return c.held([](auto& x) { return x.evictable_blocks(); }); })
      .def_property_readonly(
          "cached_blocks",
          [](PyCache& c) { return c.held([](auto& x) { return x.cached_blocks(); }); })
      .def_property_readonly(
          "num_nodes", [](PyCache& c) { return c.held([](auto& x) { return x.num_nodes(); }); })
      .def(
          "match_prefix",
          [](PyCache& c, py::handle tokens) {
            Int32Arg t(tokens, "tokens");
            auto r = c.maybe_released(t.size() >= kReleaseGilTokens, [&](RadixCache& x) {
              return x.match_prefix(t.data(), t.size());
            });
            return py::make_tuple(r.num_tokens, to_bytes(r.blocks), r.node);
          },
          py::arg("tokens"),
          "(num_tokens, block_ids, handle) of the longest cached prefix; block_ids: int32 bytes")
      .def(
          "insert",
          [](PyCache& c, py::handle tokens, py::handle block_ids) {
            Int32Arg t(tokens, "tokens");
            Int32Arg b(block_ids, "block_ids");
            return c.maybe_released(t.size() >= kReleaseGilTokens, [&](RadixCache& x) {
              return x.insert(t.data(), t.size(), b.data(), b.size()).cached_tokens;
            });
          },
          py::arg("tokens"), py::arg("block_ids"),
          "inserts the whole blocks; returns how many leading tokens were already cached")
      .def(
          "lock",
          [](PyCache& c, int64_t handle) {
            c.held([h = to_handle(handle)](RadixCache& x) { x.lock(h); });
          },
          py::arg("handle"))
      .def(
          "unlock",
          [](PyCache& c, int64_t handle) {
            c.held([h = to_handle(handle)](RadixCache& x) { x.unlock(h); });
          },
          py::arg("handle"))
      .def(
          "lock_count",
          [](PyCache& c, int64_t handle) {
            return c.held([h = to_handle(handle)](RadixCache& x) { return x.lock_count(h); });
          },
          py::arg("handle"))
      .def(
          "evict",
          [](PyCache& c, int64_t num_blocks) {
            return c.released([num_blocks](RadixCache& x) { return x.evict(num_blocks); });
          },
          py::arg("num_blocks"), "evicts unlocked LRU leaves; returns blocks released")
      .def("reset", [](PyCache& c) { return c.released([](RadixCache& x) { return x.reset(); }); })
      .def("stats",
           [](PyCache& c) { return cache_stats_dict(c.held([](auto& x) { return x.stats(); })); })
      .def("check_invariants",
           [](PyCache& c) { c.held([](RadixCache& x) { x.check_invariants(); }); });
}

}  // namespace pyserve_bindings
