// kda.ops: fla's chunk_kda / fused_recurrent_kda over the C++ kernels (python/kda/ops.py is the
// fla-signature front; it checks fla's keyword arguments and calls _kda._kda_op).
//
// Everything is checked before anything is written: the shapes, dtypes and layouts here, then
// validate_kda_args (cu_seqlens, slot indices) inside the dispatcher, which runs before the kernel
// touches the pool. Until then only buffers this call allocated exist, so a refused call leaves every
// input, output and pool tensor as it was.
#include <dlpack/dlpack.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <sys/mman.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "kda/common/bf16.h"
#include "kda/kernels/kda/kda.h"
#include "tensor.h"

namespace kda::python {
namespace {

using kernels::KdaArgs;
using kernels::KernelImpl;

[[noreturn]] void bad(const std::string& what) { throw py::value_error("kda.ops: " + what); }

// fla implements it, these kernels do not: NotImplementedError, so that a caller can tell "not here"
// from "wrong input".
[[noreturn]] void unsupported(const std::string& what) {
  PyErr_SetString(PyExc_NotImplementedError, ("kda.ops: " + what).c_str());
  throw py::error_already_set();
}

std::string str(int64_t x) { return std::to_string(x); }

// Elements between consecutive tokens of a [B, T, H, X] tensor whose rows are flattened over B and T,
// or 0 when they are dense. Each token's [H, X] must be dense (the kernels index inside a row with
// fixed H and X); the rows themselves may be spaced out, uniformly, as KdaArgs' strides allow.
int64_t token_row_stride(const TensorView& t) {
  const int64_t B = t.shape[0], T = t.shape[1], H = t.shape[2], X = t.shape[3];
  const bool inner_dense = (X == 1 || t.strides[3] == 1) && (H == 1 || t.strides[2] == X);
  if (!inner_dense)
    bad("'" + t.name + "' must have each token's [H, " + str(X) +
        "] dense (row-major); only the token rows may be strided");
  if (B * T <= 1) return 0;
  int64_t s;
  if (T == 1) {
    s = t.strides[0];
  } else if (B == 1) {
    s = t.strides[1];
  } else {
    if (t.strides[0] != T * t.strides[1])
      bad("'" + t.name + "' has batch stride " + str(t.strides[0]) + " != T * token stride " +
          str(T * t.strides[1]) + ": its token rows are not uniformly spaced");
    s = t.strides[1];
  }
  if (s < H * X)
    bad("'" + t.name + "' has token stride " + str(s) + " < a row of " + str(H * X) +
        " elements (overlapping or reversed rows)");
  return s == H * X ? 0 : s;
}

void expect_shape(const TensorView& t, const std::vector<int64_t>& want, const std::string& why) {
  if (t.shape != want) {
    TensorView w;
    w.shape = want;
    bad("'" + t.name + "' has shape " + t.shape_str() + ", expected " + w.shape_str() + " (" + why + ")");
  }
}

void expect_contiguous(const TensorView& t) {
  if (!t.contiguous()) bad("'" + t.name + "' must be contiguous");
}

// An int32/int64 vector as int32: the int32 contiguous ones are used in place, the others copied.
const int32_t* as_i32(const TensorView& t, std::vector<int32_t>& buf) {
  expect_dtype(t, {DType::I32, DType::I64});
  if (t.dtype == DType::I32 && t.contiguous()) return t.ptr<int32_t>();
  const int64_t n = t.shape[0], st = t.strides[0];
  buf.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t x = t.dtype == DType::I32 ? t.ptr<int32_t>()[i * st] : t.ptr<int64_t>()[i * st];
    if (x < std::numeric_limits<int32_t>::min() || x > std::numeric_limits<int32_t>::max())
      bad("'" + t.name + "'[" + str(i) + "]=" + str(x) + " does not fit in int32");
    buf[static_cast<size_t>(i)] = static_cast<int32_t>(x);
  }
  return buf.data();
}

// A small parameter vector (A_log, dt_bias) of n elements in any shape, as fp32: fp32 contiguous in
// place, bf16 widened (a bf16 load of a checkpoint may hand them so).
const float* as_f32_param(const TensorView& t, int64_t n, const std::string& what, std::vector<float>& buf) {
  expect_dtype(t, {DType::F32, DType::BF16});
  if (t.numel() != n) bad("'" + t.name + "' has " + str(t.numel()) + " elements, expected " + what);
  expect_contiguous(t);
  if (t.dtype == DType::F32) return t.ptr<float>();
  buf.resize(static_cast<size_t>(n));
  bf16_to_f32_array(t.ptr<bf16_t>(), buf.data(), static_cast<size_t>(n));
  return buf.data();
}

// Large fresh outputs: first-touch page faults of 4 KiB pages cost most of the time of a large write
// (measured on a 64 MiB one), paid on every call because big blocks come straight from mmap. Transparent huge
// pages (where the system allows them on request) cut the faults 512-fold.
void advise_huge_pages(void* p, size_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 2 * kHuge) return;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // a hint: failure is harmless
#else
  (void)p;
  (void)bytes;
#endif
}

// Big torch outputs (a prefill's o: 64 MiB at 4096 tokens x 32 x 128) come from a cache of at most
// kMaxFree blocks that earlier outputs gave back when torch freed them. Even on huge pages, a fresh
// block costs the kernel zeroing it (a measurable part of a 4096-token call); a returned block is
// already mapped. Smaller outputs take torch.empty. The cache holds at most kMaxFree blocks idle.
class BlockCache {
 public:
  static constexpr size_t kMin = size_t{8} << 20, kAlign = size_t{2} << 20, kMaxFree = 2;
  void* get(size_t& bytes) {
    bytes = (bytes + kAlign - 1) / kAlign * kAlign;
    {
      const std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].second >= bytes && free_[i].second <= 2 * bytes) {
          void* p = free_[i].first;
          bytes = free_[i].second;
          free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
          return p;
        }
      }
    }
    void* p = std::aligned_alloc(kAlign, bytes);
    if (p == nullptr) throw std::bad_alloc();
    advise_huge_pages(p, bytes);
    return p;
  }
  // From whatever thread frees the tensor, with or without the GIL: no Python here.
  void put(void* p, size_t bytes) {
    {
      const std::lock_guard<std::mutex> lock(mu_);
      if (free_.size() < kMaxFree) {
        free_.emplace_back(p, bytes);
        return;
      }
    }
    std::free(p);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<void*, size_t>> free_;
};

BlockCache& block_cache() {
  static auto* cache = new BlockCache;  // leaked: tensors may be freed during interpreter shutdown
  return *cache;
}

struct CachedOutput {
  DLManagedTensor m{};
  int64_t shape[8] = {};
  size_t bytes = 0;
};

// torch's functions and dtypes, looked up once under the GIL and leaked so that no Python object is
// released after the interpreter is gone. Not function-local statics: a static's initializer runs under
// the C++ guard, and Python code it reaches (an import, a finalizer run by the garbage collector) may hand
// the GIL to another thread that then waits on the guard while holding the GIL -- a deadlock (pybind11's
// gil_safe_call_once.h names it; 2.10 lacks that helper). Under the GIL a plain pointer is enough: two
// threads that both look it up leak one copy.
struct TorchFns {
  py::object from_dlpack, empty, f32, b16;
};

const TorchFns& torch_fns() {
  static TorchFns* fns = nullptr;  // read and written with the GIL held
  if (fns == nullptr) {
    const py::module_ torch = py::module_::import("torch");
    auto* f = new TorchFns{torch.attr("_C").attr("_from_dlpack"), torch.attr("empty"), torch.attr("float32"),
                           torch.attr("bfloat16")};
    if (fns == nullptr) fns = f;  // else another thread won while the GIL was away: keep its copy
  }
  return *fns;
}

py::object cached_torch_output(const std::vector<int64_t>& shape, bool bf16, size_t bytes) {
  const py::object& from_dlpack = torch_fns().from_dlpack;
  auto* h = new CachedOutput;
  h->bytes = bytes;
  void* data = nullptr;
  try {
    data = block_cache().get(h->bytes);
  } catch (...) {
    delete h;
    throw;
  }
  DLTensor& t = h->m.dl_tensor;
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = bf16 ? DLDataType{kDLBfloat, 16, 1} : DLDataType{kDLFloat, 32, 1};
  for (size_t i = 0; i < shape.size(); ++i) h->shape[i] = shape[i];
  t.shape = h->shape;
  t.strides = nullptr;  // row-major
  t.byte_offset = 0;
  h->m.manager_ctx = h;
  h->m.deleter = [](DLManagedTensor* m) {
    auto* c = static_cast<CachedOutput*>(m->manager_ctx);
    block_cache().put(c->m.dl_tensor.data, c->bytes);
    delete c;
  };
  // An unconsumed capsule (from_dlpack failed) still hands the block back.
  PyObject* cap = PyCapsule_New(&h->m, "dltensor", [](PyObject* c) {
    if (PyCapsule_IsValid(c, "dltensor")) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
      m->deleter(m);
    }
  });
  if (cap == nullptr) {
    h->m.deleter(&h->m);
    throw py::error_already_set();
  }
  return from_dlpack(py::reinterpret_steal<py::object>(cap));
}

py::object new_output(bool torch, const std::vector<int64_t>& shape, bool bf16) {
  size_t bytes = bf16 ? 2 : 4;
  for (const int64_t d : shape) bytes *= static_cast<size_t>(d);
  if (torch) {
    if (bytes >= BlockCache::kMin && shape.size() <= 8) return cached_torch_output(shape, bf16, bytes);
    const TorchFns& t = torch_fns();
    py::tuple sizes(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) sizes[i] = py::int_(shape[i]);
    return t.empty(sizes, py::arg("dtype") = bf16 ? t.b16 : t.f32);
  }
  return py::array_t<float>(std::vector<py::ssize_t>(shape.begin(), shape.end()));
}

void* data_of(const py::object& t, bool torch) {
  if (torch) return reinterpret_cast<void*>(t.attr("data_ptr")().cast<uintptr_t>());
  return py::reinterpret_borrow<py::array>(t).mutable_data();
}

// A plain CPU torch.Tensor read through its own accessors (is_cpu, dtype, data_ptr(), shape,
// stride()): as_tensor's general path (type probing, device attribute, detach(), Tensor.__dlpack__'s
// Python checks, an exported view made and freed) costs several times what this does per tensor, which
// for a batch-1 decode with ten tensors is most of the call. Anything else (NumPy,
// subclasses, other devices, a tensor without a data pointer such as a sparse one) takes as_tensor,
// which also gives the errors.
struct TorchNames {
  py::object tensor_type, f32, bf16, i32, i64;
  py::str is_cpu{"is_cpu"}, dtype{"dtype"}, data_ptr{"data_ptr"}, shape{"shape"}, stride{"stride"};
};

const TorchNames* torch_names() {
  // Made once torch is loaded (never imported here: NumPy callers need not have it), and leaked so that
  // nothing is released after the interpreter is gone.
  static TorchNames* names = nullptr;
  if (names == nullptr) {
    PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
    if (torch == nullptr) return nullptr;
    const auto mod = py::reinterpret_borrow<py::object>(torch);
    names = new TorchNames{mod.attr("Tensor"), mod.attr("float32"), mod.attr("bfloat16"), mod.attr("int32"),
                           mod.attr("int64")};
  }
  return names;
}

// The int64 values of a tuple (torch.Size or stride()'s tuple); false if it is not one.
bool int_tuple(PyObject* t, std::vector<int64_t>& out) {
  if (t == nullptr || !PyTuple_Check(t)) return false;
  const Py_ssize_t n = PyTuple_GET_SIZE(t);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
  return !PyErr_Occurred();
}

TensorView view_of(py::handle obj, const char* name) {
  const TorchNames* tn = torch_names();
  if (tn == nullptr || obj.get_type().ptr() != tn->tensor_type.ptr()) return as_tensor(obj, name);
  PyObject* o = obj.ptr();
  const auto attr = [&](const py::str& n) {
    return py::reinterpret_steal<py::object>(PyObject_GetAttr(o, n.ptr()));
  };
  const auto call = [&](const py::str& n) {
    return py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(o, n.ptr()));
  };
  const py::object cpu = attr(tn->is_cpu);
  if (cpu.ptr() != Py_True) {
    PyErr_Clear();
    return as_tensor(obj, name);
  }
  TensorView v;
  v.name = name;
  v.is_torch = true;
  const py::object dt = attr(tn->dtype);
  const PyObject* d = dt.ptr();
  v.dtype = d == tn->f32.ptr()    ? DType::F32
            : d == tn->bf16.ptr() ? DType::BF16
            : d == tn->i32.ptr()  ? DType::I32
            : d == tn->i64.ptr()  ? DType::I64
                                  : DType::Other;
  const py::object ptr = call(tn->data_ptr), shape = attr(tn->shape), stride = call(tn->stride);
  if (!ptr || !int_tuple(shape.ptr(), v.shape) || !int_tuple(stride.ptr(), v.strides)) {
    PyErr_Clear();
    return as_tensor(obj, name);
  }
  v.data = PyLong_AsVoidPtr(ptr.ptr());
  v.keep = py::reinterpret_borrow<py::object>(obj);  // the caller's tensor owns the memory
  return v;
}

// One prepared call: the views it borrows, the buffers it owns, the kernel arguments pointing into
// both, and the Python outputs. Built (with the GIL) by prepare(), run without the GIL by run().
struct OpCall {
  bool chunk = true;
  std::deque<TensorView> views;  // a deque: references to its elements stay valid as it grows
  std::vector<float> beta_buf, alog_buf, dtb_buf;
  // The fp32 o of a bf16 call: uninitialized (the kernel writes every element), unlike a vector.
  std::unique_ptr<float[]> o_buf;
  size_t o_n = 0;
  std::vector<int32_t> cu_buf, idx_buf;
  std::vector<uint8_t> no_initial;
  KdaArgs a;
  const float* state_src = nullptr;  // copied into the fresh final state before the kernel runs
  size_t state_n = 0;
  bf16_t* o_bf16 = nullptr;  // bf16 output: the kernel writes o_buf, converted into it afterwards
  std::vector<kernels::KdaSnapshot> snaps;  // return_intermediate_states: one per chunk, into h
  // Speculative decoding (2-D ssm_state_indices): the initial states gathered from their slots, and
  // the rows' scratch indices (-1: padded row).
  std::vector<float> spec_init;
  std::vector<int32_t> spec_idx;
  py::object o, final_state, h;
};

struct OpInputs {
  py::handle q, k, v, g, beta;
  py::object scale;
  py::handle initial_state;
  bool output_final_state;
  bool l2norm;
  bool gate;
  py::handle A_log, dt_bias, cu_seqlens, ssm_state_indices;
  bool inplace;
  bool intermediate = false;                    // chunk_kda's return_intermediate_states
  py::handle num_accepted_tokens = py::none();  // fused_recurrent_kda, with 2-D ssm_state_indices
};

void prepare(OpCall& c, const OpInputs& in) {
  const auto view = [&](py::handle h, const char* name) -> const TensorView& {
    c.views.push_back(view_of(h, name));
    return c.views.back();
  };
  const TensorView& q = view(in.q, "q");
  const TensorView& k = view(in.k, "k");
  const TensorView& v = view(in.v, "v");
  const TensorView& g = view(in.g, "g");
  const TensorView& beta = view(in.beta, "beta");
  for (const TensorView* t : {&q, &k, &v, &g}) {
    expect_dtype(*t, {DType::F32, DType::BF16});
    expect_ndim(*t, 4);
  }
  expect_dtype(beta, {DType::F32, DType::BF16});
  if (k.dtype != q.dtype || v.dtype != q.dtype)
    throw py::type_error("kda.ops: q, k and v must share one dtype (got " + std::string(to_string(q.dtype)) +
                         ", " + to_string(k.dtype) + ", " + to_string(v.dtype) + ")");

  const int64_t B = q.shape[0], T = q.shape[1], H = q.shape[2], K = q.shape[3], V = v.shape[3];
  expect_shape(k, q.shape, "as q: [B, T, H, K]");
  if (v.shape[0] != B || v.shape[1] != T) expect_shape(v, {B, T, H, V}, "[B, T, H, V] with q's B, T, H");
  if (v.shape[2] != H) {
    if (v.shape[2] > H && v.shape[2] % H == 0)
      unsupported("v has " + str(v.shape[2]) + " heads and q " + str(H) +
                  ": grouped value attention (GVA, v with more heads than q) is not supported");
    expect_shape(v, {B, T, H, V}, "[B, T, H, V] with q's B, T, H");
  }
  expect_shape(g, q.shape, "as q: [B, T, H, K]");
  if (beta.ndim() == 4 && beta.shape == v.shape)
    unsupported("beta of shape [B, T, H, V] (per-channel beta) is not supported; beta must be [B, T, H]");
  expect_shape(beta, {B, T, H}, "[B, T, H]");
  if (H > std::numeric_limits<int>::max() || K > std::numeric_limits<int>::max() ||
      V > std::numeric_limits<int>::max())
    bad("H, K or V too large");

  KdaArgs& a = c.a;
  a.T = B * T;
  a.H = static_cast<int>(H);
  a.K = static_cast<int>(K);
  a.V = static_cast<int>(V);
  a.q_stride = token_row_stride(q);
  a.k_stride = token_row_stride(k);
  a.v_stride = token_row_stride(v);
  a.g_stride = token_row_stride(g);
  if (q.dtype == DType::BF16) {
    a.q_bf16 = q.ptr<bf16_t>();
    a.k_bf16 = k.ptr<bf16_t>();
    a.v_bf16 = v.ptr<bf16_t>();
  } else {
    a.q = q.ptr<float>();
    a.k = k.ptr<float>();
    a.v = v.ptr<float>();
  }
  if (g.dtype == DType::BF16) {
    a.g_bf16 = g.ptr<bf16_t>();
  } else {
    a.g = g.ptr<float>();
  }
  // The kernels take beta dense fp32 [T, H]; anything else is gathered (and widened) into a copy of
  // T * H values, so the caller's tensor is never converted in place.
  const bool beta_dense = beta.contiguous();
  if (beta.dtype == DType::F32 && beta_dense) {
    a.beta = beta.ptr<float>();
  } else {
    c.beta_buf.resize(static_cast<size_t>(B * T * H));
    float* dst = c.beta_buf.data();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t off = b * beta.strides[0] + t * beta.strides[1] + h * beta.strides[2];
          *dst++ = beta.dtype == DType::F32 ? beta.ptr<float>()[off] : bf16_to_f32(beta.ptr<bf16_t>()[off]);
        }
    a.beta = c.beta_buf.data();
  }

  if (!in.scale.is_none()) {
    const double s = in.scale.cast<double>();
    // The kernels read scale <= 0 as "K^-0.5"; an explicit non-positive scale would be silently replaced.
    if (!(s > 0.0) || !std::isfinite(s))
      bad("scale must be a positive finite number, got " + std::to_string(s));
    a.scale = static_cast<float>(s);
  }
  a.use_qk_l2norm_in_kernel = in.l2norm;

  a.use_gate_in_kernel = in.gate;
  if (in.gate) {
    if (in.A_log.is_none()) bad("use_gate_in_kernel=True requires A_log (H values)");
    a.A_log = as_f32_param(view(in.A_log, "A_log"), H, "H=" + str(H), c.alog_buf);
    if (!in.dt_bias.is_none())
      a.dt_bias = as_f32_param(view(in.dt_bias, "dt_bias"), H * K, "H*K=" + str(H * K), c.dtb_buf);
  } else if (!in.A_log.is_none() || !in.dt_bias.is_none()) {
    // fla ignores them then; here that would hide a caller who meant the gate to run in the kernel.
    bad("A_log / dt_bias are given but use_gate_in_kernel=False: g is then already the log-space gate");
  }

  // Sequences: cu_seqlens [N+1] over one batch row, or B sequences of T tokens.
  if (!in.cu_seqlens.is_none()) {
    const TensorView& cu = view(in.cu_seqlens, "cu_seqlens");
    expect_ndim(cu, 1);
    if (cu.shape[0] < 1) bad("'cu_seqlens' is empty; it needs N+1 >= 1 entries");
    if (B != 1) bad("the batch size must be 1 with cu_seqlens (got B=" + str(B) + "); flatten the batch");
    a.cu_seqlens = as_i32(cu, c.cu_buf);
    a.N = cu.shape[0] - 1;
  } else {
    a.N = B;
  }
  const int64_t N = a.N;
  const int64_t slot = H * K * V;

  const bool torch_out = v.is_torch;
  const bool have_indices = !in.ssm_state_indices.is_none();
  const TensorView* pool = nullptr;
  if (!in.initial_state.is_none()) {
    pool = &view(in.initial_state, "initial_state");
    expect_dtype(*pool, {DType::F32});
    expect_ndim(*pool, 4);
    if (pool->shape[1] != H || pool->shape[2] != K || pool->shape[3] != V)
      expect_shape(*pool, {pool->shape[0], H, K, V}, "[N or slots, H, K, V]");
    expect_contiguous(*pool);
    if (!have_indices && pool->shape[0] != N)
      bad("'initial_state' holds " + str(pool->shape[0]) + " states for N=" + str(N) + " sequences");
  }
  if (have_indices && view_of(in.ssm_state_indices, "ssm_state_indices").ndim() == 2) {
    // fla's / vLLM's speculative decoding: ssm_state_indices [N, S], num_accepted_tokens [N]. Sequence i
    // starts from slot ssm_state_indices[i, num_accepted_tokens[i] - 1] (the state after its last
    // accepted token; a negative slot: a padded row) and the state after its token t is written into
    // slot ssm_state_indices[i, t] (a negative entry: not kept). Here: the initial states are gathered
    // into a scratch pool and the per-token states are the kernel's snapshots into the pool, so a slot
    // may be both read (before the call) and written.
    if (c.chunk) unsupported("2-D ssm_state_indices are for fused_recurrent_kda (speculative decoding)");
    const TensorView& idx = view(in.ssm_state_indices, "ssm_state_indices");
    if (pool == nullptr) bad("ssm_state_indices needs initial_state: the state pool they index");
    if (!in.inplace)
      bad("2-D ssm_state_indices need inplace_final_state=True: per-token states go into the pool");
    expect_writable(*pool);
    if (idx.shape[0] != N)
      bad("'ssm_state_indices' has " + str(idx.shape[0]) + " rows for N=" + str(N) + " sequences");
    expect_contiguous(idx);
    expect_dtype(idx, {DType::I32, DType::I64});
    const int64_t S = idx.shape[1], slots = pool->shape[0];
    const auto at = [&](int64_t i, int64_t t) -> int64_t {
      return idx.dtype == DType::I32 ? idx.ptr<int32_t>()[i * S + t] : idx.ptr<int64_t>()[i * S + t];
    };
    std::vector<int32_t> nacc(static_cast<size_t>(N), 1);
    if (!in.num_accepted_tokens.is_none()) {
      const TensorView& na = view(in.num_accepted_tokens, "num_accepted_tokens");
      expect_ndim(na, 1);
      if (na.shape[0] != N)
        bad("'num_accepted_tokens' has " + str(na.shape[0]) + " entries for N=" + str(N) + " sequences");
      std::vector<int32_t> buf;
      const int32_t* p = as_i32(na, buf);
      nacc.assign(p, p + N);
    }
    c.spec_init.assign(static_cast<size_t>(N * slot), 0.0f);
    c.spec_idx.assign(static_cast<size_t>(N), -1);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t len = a.cu_seqlens != nullptr ? a.cu_seqlens[i + 1] - a.cu_seqlens[i] : T;
      if (len > S)
        bad("sequence " + str(i) + " has " + str(len) + " tokens but ssm_state_indices only " + str(S));
      if (nacc[i] < 1 || nacc[i] > S)
        bad("num_accepted_tokens[" + str(i) + "]=" + str(nacc[i]) + " not in [1, " + str(S) + "]");
      const int64_t src = at(i, nacc[i] - 1);
      if (src >= slots)
        bad("ssm_state_indices[" + str(i) + ", " + str(nacc[i] - 1) + "]=" + str(src) + " >= " + str(slots) +
            " slots");
      if (src < 0) continue;  // padded row
      c.spec_idx[i] = static_cast<int32_t>(i);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t dst = at(i, t);
        if (dst >= slots)
          bad("ssm_state_indices[" + str(i) + ", " + str(t) + "]=" + str(dst) + " >= " + str(slots) +
              " slots");
        if (dst >= 0)
          c.snaps.push_back(
              {static_cast<int32_t>(i), static_cast<int32_t>(t + 1), static_cast<int32_t>(dst)});
      }
      std::memcpy(c.spec_init.data() + i * slot, pool->ptr<float>() + src * slot, sizeof(float) * slot);
    }
    a.state = c.spec_init.data();
    a.state_indices = c.spec_idx.data();
    a.num_state_slots = N;
    a.output_final_state = false;
    a.snapshots = c.snaps.data();
    a.num_snapshots = static_cast<int64_t>(c.snaps.size());
    a.snapshot_state = pool->ptr<float>();
    a.num_snapshot_slots = slots;
    c.final_state = py::reinterpret_borrow<py::object>(in.initial_state);
    const bool bf16_o = v.dtype == DType::BF16;
    c.o = new_output(torch_out, {B, T, H, V}, bf16_o);
    if (bf16_o) {
      c.o_n = static_cast<size_t>(B * T * H * V);
      c.o_buf.reset(new float[c.o_n]);
      a.o = c.o_buf.get();
      c.o_bf16 = static_cast<bf16_t*>(data_of(c.o, torch_out));
    } else {
      a.o = static_cast<float*>(data_of(c.o, torch_out));
    }
    return;
  }
  if (!in.num_accepted_tokens.is_none()) bad("num_accepted_tokens needs 2-D ssm_state_indices [N, S]");
  if (have_indices) {
    const TensorView& idx = view(in.ssm_state_indices, "ssm_state_indices");
    expect_ndim(idx, 1);
    if (idx.shape[0] != N)
      bad("'ssm_state_indices' has " + str(idx.shape[0]) + " entries for N=" + str(N) + " sequences");
    if (pool == nullptr) bad("ssm_state_indices needs initial_state: the state pool they index");
    if (!in.inplace && in.output_final_state)
      unsupported(
          "ssm_state_indices with output_final_state=True and inplace_final_state=False (fla's per-token "
          "final states) is not supported; use inplace_final_state=True");
    a.state_indices = as_i32(idx, c.idx_buf);
  }

  if (in.inplace) {
    // vLLM's / sglang's decode: the pool is read and written in place, slot ssm_state_indices[i] (or i).
    if (pool == nullptr) bad("inplace_final_state=True needs initial_state: the state pool it updates");
    expect_writable(*pool);
    a.state = pool->ptr<float>();
    a.num_state_slots = pool->shape[0];
    a.output_final_state = true;
    c.final_state = py::reinterpret_borrow<py::object>(in.initial_state);
  } else if (in.output_final_state) {
    // fla's convention: a new [N, H, K, V] final state, the caller's initial_state untouched. The
    // kernel updates a pool in place, so the new tensor is that pool, seeded from initial_state (or
    // flagged "no initial state" so the kernel starts from zero without reading it).
    c.final_state = new_output(torch_out, {N, H, K, V}, false);
    a.state = static_cast<float*>(data_of(c.final_state, torch_out));
    advise_huge_pages(a.state, static_cast<size_t>(N * slot) * sizeof(float));
    a.num_state_slots = N;
    a.output_final_state = true;
    if (pool != nullptr) {
      c.state_src = pool->ptr<float>();
      c.state_n = static_cast<size_t>(N * slot);
    } else {
      c.no_initial.assign(static_cast<size_t>(N), 0);
      a.has_initial_state = c.no_initial.data();
    }
  } else {
    c.final_state = py::none();
    if (pool != nullptr) {
      // Read only: with output_final_state=false the kernels never write the pool.
      a.state = pool->ptr<float>();
      a.num_state_slots = pool->shape[0];
      a.output_final_state = false;
    }
  }

  const bool bf16_out = v.dtype == DType::BF16;
  c.o = new_output(torch_out, {B, T, H, V}, bf16_out);
  if (bf16_out) {
    c.o_n = static_cast<size_t>(B * T * H * V);
    c.o_buf.reset(new float[c.o_n]);
    a.o = c.o_buf.get();
    advise_huge_pages(a.o, c.o_n * sizeof(float));
    c.o_bf16 = static_cast<bf16_t*>(data_of(c.o, torch_out));
  } else {
    a.o = static_cast<float*>(data_of(c.o, torch_out));
    advise_huge_pages(a.o, static_cast<size_t>(B * T * H * V) * sizeof(float));
  }

  if (in.intermediate) {
    // fla's h: the state entering each 64-token chunk of each sequence (the initial state, or zero, for
    // the first), [B, NT, H, K, V] with NT = ceil(T / 64), or with cu_seqlens [1, the sequences' NT in
    // all, H, K, V]. fp32 here (fla's is bf16). The kernel writes it as snapshots at positions 0, 64, ...
    // in the pass that computes o. The sequences are checked before h is sized from them.
    kernels::validate_kda_args(a);
    constexpr int64_t kC = 64;
    int64_t total = 0;
    for (int64_t i = 0; i < N; ++i) {
      const int64_t len = a.cu_seqlens != nullptr ? a.cu_seqlens[i + 1] - a.cu_seqlens[i] : T;
      for (int64_t pos = 0; pos < len; pos += kC)
        c.snaps.push_back(
            {static_cast<int32_t>(i), static_cast<int32_t>(pos), static_cast<int32_t>(total++)});
    }
    const std::vector<int64_t> shape = a.cu_seqlens != nullptr
                                           ? std::vector<int64_t>{1, total, H, K, V}
                                           : std::vector<int64_t>{B, (T + kC - 1) / kC, H, K, V};
    c.h = new_output(torch_out, shape, false);
    a.snapshots = c.snaps.data();
    a.num_snapshots = static_cast<int64_t>(c.snaps.size());
    a.snapshot_state = static_cast<float*>(data_of(c.h, torch_out));
    a.num_snapshot_slots = total;
  }
}

void kernel(const OpCall& c) {
  if (c.chunk) {
    kernels::chunk_kda(c.a, KernelImpl::Auto);
  } else {
    kernels::fused_recurrent_kda(c.a, KernelImpl::Auto);
  }
}

// Without the GIL: no Python object is touched here.
void run(OpCall& c) {
  // The dispatcher validates again, but the seed copy below writes the fresh final state first, so
  // validate here: a refused call must not leave half a result anywhere.
  kernels::validate_kda_args(c.a);
  if (c.state_src != nullptr) std::memcpy(c.a.state, c.state_src, c.state_n * sizeof(float));
  kernel(c);
  if (c.o_bf16 != nullptr) f32_to_bf16_array(c.o_buf.get(), c.o_bf16, c.o_n);
}

OpInputs inputs(py::handle q, py::handle k, py::handle v, py::handle g, py::handle beta, py::object scale,
                py::handle initial_state, bool output_final_state, bool l2norm, bool gate, py::handle A_log,
                py::handle dt_bias, py::handle cu_seqlens, py::handle ssm_state_indices, bool inplace) {
  return OpInputs{
      q,      k,    v,     g,       beta,       std::move(scale),  initial_state, output_final_state,
      l2norm, gate, A_log, dt_bias, cu_seqlens, ssm_state_indices, inplace};
}

}  // namespace

void register_ops(py::module_& m) {
  m.def(
      "_kda_op",
      [](bool chunk, py::handle q, py::handle k, py::handle v, py::handle g, py::handle beta,
         py::object scale, py::handle initial_state, bool output_final_state, bool l2norm, bool gate,
         py::handle A_log, py::handle dt_bias, py::handle cu_seqlens, py::handle ssm_state_indices,
         bool inplace, bool intermediate, py::handle num_accepted_tokens) {
        apply_num_threads();
        OpCall c;
        c.chunk = chunk;
        OpInputs in = inputs(q, k, v, g, beta, std::move(scale), initial_state, output_final_state, l2norm,
                             gate, A_log, dt_bias, cu_seqlens, ssm_state_indices, inplace);
        in.intermediate = chunk && intermediate;
        in.num_accepted_tokens = num_accepted_tokens;
        prepare(c, in);
        {
          py::gil_scoped_release release;
          run(c);
        }
        if (in.intermediate) return py::make_tuple(c.o, c.final_state, c.h);
        return py::make_tuple(c.o, c.final_state);
      },
      "Private: kda.ops.chunk_kda (chunk=True) / fused_recurrent_kda, arguments checked by kda/ops.py.",
      py::arg("chunk"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"),
      py::arg("scale"), py::arg("initial_state"), py::arg("output_final_state"), py::arg("l2norm"),
      py::arg("gate"), py::arg("A_log"), py::arg("dt_bias"), py::arg("cu_seqlens"),
      py::arg("ssm_state_indices"), py::arg("inplace"), py::arg("intermediate"),
      py::arg("num_accepted_tokens") = py::none());
  m.def(
      "_time_kda_op",
      [](int n, bool chunk, py::handle q, py::handle k, py::handle v, py::handle g, py::handle beta,
         py::object scale, py::handle initial_state, bool output_final_state, bool l2norm, bool gate,
         py::handle A_log, py::handle dt_bias, py::handle cu_seqlens, py::handle ssm_state_indices,
         bool inplace) {
        // The C++ side of bench/python_ops_overhead.py: the same arguments prepared once, then n
        // dispatcher calls on the same buffers, timed without Python in the loop. Seconds per call.
        if (n < 1) bad("n must be >= 1");
        apply_num_threads();
        OpCall c;
        c.chunk = chunk;
        prepare(c, inputs(q, k, v, g, beta, std::move(scale), initial_state, output_final_state, l2norm, gate,
                          A_log, dt_bias, cu_seqlens, ssm_state_indices, inplace));
        double seconds = 0.0;
        {
          py::gil_scoped_release release;
          run(c);  // warm-up, and the one seed copy of a fresh final state
          const auto t0 = std::chrono::steady_clock::now();
          for (int i = 0; i < n; ++i) kernel(c);
          seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
        }
        return seconds;
      },
      "Private benchmark helper: seconds per C++ kernel call for _kda_op's arguments.");
}

}  // namespace kda::python
