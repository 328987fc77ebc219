// Python class BlockAllocator.
#include <string>

#include "arrays.h"
#include "block_allocator.h"
#include "errors.h"
#include "fastcall.h"
#include "guarded.h"

namespace pyserve_bindings {

using pyserve::BlockAllocator;
using PyAllocator = Guarded<BlockAllocator>;

namespace {

// allocate(n) -> int32 bytes
PyObject* allocate(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&]() -> PyObject* {
    PyObject* arg[1];
    parse_args("allocate", args, nargs, kwnames, {"n"}, arg);
    PyAllocator& a = self_object<PyAllocator>(self);
    const int64_t n = int_arg(arg[0]);
    return to_bytes(a.held([n](BlockAllocator& x) { return x.allocate(n); })).release().ptr();
  });
}

// incref(ids) / decref(ids)
template <bool Increment>
PyObject* change_refcounts(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                           PyObject* kwnames) {
  return fast_call([&]() -> PyObject* {
    PyObject* arg[1];
    parse_args(Increment ? "incref" : "decref", args, nargs, kwnames, {"ids"}, arg);
    PyAllocator& a = self_object<PyAllocator>(self);
    Int32Arg v(arg[0], "ids");
    a.held([&](BlockAllocator& x) {
      if (Increment) {
        x.incref(v.data(), v.size());
      } else {
        x.decref(v.data(), v.size());
      }
    });
    Py_RETURN_NONE;
  });
}

PyObject* num_free(PyObject* self, void*) {
  return fast_call([&]() -> PyObject* {
    PyAllocator& a = self_object<PyAllocator>(self);
    return PyLong_FromLong(a.held([](BlockAllocator& x) { return x.num_free(); }));
  });
}

// "name($self, ...)\n--\n\n" gives the methods an inspect.signature, as pybind11's have.
PyMethodDef allocate_def = {
    "allocate", fastcall_function(&allocate), METH_FASTCALL | METH_KEYWORDS,
    "allocate($self, /, n)\n--\n\n"
    "n fresh blocks with refcount 1, as int32 bytes; RuntimeError if fewer are free"};
PyMethodDef incref_def = {"incref", fastcall_function(&change_refcounts<true>),
                          METH_FASTCALL | METH_KEYWORDS,
                          "incref($self, /, ids)\n--\n\none more owner for each (held) block"};
PyMethodDef decref_def = {"decref", fastcall_function(&change_refcounts<false>),
                          METH_FASTCALL | METH_KEYWORDS,
                          "decref($self, /, ids)\n--\n\n"
                          "a block whose count reaches 0 is free again; below 0 is a ValueError"};
PyGetSetDef num_free_def = {"num_free", &num_free, nullptr, "blocks with refcount 0", nullptr};

}  // namespace

void bind_block_allocator(py::module_& m) {
  auto cls =
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
          .def(
              "refcount",
              [](PyAllocator& a, int64_t id) {
                if (id < INT32_MIN || id > INT32_MAX) {
                  throw pyserve::ValueError("block id " + std::to_string(id) + " is out of range");
                }
                return a.held(
                    [id](BlockAllocator& x) { return x.refcount(static_cast<int32_t>(id)); });
              },
              py::arg("id"))
          .def(
              "refcounts",
              [](PyAllocator& a) {
                return to_bytes(a.held([](auto& x) { return x.refcounts(); }));
              },
              "int32 bytes: the count of every block")
          .def("check_invariants",
               [](PyAllocator& a) { a.held([](BlockAllocator& x) { x.check_invariants(); }); });
  add_method(cls, &allocate_def);
  add_method(cls, &incref_def);
  add_method(cls, &decref_def);
  add_getter(cls, &num_free_def);
}

}  // namespace pyserve_bindings
