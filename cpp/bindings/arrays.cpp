#include "arrays.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

namespace pyserve_bindings {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the packed-bytes formats assume a little-endian host");

namespace {

template <class T>
const char* type_name() {
  return sizeof(T) == 4 ? "int32" : "int64";
}

template <class T>
T checked(long long value, const char* what, size_t index) {
  if (value < std::numeric_limits<T>::min() || value > std::numeric_limits<T>::max()) {
    throw py::value_error(std::string(what) + "[" + std::to_string(index) +
                          "] = " + std::to_string(value) + " does not fit in " + type_name<T>());
  }
  return static_cast<T>(value);
}

template <class T>
std::vector<T> from_sequence(PyObject* seq, const char* what) {
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  std::vector<T> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    if (!PyLong_Check(item)) {
      throw py::type_error(std::string(what) + "[" + std::to_string(i) + "] is " +
                           Py_TYPE(item)->tp_name + ", not int");
    }
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow != 0) {
      throw py::value_error(std::string(what) + "[" + std::to_string(i) + "] does not fit in " +
                            type_name<T>());
    }
    out[static_cast<size_t>(i)] = checked<T>(value, what, static_cast<size_t>(i));
  }
  return out;
}

template <class T, class Src>
void convert_typed(const void* data, size_t count, std::vector<T>& out, const char* what) {
  const Src* src = static_cast<const Src*>(data);
  out.resize(count);
  for (size_t i = 0; i < count; ++i) {
    if constexpr (std::is_unsigned_v<Src> && sizeof(Src) >= 8) {
      if (src[i] > static_cast<Src>(std::numeric_limits<long long>::max())) {
        throw py::value_error(std::string(what) + "[" + std::to_string(i) + "] does not fit in " +
                              type_name<T>());
      }
    }
    out[i] = checked<T>(static_cast<long long>(src[i]), what, i);
  }
}

template <class T>
std::vector<T> from_buffer(PyObject* obj, const char* what) {
  Py_buffer view;
  if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
    PyErr_Clear();
    throw py::value_error(std::string(what) + ": the buffer is not C-contiguous");
  }
  struct Release {
    Py_buffer* v;
    ~Release() { PyBuffer_Release(v); }
  } release{&view};
  if (view.ndim > 1) {
    throw py::value_error(std::string(what) + ": expected a 1-D array, got " +
                          std::to_string(view.ndim) + " dimensions");
  }
  std::string format = view.format ? view.format : "B";
  if (!format.empty() && (format[0] == '>' || format[0] == '!')) {
    throw py::value_error(std::string(what) + ": big-endian arrays are not supported");
  }
  if (!format.empty() && (format[0] == '@' || format[0] == '=' || format[0] == '<')) {
    format.erase(0, 1);
  }
  const size_t len = static_cast<size_t>(view.len);
  std::vector<T> out;
  if (view.itemsize == 1 && (format == "B" || format == "b" || format == "c")) {
    // Bytes-like: packed little-endian values.
    if (len % sizeof(T) != 0) {
      throw py::value_error(std::string(what) + ": " + std::to_string(len) +
                            " bytes is not a whole number of " + type_name<T>() + " values");
    }
    out.resize(len / sizeof(T));
    if (len) std::memcpy(out.data(), view.buf, len);
    return out;
  }
  const char code = format.size() == 1 ? format[0] : '?';
  const size_t count = len / static_cast<size_t>(view.itemsize);
  const bool is_signed = code == 'b' || code == 'h' || code == 'i' || code == 'l' || code == 'q';
  const bool is_unsigned = code == 'B' || code == 'H' || code == 'I' || code == 'L' || code == 'Q';
  if (!is_signed && !is_unsigned) {
    throw py::value_error(std::string(what) + ": expected an integer array, got format '" + format +
                          "'");
  }
  switch (view.itemsize * (is_signed ? 1 : -1)) {
    case 1:
      convert_typed<T, int8_t>(view.buf, count, out, what);
      break;
    case 2:
      convert_typed<T, int16_t>(view.buf, count, out, what);
      break;
    case 4:
      convert_typed<T, int32_t>(view.buf, count, out, what);
      break;
    case 8:
      convert_typed<T, int64_t>(view.buf, count, out, what);
      break;
    case -2:
      convert_typed<T, uint16_t>(view.buf, count, out, what);
      break;
    case -4:
      convert_typed<T, uint32_t>(view.buf, count, out, what);
      break;
    case -8:
      convert_typed<T, uint64_t>(view.buf, count, out, what);
      break;
    default:
      throw py::value_error(std::string(what) + ": unsupported item size " +
                            std::to_string(view.itemsize));
  }
  return out;
}

template <class T>
std::vector<T> read_ints(py::handle obj, const char* what) {
  PyObject* o = obj.ptr();
  if (PyList_Check(o) || PyTuple_Check(o)) return from_sequence<T>(o, what);
  if (PyObject_CheckBuffer(o)) return from_buffer<T>(o, what);
  if (PyLong_Check(o) || PyUnicode_Check(o)) {
    throw py::type_error(std::string(what) + ": expected a sequence of ints or a buffer, got " +
                         Py_TYPE(o)->tp_name);
  }
  PyObject* seq = PySequence_Fast(o, "expected a sequence of ints or a buffer");
  if (seq == nullptr) {
    PyErr_Clear();
    throw py::type_error(std::string(what) + ": expected a sequence of ints or a buffer, got " +
                         Py_TYPE(o)->tp_name);
  }
  py::object owned = py::reinterpret_steal<py::object>(seq);
  return from_sequence<T>(owned.ptr(), what);
}

// The format of a buffer that holds exactly T values in native (little-endian) order.
template <class T>
bool is_packed(const Py_buffer& view) {
  const char* format = view.format ? view.format : "B";
  if (*format == '@' || *format == '=' || *format == '<') ++format;
  if (format[0] == '\0' || format[1] != '\0') return false;  // one item code
  const char code = format[0];
  if (view.itemsize == 1) return code == 'B' || code == 'b' || code == 'c';
  if (view.itemsize != static_cast<Py_ssize_t>(sizeof(T))) return false;
  return sizeof(T) == 4 ? code == 'i' : (code == 'q' || code == 'l');
}

template <class T>
bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % alignof(T) == 0;
}

}  // namespace

template <class T>
IntArg<T>::IntArg(py::handle obj, const char* what) {
  PyObject* o = obj.ptr();
  if (PyBytes_CheckExact(o)) {
    // The common case (packed ids from the main process): read in place, no buffer export.
    const char* data = PyBytes_AS_STRING(o);
    const size_t len = static_cast<size_t>(PyBytes_GET_SIZE(o));
    if (len % sizeof(T) == 0 && aligned<T>(data)) {
      Py_INCREF(o);
      bytes_ = o;
      data_ = reinterpret_cast<const T*>(data);
      size_ = len / sizeof(T);
      return;
    }
  } else if (PyObject_CheckBuffer(o)) {
    if (PyObject_GetBuffer(o, &view_, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
      has_view_ = true;
      if (view_.ndim <= 1 && aligned<T>(view_.buf) && is_packed<T>(view_) &&
          static_cast<size_t>(view_.len) % sizeof(T) == 0) {
        data_ = static_cast<const T*>(view_.buf);
        size_ = static_cast<size_t>(view_.len) / sizeof(T);
        return;
      }
      PyBuffer_Release(&view_);
      has_view_ = false;
    } else {
      PyErr_Clear();
    }
  }
  owned_ = read_ints<T>(obj, what);  // validates and explains what is wrong
  data_ = owned_.data();
  size_ = owned_.size();
}

template class IntArg<int32_t>;
template class IntArg<int64_t>;

std::vector<int32_t> to_int32s(py::handle obj, const char* what) {
  return read_ints<int32_t>(obj, what);
}

std::vector<int64_t> to_int64s(py::handle obj, const char* what) {
  return read_ints<int64_t>(obj, what);
}

}  // namespace pyserve_bindings
