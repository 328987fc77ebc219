// Conversions between Python arguments and the core's arrays.
//
// Inputs accept a list/tuple (or any iterable) of ints, or a C-contiguous buffer: bytes-like
// objects (bytes, bytearray, uint8 memoryviews) are read as packed little-endian values, typed
// buffers (numpy arrays, typed memoryviews) must have the element size asked for. Outputs are
// packed little-endian bytes. Call these with the GIL held.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace pyserve_bindings {

namespace py = pybind11;

std::vector<int32_t> to_int32s(py::handle obj, const char* what);
std::vector<int64_t> to_int64s(py::handle obj, const char* what);

// An integer array argument without a copy where possible: a bytes object, a bytes-like buffer
// or a typed buffer of exactly T that is suitably aligned is read in place (bytes directly, the
// others through the buffer protocol); anything else is converted once, with validation.
// Create and destroy it with the GIL held; its data may be read with the GIL released (it holds
// a reference to a bytes object, and a buffer export keeps any other object from being resized
// or freed meanwhile).
template <class T>
class IntArg {
 public:
  IntArg(py::handle obj, const char* what);
  ~IntArg() {
    if (has_view_) PyBuffer_Release(&view_);
    Py_XDECREF(bytes_);
  }
  IntArg(const IntArg&) = delete;
  IntArg& operator=(const IntArg&) = delete;

  const T* data() const { return data_; }
  size_t size() const { return size_; }
  std::vector<T> vector() const { return std::vector<T>(data_, data_ + size_); }

 private:
  PyObject* bytes_ = nullptr;  // a bytes object read in place (a new reference)
  Py_buffer view_{};
  bool has_view_ = false;
  std::vector<T> owned_;
  const T* data_ = nullptr;
  size_t size_ = 0;
};

using Int32Arg = IntArg<int32_t>;
using Int64Arg = IntArg<int64_t>;

template <class T>
py::bytes to_bytes(const T* values, size_t count) {
  return py::bytes(reinterpret_cast<const char*>(values), count * sizeof(T));
}

template <class T>
py::bytes to_bytes(const std::vector<T>& values) {
  return to_bytes(values.data(), values.size());
}

template <class T>
py::list to_list(const std::vector<T>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (!list) throw py::error_already_set();
  py::list out = py::reinterpret_steal<py::list>(list);
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* item = PyLong_FromLongLong(static_cast<long long>(values[i]));
    if (!item) throw py::error_already_set();
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return out;
}

}  // namespace pyserve_bindings
