// The _kda extension module behind the kda package.
#include <omp.h>
#include <pybind11/pybind11.h>

#include <atomic>

#include "bindings.h"

namespace kda::python {

namespace {
std::atomic<int> g_num_threads{0};
}

void apply_num_threads() {
  const int n = g_num_threads.load(std::memory_order_relaxed);
  if (n > 0 && omp_get_max_threads() != n) omp_set_num_threads(n);
}

}  // namespace kda::python

PYBIND11_MODULE(_kda, m) {
  namespace py = pybind11;
  using namespace kda::python;
  m.doc() = "kda: Kimi Delta Attention kernels and serving component (CPU)";
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 1) throw py::value_error("set_num_threads: n must be >= 1, got " + std::to_string(n));
        g_num_threads.store(n);
      },
      py::arg("n"), "Threads every later kda call uses (OpenMP), from any Python thread.");
  m.def(
      "get_num_threads",
      [] {
        const int n = g_num_threads.load();
        return n > 0 ? n : omp_get_max_threads();
      },
      "Threads a kda call uses.");
  register_ops(m);
  register_component(m);
  register_radix_cache(m);
  register_quant_linear(m);
  register_model(m);
}
