#include "tensor.h"

#include <dlpack/dlpack.h>
#include <pybind11/numpy.h>

#include <sstream>

namespace kda::python {

const char* to_string(DType t) {
  switch (t) {
    case DType::F32:
      return "float32";
    case DType::BF16:
      return "bfloat16";
    case DType::I32:
      return "int32";
    case DType::I64:
      return "int64";
    case DType::Other:
      break;
  }
  return "an unsupported dtype";
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool TensorView::contiguous() const {
  int64_t expect = 1;
  for (int i = ndim() - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}

bool TensorView::rows_dense() const {
  if (ndim() == 0) return true;
  int64_t expect = 1;
  for (int i = ndim() - 1; i >= 1; --i) {
    if (shape[i] != 1 && strides[i] != expect) return false;
    expect *= shape[i];
  }
  return shape[0] <= 1 || strides[0] >= expect;
}

std::string TensorView::shape_str() const {
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < ndim(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

namespace {

DType from_dlpack(DLDataType t) {
  if (t.lanes != 1) return DType::Other;
  if (t.code == kDLFloat && t.bits == 32) return DType::F32;
  if (t.code == kDLBfloat && t.bits == 16) return DType::BF16;
  if (t.code == kDLInt && t.bits == 32) return DType::I32;
  if (t.code == kDLInt && t.bits == 64) return DType::I64;
  return DType::Other;
}

bool is_torch_tensor(const py::handle& obj) {
  const auto mod = py::str(py::type::handle_of(obj).attr("__module__"));
  return std::string(mod).rfind("torch", 0) == 0 && py::hasattr(obj, "data_ptr");
}

TensorView from_dlpack_object(const py::handle& obj, const std::string& name) {
  TensorView v;
  v.name = name;
  v.is_torch = is_torch_tensor(obj);
  py::object src = py::reinterpret_borrow<py::object>(obj);
  if (v.is_torch) {
    const std::string dev = py::str(obj.attr("device").attr("type"));
    if (dev != "cpu") throw py::value_error("'" + name + "' is on device '" + dev + "': kda runs on the CPU");
    src = src.attr("detach")();
  } else if (py::hasattr(obj, "__dlpack_device__")) {
    const auto dev = obj.attr("__dlpack_device__")().cast<py::tuple>();
    if (dev[0].cast<int>() != kDLCPU)
      throw py::value_error("'" + name + "' is not in CPU memory (DLPack device " +
                            std::to_string(dev[0].cast<int>()) + "): kda runs on the CPU");
  }
  py::capsule cap = src.attr("__dlpack__")();
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), "dltensor"));
  if (m == nullptr) throw py::error_already_set();
  const DLTensor& t = m->dl_tensor;
  if (t.device.device_type != kDLCPU)
    throw py::value_error("'" + name + "' is not in CPU memory: kda runs on the CPU");
  v.dtype = from_dlpack(t.dtype);
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  v.shape.assign(t.shape, t.shape + t.ndim);
  v.strides.resize(t.ndim);
  int64_t expect = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    v.strides[i] = t.strides != nullptr ? t.strides[i] : expect;
    expect *= t.shape[i];
  }
  // The capsule stays unconsumed: when it dies its destructor releases the producer's context, while the
  // tensor itself (src, alive in the caller's frame) owns the memory.
  v.keep = py::make_tuple(src, cap);
  return v;
}

TensorView from_buffer(const py::handle& obj, const std::string& name) {
  TensorView v;
  v.name = name;
  py::buffer buf = py::reinterpret_borrow<py::buffer>(obj);
  py::buffer_info info;
  try {
    info = buf.request(true);
  } catch (const py::error_already_set&) {
    PyErr_Clear();
    info = buf.request(false);
    v.writable = false;
  }
  const std::string f = info.format;
  if (f == py::format_descriptor<float>::format()) {
    v.dtype = DType::F32;
  } else if (info.itemsize == 4 && (f == "i" || f == "<i" || f == "=i")) {
    v.dtype = DType::I32;
  } else if (info.itemsize == 8 &&
             (f == "l" || f == "q" || f == "<l" || f == "<q" || f == "=q" || f == "=l")) {
    v.dtype = DType::I64;
  }
  v.data = info.ptr;
  v.shape.assign(info.shape.begin(), info.shape.end());
  for (const auto s : info.strides) {
    if (s % info.itemsize != 0)
      throw py::value_error("'" + name + "' has a stride of " + std::to_string(s) +
                            " bytes, not a multiple of its element size");
    v.strides.push_back(s / info.itemsize);
  }
  v.keep = py::reinterpret_borrow<py::object>(obj);
  return v;
}

}  // namespace

TensorView as_tensor(const py::handle& obj, const std::string& name) {
  if (obj.is_none()) throw py::type_error("'" + name + "' is None");
  // NumPy through the buffer protocol (its __dlpack__ refuses read-only arrays); torch and other DLPack
  // producers through DLPack.
  if (py::isinstance<py::array>(obj)) return from_buffer(obj, name);
  if (py::hasattr(obj, "__dlpack__")) return from_dlpack_object(obj, name);
  if (PyObject_CheckBuffer(obj.ptr())) return from_buffer(obj, name);
  throw py::type_error("'" + name + "' must be a torch.Tensor or a numpy.ndarray, got " +
                       std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
}

void expect_dtype(const TensorView& t, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::string names;
  for (DType d : allowed) names += std::string(names.empty() ? "" : " or ") + to_string(d);
  throw py::type_error("'" + t.name + "' must be " + names + ", got " + to_string(t.dtype));
}

void expect_ndim(const TensorView& t, int ndim) {
  if (t.ndim() != ndim)
    throw py::value_error("'" + t.name + "' must have " + std::to_string(ndim) + " dimensions, got shape " +
                          t.shape_str());
}

void expect_writable(const TensorView& t) {
  if (!t.writable) throw py::value_error("'" + t.name + "' is read-only but is written in place");
}

}  // namespace kda::python
