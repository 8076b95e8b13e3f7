// Zero-copy views of the arrays a Python caller hands in: torch tensors (and any other DLPack producer)
// through DLPack, NumPy arrays through the buffer protocol. Nothing is copied; the view keeps what it
// borrowed alive. Errors are ValueError / TypeError naming the argument.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kda::python {

namespace py = pybind11;

enum class DType { F32, BF16, I32, I64, Other };
const char* to_string(DType t);

struct TensorView {
  std::string name;  // the argument's name, for messages
  void* data = nullptr;
  DType dtype = DType::Other;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements
  bool writable = true;
  bool is_torch = false;
  py::object keep;  // the DLPack capsule or the buffer, alive as long as the view

  int ndim() const { return static_cast<int>(shape.size()); }
  int64_t numel() const;
  // Row-major without gaps.
  bool contiguous() const;
  // Every dimension after the first dense (row-major), the first of any stride >= a row: the rows may be
  // spaced out (a column slice of a wider buffer), as the kernels' row strides allow.
  bool rows_dense() const;
  std::string shape_str() const;
  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

// obj: a torch.Tensor (detached first; must be on the CPU), a numpy.ndarray, or any object with
// __dlpack__ / the buffer protocol.
TensorView as_tensor(const py::handle& obj, const std::string& name);

// Checks shared by the bindings; each throws py::value_error / py::type_error naming the argument.
void expect_dtype(const TensorView& t, std::initializer_list<DType> allowed);
void expect_ndim(const TensorView& t, int ndim);
void expect_writable(const TensorView& t);

}  // namespace kda::python
