// QuantLinear: a weight-only quantized projection y = x W^T (layers/quant_linear.h; int8 per output
// channel, int4 in groups of 32) on its own, as the quantized layers use it. x is read in place when its
// rows are dense (a NumPy array or torch tensor, rows possibly spaced out); the output is a fresh array of
// the input's kind and dtype. A call holds the projection's own lock, not the GIL.
#include "kda/layers/quant_linear.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "kda/common/bf16.h"
#include "kda/common/precision.h"
#include "kda/common/weights.h"
#include "tensor.h"

namespace kda::python {

namespace {

struct PyQuantLinear {
  PyQuantLinear(int64_t in, int64_t out, const std::vector<float>& w, Weights wts, Precision p)
      : linear(in, out, w, wts, p), precision(p) {}
  layers::QuantLinear linear;
  Precision precision;
};

// A 2-D float32 / bfloat16 array as fp32 values, row-major (any strides).
std::vector<float> gather_f32(const TensorView& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  const int64_t R = t.shape[0], C = t.shape[1];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const int64_t off = r * t.strides[0] + c * t.strides[1];
      v[r * C + c] = t.dtype == DType::F32 ? t.ptr<float>()[off] : bf16_to_f32(t.ptr<bf16_t>()[off]);
    }
  return v;
}

std::shared_ptr<PyQuantLinear> make(const py::object& weight, const std::string& weights,
                                    const std::string& precision) {
  const Weights wts = parse_weights(weights);
  if (wts != Weights::Int8 && wts != Weights::Int4)
    throw py::value_error("QuantLinear: weights must be 'int8' or 'int4', got '" + weights + "'");
  const Precision p = parse_precision(precision);
  const TensorView w = as_tensor(weight, "weight");
  expect_dtype(w, {DType::F32, DType::BF16});
  expect_ndim(w, 2);
  const int64_t out = w.shape[0], in = w.shape[1];
  if (in <= 0 || out <= 0) throw py::value_error("'weight' has shape " + w.shape_str() + ": no features");
  if (wts == Weights::Int4 && in % 32 != 0)
    throw py::value_error("int4 weights: the input size " + std::to_string(in) +
                          " is not a multiple of the group size 32");
  const std::vector<float> wf = gather_f32(w);
  py::gil_scoped_release release;
  return std::make_shared<PyQuantLinear>(in, out, wf, wts, p);
}

py::object forward(const PyQuantLinear& self, const py::object& x_obj) {
  apply_num_threads();
  const auto& q = self.linear;
  const TensorView x = as_tensor(x_obj, "x");
  expect_dtype(x, {DType::F32, DType::BF16});
  expect_ndim(x, 2);
  const int64_t M = x.shape[0], in = q.in_features(), out = q.out_features();
  if (x.shape[1] != in)
    throw py::value_error("'x' has shape " + x.shape_str() + " but the projection takes " +
                          std::to_string(in) + " inputs");
  const bool bf16 = x.dtype == DType::BF16;
  if (bf16 && self.precision != Precision::BF16)
    throw py::value_error("'x' is bfloat16 but the projection's precision is fp32");
  // The caller's rows when they are dense, else a row-major copy.
  std::vector<float> xcopy;
  const void* xp = x.data;
  int64_t ldx = M > 1 ? x.strides[0] : in;
  if (!x.rows_dense()) {
    xcopy = gather_f32(x);
    xp = xcopy.data();
    ldx = in;
  }
  const bool x16 = bf16 && xcopy.empty();
  py::object y_obj;
  if (x.is_torch) {
    py::module_ torch = py::module_::import("torch");
    y_obj = torch.attr("empty")(py::make_tuple(M, out),
                                py::arg("dtype") = torch.attr(bf16 ? "bfloat16" : "float32"));
  } else {
    y_obj = py::array_t<float>(std::vector<py::ssize_t>{M, out});
  }
  const TensorView y = as_tensor(y_obj, "out");
  {
    py::gil_scoped_release release;
    if (x16) {
      q.forward(static_cast<const bf16_t*>(xp), M, ldx, y.ptr<bf16_t>(), out);
    } else if (bf16) {
      q.forward(static_cast<const float*>(xp), M, ldx, y.ptr<bf16_t>(), out);
    } else {
      q.forward(static_cast<const float*>(xp), M, ldx, y.ptr<float>(), out);
    }
  }
  return y_obj;
}

}  // namespace

void register_quant_linear(py::module_& m) {
  py::class_<PyQuantLinear, std::shared_ptr<PyQuantLinear>>(
      m, "QuantLinear",
      "A bias-free projection y = x W^T with W quantized at construction (weight-only): 'int8' symmetric per "
      "output channel (scale max|w| / 127), or 'int4' symmetric in groups of 32 inputs (scale max|w| / 7). "
      "Up "
      "to 64 rows (decode) each row of x is also quantized to int16 (one scale per row for int8, per group "
      "of "
      "32 for int4) and the dot products run in integers; more rows multiply x by the dequantized W in fp32. "
      "precision 'bf16': x is rounded to bf16 first (a layer input's rounding point), bf16 x / out allowed.")
      .def(py::init(&make), py::arg("weight"), py::arg("weights") = "int8", py::arg("precision") = "fp32",
           "weight [out, in] float32 (or bfloat16), copied and quantized.")
      .def("__call__", &forward, py::arg("x"),
           "x [M, in] (NumPy float32, torch float32 / bfloat16) -> y [M, out] of the same kind and dtype.")
      .def("forward", &forward, py::arg("x"))
      .def(
          "dequantized",
          [](const PyQuantLinear& self) {
            const auto& q = self.linear;
            py::array_t<float> a(std::vector<py::ssize_t>{q.out_features(), q.in_features()});
            const std::vector<float> w = q.dequantized();
            std::memcpy(a.mutable_data(), w.data(), w.size() * sizeof(float));
            return a;
          },
          "W as the kernels see it: [out, in] float32 (q * scale).")
      .def_property_readonly("in_features", [](const PyQuantLinear& s) { return s.linear.in_features(); })
      .def_property_readonly("out_features", [](const PyQuantLinear& s) { return s.linear.out_features(); })
      .def_property_readonly(
          "weights", [](const PyQuantLinear& s) { return std::string(to_string(s.linear.weights())); })
      .def_property_readonly("precision",
                             [](const PyQuantLinear& s) { return std::string(to_string(s.precision)); })
      .def_property_readonly(
          "weight_bytes", [](const PyQuantLinear& s) { return s.linear.weight_bytes(); },
          "The packed bytes a forward reads: quantized values and scales.")
      .def_property_readonly(
          "decode_rows", [](const PyQuantLinear& s) { return s.linear.decode_rows(); },
          "Row counts up to this take the integer (decode) kernels.")
      .def("__repr__", [](const PyQuantLinear& s) {
        return "QuantLinear(in_features=" + std::to_string(s.linear.in_features()) +
               ", out_features=" + std::to_string(s.linear.out_features()) +
               ", weights=" + to_string(s.linear.weights()) + ", precision=" + to_string(s.precision) + ")";
      });
}

}  // namespace kda::python
