// The pieces of the _kda extension module: each registers its functions and classes.
#pragma once

#include <pybind11/pybind11.h>

namespace kda::python {

namespace py = pybind11;

// The thread count kda.set_num_threads() chose (0: OpenMP's default), applied to the calling thread at
// the start of every call into the kernels: OpenMP keeps the count per thread, and an engine's Python
// threads would otherwise each run with the default.
void apply_num_threads();

// kda.ops (ops.cc): the kernels behind fla's chunk_kda / fused_recurrent_kda.
void register_ops(py::module_& m);

// The serving component under the RFC's names (component.cc).
void register_component(py::module_& m);

// The prefix cache of state snapshots (radix_cache.cc).
void register_radix_cache(py::module_& m);

// The weight-only quantized projection (quant_linear.cc).
void register_quant_linear(py::module_& m);

// The whole decoder, KimiLinearForCausalLM (model.cc).
void register_model(py::module_& m);

}  // namespace kda::python
