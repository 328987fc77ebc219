// Hot methods without pybind11's generic dispatcher.
//
// pybind11 routes every call through one generic path (function record, argument loaders, a
// type lookup for `self`, result casting, exception translation): about 600 instructions and a
// large code footprint a call, several times the work of a prefix match on a cached prompt. The
// few methods a Python scheduler calls for every request (RadixCache.match_prefix and insert,
// BlockAllocator.allocate, incref, decref and num_free) are therefore plain CPython
// METH_FASTCALL methods added to the pybind11 classes; everything else stays pybind11.
#pragma once

#include <pybind11/pybind11.h>

#include <initializer_list>

namespace pyserve_bindings {

namespace py = pybind11;

// Sets the Python error for the C++ exception in flight (call it inside a catch block): the
// core's typed errors map as in module.cpp, pybind11's exceptions and std::bad_alloc as pybind11
// maps them, anything else to RuntimeError.
void set_error_from_exception() noexcept;

// Runs body() and returns its result; a C++ exception becomes a Python error and nullptr.
template <class Body>
PyObject* fast_call(Body&& body) noexcept {
  try {
    return body();
  } catch (...) {
    set_error_from_exception();
    return nullptr;
  }
}

// The C++ object of `self` (the method descriptor has checked its class), as pybind11's own
// methods get it.
template <class T>
T& self_object(PyObject* self) {
  return py::cast<T&>(py::handle(self));
}

// The arguments of a METH_FASTCALL | METH_KEYWORDS call, in the order of `names`, given by
// position or keyword; all are required. Throws py::type_error for a missing, repeated or
// unknown argument.
void parse_args(const char* method, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
                std::initializer_list<const char*> names, PyObject** out);

// An int argument (anything with __index__), as int64; a Python TypeError or OverflowError
// (thrown as py::error_already_set) otherwise.
int64_t int_arg(PyObject* obj);

// A METH_FASTCALL | METH_KEYWORDS function as PyMethodDef stores it.
inline PyCFunction fastcall_function(PyObject* (*f)(PyObject*, PyObject* const*, Py_ssize_t,
                                                    PyObject*)) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

// Adds a method / a read-only attribute to the pybind11 class `cls`. The descriptors check that
// `self` is an instance of `cls`; `def` must outlive the class (a static).
void add_method(py::handle cls, PyMethodDef* def);
void add_getter(py::handle cls, PyGetSetDef* def);

}  // namespace pyserve_bindings
