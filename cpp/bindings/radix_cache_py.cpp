// Python class RadixCache.
#include <string>

#include "arrays.h"
#include "errors.h"
#include "fastcall.h"
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

// match_prefix and insert keep the GIL for inputs shorter than this (on a 1k-token prompt they
// take a microsecond or less, no more than handing the GIL to another thread and back); longer
// ones release it, and so does a short one that has to wait for the mutex (Guarded).
constexpr size_t kReleaseGilTokens = 16384;

NodeId to_handle(int64_t handle) {
  if (handle < 0 || handle > INT32_MAX) {
    throw pyserve::ValueError(std::to_string(handle) + " is not a live cache node handle");
  }
  return static_cast<NodeId>(handle);
}

// match_prefix(tokens) -> (num_tokens, block_ids: int32 bytes, handle)
PyObject* match_prefix(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&]() -> PyObject* {
    PyObject* arg[1];
    parse_args("match_prefix", args, nargs, kwnames, {"tokens"}, arg);
    PyCache& c = self_object<PyCache>(self);
    Int32Arg t(arg[0], "tokens");
    auto r = c.maybe_released(t.size() >= kReleaseGilTokens,
                              [&](RadixCache& x) { return x.match_prefix(t.data(), t.size()); });
    return py::make_tuple(r.num_tokens, to_bytes(r.blocks), r.node).release().ptr();
  });
}

// insert(tokens, block_ids) -> int
PyObject* insert(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&]() -> PyObject* {
    PyObject* arg[2];
    parse_args("insert", args, nargs, kwnames, {"tokens", "block_ids"}, arg);
    PyCache& c = self_object<PyCache>(self);
    Int32Arg t(arg[0], "tokens");
    Int32Arg b(arg[1], "block_ids");
    const int64_t cached = c.maybe_released(t.size() >= kReleaseGilTokens, [&](RadixCache& x) {
      return x.insert(t.data(), t.size(), b.data(), b.size()).cached_tokens;
    });
    return PyLong_FromLongLong(cached);
  });
}

py::list key_list(const std::vector<uint64_t>& keys) {
  py::list out;
  for (uint64_t key : keys) out.append(py::int_(key));
  return out;
}

py::list disk_ops(const std::vector<pyserve::DiskOp>& ops) {
  py::list out;
  for (const auto& op : ops) out.append(py::make_tuple(op.block, op.key));
  return out;
}

// "name($self, ...)\n--\n\n" gives the methods an inspect.signature, as pybind11's have.
PyMethodDef match_prefix_def = {
    "match_prefix", fastcall_function(&match_prefix), METH_FASTCALL | METH_KEYWORDS,
    "match_prefix($self, /, tokens)\n--\n\n"
    "(num_tokens, block_ids, handle) of the longest cached prefix; block_ids are int32 bytes"};

PyMethodDef insert_def = {
    "insert", fastcall_function(&insert), METH_FASTCALL | METH_KEYWORDS,
    "insert($self, /, tokens, block_ids)\n--\n\n"
    "inserts the whole blocks; returns how many leading tokens were already cached"};

}  // namespace

py::dict cache_stats_dict(const pyserve::CacheStats& s) {
  py::dict d;
  d["cached_blocks"] = s.cached_blocks;
  d["evictable_blocks"] = s.evictable_blocks;
  d["hit_tokens"] = s.hit_tokens;
  d["query_tokens"] = s.query_tokens;
  d["evicted_blocks"] = s.evicted_blocks;
  d["inserted_blocks"] = s.inserted_blocks;
  d["disk_blocks"] = s.disk_blocks;
  d["disk_budget"] = s.disk_budget;
  d["saved_blocks"] = s.saved_blocks;
  d["loaded_blocks"] = s.loaded_blocks;
  d["disk_evicted_blocks"] = s.disk_evicted_blocks;
  return d;
}

void bind_radix_cache(py::module_& m) {
  auto cls =
      py::class_<PyCache>(m, "RadixCache",
                          "A prefix tree over token ids at block granularity (cpp/README.md).")
          .def(py::init([](int64_t block_size, PyAllocator& allocator) {
                 auto owner = std::make_shared<StandaloneCache>(allocator.obj, block_size);
                 return PyCache{std::shared_ptr<RadixCache>(owner, &owner->cache), allocator.mutex};
               }),
               py::arg("block_size"), py::arg("allocator"))
          .def_property_readonly(
              "block_size",
              [](PyCache& c) { return c.held([](auto& x) { return x.block_size(); }); })
          .def_property_readonly(
              "evictable_blocks",
              [](PyCache& c) { return c.held([](auto& x) { return x.evictable_blocks(); }); })
          .def_property_readonly(
              "cached_blocks",
              [](PyCache& c) { return c.held([](auto& x) { return x.cached_blocks(); }); })
          .def_property_readonly(
              "num_nodes", [](PyCache& c) { return c.held([](auto& x) { return x.num_nodes(); }); })
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
          .def("reset",
               [](PyCache& c) { return c.released([](RadixCache& x) { return x.reset(); }); })
          .def(
              "set_disk_budget",
              [](PyCache& c, int64_t max_blocks) {
                c.held([max_blocks](RadixCache& x) { x.set_disk_budget(max_blocks); });
              },
              py::arg("max_blocks"),
              "the disk tier's size in blocks (0: off); evicted RAM nodes become disk nodes")
          .def_property_readonly(
              "disk_blocks",
              [](PyCache& c) { return c.held([](auto& x) { return x.disk_blocks(); }); })
          .def(
              "peek_prefix",
              [](PyCache& c, const py::object& tokens) {
                Int32Arg t(tokens.ptr(), "tokens");
                auto r = c.held([&](RadixCache& x) { return x.peek_prefix(t.data(), t.size()); });
                return py::make_tuple(r.num_blocks, r.unlocked_blocks, r.disk_blocks);
              },
              py::arg("tokens"),
              "(RAM blocks matched, of which unlocked, disk blocks after them); changes nothing")
          .def(
              "insert_with_loads",
              [](PyCache& c, const py::object& tokens, const py::object& block_ids) {
                Int32Arg t(tokens.ptr(), "tokens");
                Int32Arg b(block_ids.ptr(), "block_ids");
                auto r = c.held([&](RadixCache& x) {
                  return x.insert(t.data(), t.size(), b.data(), b.size());
                });
                return py::make_tuple(r.cached_tokens, disk_ops(r.loads));
              },
              py::arg("tokens"), py::arg("block_ids"),
              "insert; also returns [(block, key)]: disk blocks brought back into these blocks")
          .def(
              "insert_disk",
              [](PyCache& c, const py::object& tokens) {
                Int32Arg t(tokens.ptr(), "tokens");
                return c.held([&](RadixCache& x) { return x.insert_disk(t.data(), t.size()); });
              },
              py::arg("tokens"), "adds the blocks not in the tree as disk nodes; returns how many")
          .def(
              "take_saves",
              [](PyCache& c) { return disk_ops(c.held([](auto& x) { return x.take_saves(); })); },
              "[(block, key)] queued by eviction to disk since the last call")
          .def(
              "take_drops",
              [](PyCache& c) { return key_list(c.held([](auto& x) { return x.take_drops(); })); },
              "disk keys dropped since the last call")
          .def(
              "block_keys",
              [](PyCache& c, const py::object& tokens) {
                Int32Arg t(tokens.ptr(), "tokens");
                return key_list(
                    c.held([&](RadixCache& x) { return x.block_keys(t.data(), t.size()); }));
              },
              py::arg("tokens"), "the disk key of every whole block of tokens")
          .def(
              "forget_disk",
              [](PyCache& c, int32_t handle, const py::object& tokens) {
                Int32Arg t(tokens.ptr(), "tokens");
                if (t.size() < static_cast<size_t>(c.obj->block_size())) {
                  throw pyserve::ValueError("forget_disk: tokens must hold a whole block");
                }
                return c.held([&](RadixCache& x) { return x.forget_disk(handle, t.data()); });
              },
              py::arg("handle"), py::arg("tokens"),
              "forgets the disk child of handle starting with tokens' first block, and its "
              "subtree (drops queued); returns the disk blocks forgotten")
          .def(
              "disk_keys",
              [](PyCache& c) { return key_list(c.held([](auto& x) { return x.disk_keys(); })); },
              "every disk block's key")
          .def("stats",
               [](PyCache& c) {
                 return cache_stats_dict(c.held([](auto& x) { return x.stats(); }));
               })
          .def("check_invariants",
               [](PyCache& c) { c.held([](RadixCache& x) { x.check_invariants(); }); });
  add_method(cls, &match_prefix_def);
  add_method(cls, &insert_def);
}

}  // namespace pyserve_bindings
