// The pybind11 module `pyserve._core`: exception mapping and the classes.
#include <pybind11/pybind11.h>

#include "errors.h"
#include "guarded.h"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() =
      "pyserve's C++ scheduling core: BlockAllocator, RadixCache, Planner, NgramIndex, NgramCorpus "
      "(cpp/README.md)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const pyserve::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const pyserve::KeyError& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    } catch (const pyserve::ProtocolError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const pyserve::InvariantError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  pyserve_bindings::bind_block_allocator(m);
  pyserve_bindings::bind_radix_cache(m);
  pyserve_bindings::bind_planner(m);
  pyserve_bindings::bind_ngram(m);
}
