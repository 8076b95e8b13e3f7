#include "args.h"

#include <cstdint>
#include <string>
#include <vector>

namespace kda::python {

std::vector<int32_t> to_i32(const py::handle& obj, const char* name) {
  if (obj.is_none()) throw py::type_error(std::string("'") + name + "' is None");
  if (py::isinstance<py::int_>(obj) || py::isinstance<py::str>(obj) || !py::isinstance<py::iterable>(obj))
    throw py::type_error(std::string("'") + name + "' must be a sequence of ints, got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  std::vector<int32_t> v;
  for (const auto h : obj) {
    int64_t x = 0;
    try {
      x = py::int_(py::reinterpret_borrow<py::object>(h).attr("__index__")()).cast<int64_t>();
    } catch (const py::error_already_set&) {
      throw py::type_error(std::string("'") + name + "' must hold ints, got " +
                           std::string(py::str(py::type::handle_of(h).attr("__name__"))));
    }
    if (x < INT32_MIN || x > INT32_MAX)
      throw py::value_error(std::string("'") + name + "' holds " + std::to_string(x) + ", outside int32");
    v.push_back(static_cast<int32_t>(x));
  }
  return v;
}

mem_cache::RecurrentStatePool& pool_of(const py::handle& pools) {
  if (py::isinstance<mem_cache::MemoryPools>(pools))
    return pools.cast<mem_cache::MemoryPools&>().recurrent_state_pool;
  if (py::isinstance<mem_cache::RecurrentStatePool>(pools))
    return pools.cast<mem_cache::RecurrentStatePool&>();
  throw py::type_error("'pools' must be a MemoryPools or a RecurrentStatePool, got " +
                       std::string(py::str(py::type::handle_of(pools).attr("__name__"))));
}

}  // namespace kda::python
