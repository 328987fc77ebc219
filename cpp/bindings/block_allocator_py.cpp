// Python class BlockAllocator.
#include <string>

#include "arrays.h"
#include "block_allocator.h"
#include "errors.h"
#include "guarded.h"

namespace pyserve_bindings {

using pyserve::BlockAllocator;
using PyAllocator = Guarded<BlockAllocator>;

void bind_block_allocator(py::module_& m) {
  py::class_<PyAllocator>(m, "BlockAllocator",
                          "A fixed pool of KV blocks with a free list and reference counts.")
      .def(py::init([](int64_t num_blocks) {
             return PyAllocator{std::make_shared<BlockAllocator>(num_blocks),
                                std::make_shared<std::mutex>()};
           }),
           py::arg("num_blocks"))
      .def_property_readonly(
          "num_blocks",
          [](PyAllocator& a) { return a.held([](auto& x) { return x.num_blocks(); }); })
      .def_property_readonly(
          "num_free", [](PyAllocator& a) { return a.held([](auto& x) { return x.num_free(); }); })
      .def(
          "allocate",
          [](PyAllocator& a, int64_t n) {
            return to_bytes(a.held([n](BlockAllocator& x) { return x.allocate(n); }));
          },
          py::arg("n"), "n fresh blocks (int32 bytes) with refcount 1; RuntimeError if fewer are free")
      .def(
          "incref",
          [](PyAllocator& a, py::handle ids) {
            Int32Arg v(ids, "ids");
            a.held([&](BlockAllocator& x) { x.incref(v.data(), v.size()); });
          },
          py::arg("ids"))
      .def(
          "decref",
          [](PyAllocator& a, py::handle ids) {
            Int32Arg v(ids, "ids");
            a.held([&](BlockAllocator& x) { x.decref(v.data(), v.size()); });
          },
          py::arg("ids"), "a block whose count reaches 0 is free again; below 0 is a ValueError")
      .def(
          "refcount",
          [](PyAllocator& a, int64_t id) {
            if (id < INT32_MIN || id > INT32_MAX) {
              throw pyserve::ValueError("block id " + std::to_string(id) + " is out of range");
            }
            return a.held([id](BlockAllocator& x) { return x.refcount(static_cast<int32_t>(id)); });
          },
          py::arg("id"))
      .def(
          "refcounts",
          [](PyAllocator& a) { return to_bytes(a.held([](auto& x) { return x.refcounts(); })); },
          "int32 bytes: the count of every block")
      .def("check_invariants",
           [](PyAllocator& a) { a.held([](BlockAllocator& x) { x.check_invariants(); }); });
}

}  // namespace pyserve_bindings
