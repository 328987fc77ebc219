#include "fastcall.h"

#include <cstring>
#include <new>
#include <string>

#include "errors.h"

namespace pyserve_bindings {

void set_error_from_exception() noexcept {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const pyserve::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const pyserve::KeyError& e) {
    PyErr_SetString(PyExc_KeyError, e.what());
  } catch (const pyserve::Error& e) {  // ProtocolError, InvariantError
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception");
  }
}

void parse_args(const char* method, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
                std::initializer_list<const char*> names, PyObject** out) {
  const Py_ssize_t expected = static_cast<Py_ssize_t>(names.size());
  const Py_ssize_t positional = PyVectorcall_NARGS(nargs);
  if (positional > expected) {
    throw py::type_error(std::string(method) + "() takes " + std::to_string(expected) +
                         (expected == 1 ? " argument but " : " arguments but ") +
                         std::to_string(positional) + " were given");
  }
  for (Py_ssize_t i = 0; i < expected; ++i) out[i] = i < positional ? args[i] : nullptr;
  const Py_ssize_t num_kw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < num_kw; ++k) {
    const char* key = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
    if (!key) throw py::error_already_set();
    Py_ssize_t i = 0;
    for (const char* name : names) {
      if (std::strcmp(name, key) == 0) break;
      ++i;
    }
    if (i == expected) {
      throw py::type_error(std::string(method) + "() got an unexpected keyword argument '" + key +
                           "'");
    }
    if (out[i]) {
      throw py::type_error(std::string(method) + "() got multiple values for argument '" + key +
                           "'");
    }
    out[i] = args[positional + k];
  }
  Py_ssize_t i = 0;
  for (const char* name : names) {
    if (!out[i++]) {
      throw py::type_error(std::string(method) + "() missing required argument '" + name + "'");
    }
  }
}

int64_t int_arg(PyObject* obj) {
  const long long value = PyLong_AsLongLong(obj);  // calls __index__ for non-ints
  if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
  return static_cast<int64_t>(value);
}

void add_method(py::handle cls, PyMethodDef* def) {
  PyObject* descr = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), def);
  if (!descr) throw py::error_already_set();
  py::setattr(cls, def->ml_name, py::reinterpret_steal<py::object>(descr));
}

void add_getter(py::handle cls, PyGetSetDef* def) {
  PyObject* descr = PyDescr_NewGetSet(reinterpret_cast<PyTypeObject*>(cls.ptr()), def);
  if (!descr) throw py::error_already_set();
  py::setattr(cls, def->name, py::reinterpret_steal<py::object>(descr));
}

}  // namespace pyserve_bindings
