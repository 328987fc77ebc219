// The pybind11 module `pyserve._kernels`: quantized matmul kernels for the CPU worker.
//
// Tensors cross as raw addresses plus sizes (no torch headers in the build); the Python wrapper
// pyserve/worker/quant.py checks dtypes, shapes and contiguity before calling. The matmul
// releases the GIL.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "dispatch.h"
#include "thread_pool.h"

namespace py = pybind11;
namespace pk = pyserve_kernels;

namespace {

template <class T>
T* address(uintptr_t value) {
  return reinterpret_cast<T*>(value);
}

void matmul(uintptr_t x, int64_t x_stride, int rows, int activation_bits, uintptr_t weights,
            uintptr_t scales, int n, int k, int bits, int group, uintptr_t bias, uintptr_t out,
            int64_t out_stride) {
  const pk::PackedWeights w{
      address<const uint8_t>(weights), address<const uint16_t>(scales), n, k, bits, group};
  py::gil_scoped_release released;
  pk::quantized_matmul(address<const float>(x), x_stride, rows, activation_bits, w,
                       address<const float>(bias), address<float>(out), out_stride);
}

void quantize_activations(uintptr_t x, int64_t x_stride, int rows, int k, int group, int bits,
                          uintptr_t q, uintptr_t scale, uintptr_t sum) {
  py::gil_scoped_release released;
  pk::quantize_activations(address<const float>(x), x_stride, rows, k, group, bits,
                           address<void>(q), address<float>(scale), address<int32_t>(sum));
}

py::list supported_isas() {
  py::list names;
  const std::string before = pk::current_isa();
  for (const char* name : {"avx512_vnni", "avx2", "scalar"}) {
    try {
      pk::set_isa(name);
      names.append(name);
    } catch (const std::invalid_argument&) {
    }
  }
  pk::set_isa(before);
  return names;
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "Quantized small-batch matmul kernels for the CPU worker (cpp/kernels/README.md)";
  m.attr("TILE_ROWS") = pk::kTileRows;
  m.attr("MAX_GROUP") = pk::kMaxGroup;
  m.def("matmul", &matmul, py::arg("x"), py::arg("x_stride"), py::arg("rows"),
        py::arg("activation_bits"), py::arg("weights"), py::arg("scales"), py::arg("n"),
        py::arg("k"), py::arg("bits"), py::arg("group"), py::arg("bias"), py::arg("out"),
        py::arg("out_stride"),
        "out[rows, n] = x[rows, k] @ W.T (+ bias); float32 addresses, bias 0 for none");
  m.def("quantize_activations", &quantize_activations, py::arg("x"), py::arg("x_stride"),
        py::arg("rows"), py::arg("k"), py::arg("group"), py::arg("bits"), py::arg("q"),
        py::arg("scale"), py::arg("sum"), "the per-group integer activations matmul computes with");
  m.def("isa", &pk::current_isa, "the instruction set in use");
  m.def("set_isa", &pk::set_isa, py::arg("name"), "avx512_vnni, avx2 or scalar");
  m.def("supported_isas", &supported_isas, "the instruction sets this CPU can run, best first");
  m.def("num_threads", [] { return pk::ThreadPool::instance().size(); }, "threads a matmul uses");
  m.def("set_num_threads", [](int n) { pk::ThreadPool::instance().resize(n); }, py::arg("n"));
  m.def(
      "spin_us", [] { return pk::ThreadPool::instance().spin_us(); },
      "how long idle workers poll for the next matmul before they sleep");
  m.def(
      "set_spin_us", [](int us) { pk::ThreadPool::instance().set_spin_us(us < 0 ? 0 : us); },
      py::arg("us"));
}
