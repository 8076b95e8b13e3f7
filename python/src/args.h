// Python arguments the bindings share, converted with errors that name the argument (TypeError for the
// wrong kind, ValueError for a value out of range).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "kda/mem_cache/memory_pool.h"

namespace kda::python {

namespace py = pybind11;

// A sequence of ints (list, tuple, NumPy / torch integer array) -> int32 values.
std::vector<int32_t> to_i32(const py::handle& obj, const char* name);

// A pool argument: MemoryPools (its recurrent_state_pool) or a RecurrentStatePool.
mem_cache::RecurrentStatePool& pool_of(const py::handle& pools);

}  // namespace kda::python
