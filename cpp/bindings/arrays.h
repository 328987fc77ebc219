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

template <class T>
py::bytes to_bytes(const std::vector<T>& values) {
  return py::bytes(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

template <class T>
py::list to_list(const std::vector<T>& values) {
  py::list out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = py::int_(values[i]);
  return out;
}

}  // namespace pyserve_bindings
