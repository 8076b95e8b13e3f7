// The serving component under the RFC's names (sgl-jax style): KimiLinearConfig, Checkpoint,
// KimiDeltaAttention, RecurrentStatePoolConfig / RecurrentStatePool / HybridReqToTokenPool / MemoryPools,
// ForwardMode / ForwardBatch, KDAAttnBackend and its metadata. Everything checks its arguments before
// anything changes; C++ errors keep their message (std::invalid_argument -> ValueError, the rest ->
// RuntimeError).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "args.h"
#include "bindings.h"
#include "forward_batch.h"
#include "kda/common/bf16.h"
#include "kda/common/precision.h"
#include "kda/io/config.h"
#include "kda/io/safetensors.h"
#include "kda/kernels/kda/kda.h"
#include "kda/layers/attention/linear/kda_backend.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/mem_cache/mla_token_pool.h"
#include "kda/model_executor/forward_batch_info.h"
#include "kda/models/kimi_linear.h"
#include "tensor.h"

namespace kda::python {

namespace {

namespace fs = std::filesystem;
using io::KimiLinearConfig;
using layers::attention::linear::KDAAttnBackend;
using layers::attention::linear::LinearRecurrentAttnBackendMetadata;
using mem_cache::HybridReqToTokenPool;
using mem_cache::MemoryPools;
using mem_cache::RecurrentStatePool;
using mem_cache::RecurrentStatePoolConfig;
using model_executor::ForwardBatch;
using model_executor::ForwardMode;
using StateSnapshot = model_executor::ForwardBatch::StateSnapshot;

std::string join(const std::vector<int32_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

Precision precision_of(const std::string& s) { return parse_precision(s); }

// ---- KDAAttnBackend and ForwardBatch ----

// recurrent_indices for init_forward_metadata: explicit slots, or the request -> slot mapping of a
// HybridReqToTokenPool / MemoryPools applied to the batch's req_pool_indices.
std::vector<int32_t> recurrent_indices_of(const PyForwardBatch& b, const py::handle& arg) {
  if (py::isinstance<MemoryPools>(arg))
    return arg.cast<MemoryPools&>().req_to_token_pool.get_recurrent_indices(b.fb.req_pool_indices);
  if (py::isinstance<HybridReqToTokenPool>(arg))
    return arg.cast<HybridReqToTokenPool&>().get_recurrent_indices(b.fb.req_pool_indices);
  return to_i32(arg, "recurrent_indices");
}

// The metadata's snapshots are the batch's: state_snapshots changed after init_forward_metadata would
// otherwise be silently not taken.
bool same_snapshots(const std::vector<kernels::KdaSnapshot>& md, const std::vector<StateSnapshot>& fb) {
  if (md.size() != fb.size()) return false;
  for (size_t j = 0; j < md.size(); ++j)
    if (md[j].seq != fb[j].row || md[j].pos != fb[j].pos || md[j].slot != fb[j].slot) return false;
  return true;
}

// state_snapshots from Python: StateSnapshot objects or (row, pos, slot) triples.
std::vector<StateSnapshot> to_snapshots(const py::handle& obj) {
  if (obj.is_none()) return {};
  if (!py::isinstance<py::iterable>(obj) || py::isinstance<py::str>(obj))
    throw py::type_error("'state_snapshots' must be a sequence of StateSnapshot or (row, pos, slot), got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  std::vector<StateSnapshot> v;
  for (const auto h : obj) {
    if (py::isinstance<StateSnapshot>(h)) {
      v.push_back(h.cast<StateSnapshot>());
      continue;
    }
    const auto t = to_i32(h, "state_snapshots[i]");
    if (t.size() != 3)
      throw py::value_error("state_snapshots[" + std::to_string(v.size()) + "] has " +
                            std::to_string(t.size()) + " values, not (row, pos, slot)");
    v.push_back({t[0], t[1], t[2]});
  }
  return v;
}

// The batch with `snaps`, validated before it is stored: a bad list leaves the batch as it was.
void set_snapshots(PyForwardBatch& b, std::vector<StateSnapshot> snaps) {
  ForwardBatch trial = b.fb;
  trial.state_snapshots = std::move(snaps);
  trial.validate();
  b.fb.state_snapshots = std::move(trial.state_snapshots);
}

std::string snapshot_repr(const StateSnapshot& s) {
  return "StateSnapshot(row=" + std::to_string(s.row) + ", pos=" + std::to_string(s.pos) +
         ", slot=" + std::to_string(s.slot) + ")";
}

std::string snapshots_repr(const std::vector<StateSnapshot>& v) {
  if (v.empty()) return "";
  std::string s = ", state_snapshots=[";
  for (size_t j = 0; j < v.size(); ++j) s += (j ? ", " : "") + snapshot_repr(v[j]);
  return s + "]";
}

// ---- RecurrentStatePool ----

RecurrentStatePoolConfig pool_config_for(const KimiLinearConfig& cfg, int64_t size,
                                         const std::string& precision,
                                         std::optional<std::vector<int>> layer_ids) {
  RecurrentStatePoolConfig pc;
  pc.layer_ids = layer_ids ? *layer_ids : cfg.kda_layer_ids();
  pc.size = size;
  pc.num_heads = cfg.num_heads;
  pc.head_k_dim = cfg.head_dim;
  pc.head_v_dim = cfg.head_dim;
  pc.conv_kernel = cfg.short_conv_kernel_size;
  pc.conv_dim = int64_t{3} * cfg.projection_size();
  pc.conv_dtype = precision_of(precision);
  return pc;
}

// The buffers of one layer as NumPy arrays over the pool's memory; `owner` (the Python pool object)
// is the arrays' base, so the pool lives as long as any view.
py::array recurrent_view(RecurrentStatePool& pool, int layer_id, const py::object& owner) {
  const auto c = pool.get_linear_recurrent_layer_cache(layer_id);
  const auto& pc = pool.config();
  const std::vector<py::ssize_t> shape{c.num_slots, pc.num_heads, pc.head_k_dim, pc.head_v_dim};
  return py::array_t<float>(shape, c.recurrent, owner);
}

py::array conv_view(RecurrentStatePool& pool, int layer_id, const py::object& owner) {
  const auto c = pool.get_linear_recurrent_layer_cache(layer_id);
  const auto& pc = pool.config();
  const std::vector<py::ssize_t> shape{c.num_slots, pc.conv_kernel - 1, pc.conv_dim};
  if (c.conv_f32 != nullptr) return py::array_t<float>(shape, c.conv_f32, owner);
  return py::array_t<uint16_t>(shape, c.conv_bf16, owner);  // bf16 bits
}

// A contiguous float32 array of exactly `shape`, or a ValueError / TypeError naming it.
const float* f32_block(const py::object& obj, const char* name, const std::vector<int64_t>& shape,
                       std::vector<TensorView>& keep) {
  if (obj.is_none()) return nullptr;
  TensorView t = as_tensor(obj, name);
  expect_dtype(t, {DType::F32});
  if (t.shape != shape) {
    TensorView want;
    want.shape = shape;
    throw py::value_error(std::string("'") + name + "' has shape " + t.shape_str() + " but " +
                          want.shape_str() + " was expected");
  }
  if (!t.contiguous()) throw py::value_error(std::string("'") + name + "' must be contiguous (row-major)");
  keep.push_back(t);
  return t.ptr<float>();
}

// ---- KimiDeltaAttention ----

struct PyLayer {
  std::mutex mu;                               // the layer's own workspace: one forward at a time
  std::shared_ptr<io::Checkpoint> checkpoint;  // the memory-mapped checkpoint the layer was loaded from
  KimiLinearConfig cfg;
  std::unique_ptr<models::KimiDeltaAttention> layer;
};

py::object torch_empty(int64_t T, int64_t D, const char* dtype) {
  py::module_ torch = py::module_::import("torch");
  return torch.attr("empty")(py::make_tuple(T, D), py::arg("dtype") = torch.attr(dtype));
}

py::object layer_call(PyLayer& self, const py::object& hidden_states, PyForwardBatch& batch,
                      const py::object& pools) {
  apply_num_threads();
  auto& layer = *self.layer;
  RecurrentStatePool& pool = pool_of(pools);
  TensorView x = as_tensor(hidden_states, "hidden_states");
  expect_dtype(x, {DType::F32, DType::BF16});
  expect_ndim(x, 2);
  const int64_t T = x.shape[0], D = layer.hidden_size();
  if (x.shape[1] != D)
    throw py::value_error("hidden_states has shape " + x.shape_str() + " but the layer's hidden size is " +
                          std::to_string(D));
  const ForwardBatch& fb = batch.fb;
  fb.validate();
  if (fb.num_tokens() != T)
    throw py::value_error("hidden_states has " + std::to_string(T) + " rows for a batch of " +
                          std::to_string(fb.num_tokens()) + " tokens");
  const bool computes = fb.forward_mode == ForwardMode::EXTEND || fb.forward_mode == ForwardMode::DECODE;
  if (computes && !batch.backend)
    throw py::value_error(
        "forward_batch has no attn_backend: call KDAAttnBackend.init_forward_metadata(forward_batch, pools) "
        "once per batch first");
  (void)pool.get_linear_recurrent_layer_cache(layer.layer_idx());  // the layer is in the pool
  std::shared_ptr<PyBackend> backend = batch.backend;
  // Under the backend's lock (its metadata may change under another thread's init_forward_metadata).
  const auto check_metadata = [&] {
    if (!computes) return;
    const auto& md = backend->be.forward_metadata();
    if (md.forward_mode != fb.forward_mode || md.num_tokens() != fb.num_tokens() ||
        static_cast<int64_t>(md.recurrent_indices.size()) != fb.batch_size() ||
        !same_snapshots(md.snapshots, fb.state_snapshots))
      throw std::invalid_argument(
          "the backend's forward metadata is not this batch's: call "
          "KDAAttnBackend.init_forward_metadata(forward_batch, pools) for it first");
    for (size_t i = 0; i < md.recurrent_indices.size(); ++i) {
      const int32_t s = md.recurrent_indices[i];
      if (s != -1 && !pool.is_allocated(s))
        throw std::invalid_argument("request " + std::to_string(i) + " of the batch maps to recurrent slot " +
                                    std::to_string(s) + ", which is not allocated in the pool");
    }
  };

  // The input as contiguous fp32 rows: the caller's memory when it is so, else a converted copy.
  std::vector<float> xbuf;
  const float* xin = nullptr;
  if (x.dtype == DType::F32 && x.contiguous()) {
    xin = x.ptr<float>();
  } else {
    xbuf.resize(static_cast<size_t>(T * D));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t off = t * x.strides[0] + d * x.strides[1];
        xbuf[t * D + d] = x.dtype == DType::F32 ? x.ptr<float>()[off] : bf16_to_f32(x.ptr<bf16_t>()[off]);
      }
    xin = xbuf.data();
  }

  // The output in the input's kind and dtype; fp32 outputs are written in place.
  py::object out;
  float* yout = nullptr;
  std::vector<float> ybuf;
  if (x.is_torch) {
    out = torch_empty(T, D, x.dtype == DType::F32 ? "float32" : "bfloat16");
  } else {
    out = py::array_t<float>(std::vector<py::ssize_t>{T, D});
  }
  TensorView y = as_tensor(out, "out");
  if (x.dtype == DType::F32) {
    yout = y.ptr<float>();
  } else {
    ybuf.resize(static_cast<size_t>(T * D));
    yout = ybuf.data();
  }
  {
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> backend_lock;
    if (backend) backend_lock = std::unique_lock<std::mutex>(backend->mu);
    const std::lock_guard<std::mutex> layer_lock(self.mu);
    check_metadata();
    layer.forward(xin, T, fb, pool, yout);
    if (x.dtype == DType::BF16) f32_to_bf16_array(ybuf.data(), y.ptr<bf16_t>(), ybuf.size());
  }
  return out;
}

std::string config_repr(const KimiLinearConfig& c) {
  std::ostringstream s;
  s << "KimiLinearConfig(hidden_size=" << c.hidden_size << ", num_hidden_layers=" << c.num_hidden_layers
    << ", num_heads=" << c.num_heads << ", head_dim=" << c.head_dim
    << ", short_conv_kernel_size=" << c.short_conv_kernel_size << ", rms_norm_eps=" << c.rms_norm_eps
    << ", kda_layers=" << join(std::vector<int32_t>(c.kda_layers.begin(), c.kda_layers.end()))
    << ", full_attn_layers="
    << join(std::vector<int32_t>(c.full_attn_layers.begin(), c.full_attn_layers.end())) << ")";
  return s.str();
}

std::shared_ptr<PyLayer> layer_from_pretrained(const fs::path& path, int layer_idx,
                                               const std::string& precision,
                                               std::optional<KimiLinearConfig> config,
                                               std::shared_ptr<io::Checkpoint> checkpoint,
                                               const std::string& weights) {
  const Precision p = precision_of(precision);
  const Weights wts = parse_weights(weights);
  auto r = std::make_shared<PyLayer>();
  r->cfg = config ? *config : io::load_config(path);
  r->checkpoint = checkpoint ? std::move(checkpoint) : std::make_shared<io::Checkpoint>(path);
  py::gil_scoped_release release;
  r->layer = models::KimiDeltaAttention::from_checkpoint(*r->checkpoint, r->cfg, layer_idx, p, {}, wts);
  return r;
}

}  // namespace

void register_component(py::module_& m) {
  // ---- config and checkpoint ----
  py::class_<KimiLinearConfig>(m, "KimiLinearConfig",
                               "The fields of a Kimi-Linear config.json a KDA layer needs (lists 1-based).")
      .def_static(
          "from_pretrained", [](const fs::path& p) { return io::load_config(p); }, py::arg("path"),
          "Reads <path>/config.json (or the file itself).")
      .def_readonly("hidden_size", &KimiLinearConfig::hidden_size)
      .def_readonly("rms_norm_eps", &KimiLinearConfig::rms_norm_eps)
      .def_readonly("num_hidden_layers", &KimiLinearConfig::num_hidden_layers)
      .def_readonly("num_heads", &KimiLinearConfig::num_heads)
      .def_readonly("head_dim", &KimiLinearConfig::head_dim)
      .def_readonly("short_conv_kernel_size", &KimiLinearConfig::short_conv_kernel_size)
      .def_readonly("kda_layers", &KimiLinearConfig::kda_layers)
      .def_readonly("full_attn_layers", &KimiLinearConfig::full_attn_layers)
      .def_property_readonly("projection_size", &KimiLinearConfig::projection_size)
      .def("is_kda_layer", &KimiLinearConfig::is_kda_layer, py::arg("layer_idx"))
      .def("kda_layer_ids", &KimiLinearConfig::kda_layer_ids, "0-based KDA decoder layer ids, ascending.")
      .def("__repr__", &config_repr);

  py::class_<io::Checkpoint, std::shared_ptr<io::Checkpoint>>(
      m, "Checkpoint", "A memory-mapped safetensors checkpoint (a directory, an index, or one file).")
      .def(py::init<const fs::path&>(), py::arg("path"))
      .def("contains", &io::Checkpoint::contains, py::arg("name"));

  // ---- forward mode, batch, backend ----
  py::enum_<ForwardMode>(m, "ForwardMode")
      .value("EXTEND", ForwardMode::EXTEND)
      .value("DECODE", ForwardMode::DECODE)
      .value("IDLE", ForwardMode::IDLE)
      .value("DUMMY_FIRST", ForwardMode::DUMMY_FIRST)
      .value("DRAFT_EXTEND", ForwardMode::DRAFT_EXTEND)
      .value("TARGET_VERIFY", ForwardMode::TARGET_VERIFY)
      .def("is_extend", [](ForwardMode f) { return f == ForwardMode::EXTEND; })
      .def("is_decode", [](ForwardMode f) { return f == ForwardMode::DECODE; });

  py::class_<LinearRecurrentAttnBackendMetadata>(
      m, "LinearRecurrentAttnBackendMetadata",
      "Per-batch metadata of a linear-attention backend (KDAAttnBackendMetadata in the RFC).")
      .def_readonly("cu_q_lens", &LinearRecurrentAttnBackendMetadata::cu_q_lens)
      .def_readonly("recurrent_indices", &LinearRecurrentAttnBackendMetadata::recurrent_indices)
      .def_property_readonly("has_initial_state",
                             [](const LinearRecurrentAttnBackendMetadata& md) {
                               return std::vector<bool>(md.has_initial_state.begin(),
                                                        md.has_initial_state.end());
                             })
      .def_readonly("forward_mode", &LinearRecurrentAttnBackendMetadata::forward_mode)
      .def_property_readonly("num_tokens", &LinearRecurrentAttnBackendMetadata::num_tokens)
      .def("__repr__", [](const LinearRecurrentAttnBackendMetadata& md) {
        return std::string("LinearRecurrentAttnBackendMetadata(forward_mode=") + to_string(md.forward_mode) +
               ", cu_q_lens=" + join(md.cu_q_lens) + ", recurrent_indices=" + join(md.recurrent_indices) +
               ")";
      });
  m.attr("KDAAttnBackendMetadata") = m.attr("LinearRecurrentAttnBackendMetadata");

  py::class_<PyBackend, std::shared_ptr<PyBackend>>(
      m, "KDAAttnBackend",
      "The KDA linear-attention backend: one instance per model runner, shared by every KDA layer. "
      "Holds no weights and no pool; its forward metadata is computed once per batch.")
      .def(py::init([](const std::string& kernel) {
             return std::make_shared<PyBackend>(kernels::parse_kernel_impl(kernel));
           }),
           py::arg("kernel") = "auto",
           "kernel: 'auto' (optimized, falling back to the reference), 'naive', "
           "'optimized'.")
      .def_property_readonly("kernel", [](const PyBackend& b) { return kernels::to_string(b.be.kernel()); })
      .def(
          "get_forward_metadata",
          [](const PyBackend& b, const PyForwardBatch& fb, const py::object& idx) {
            return b.be.get_forward_metadata(fb.fb, recurrent_indices_of(fb, idx));
          },
          py::arg("forward_batch"), py::arg("recurrent_indices"),
          "The batch's metadata, without storing it. recurrent_indices: [B] slots, or a MemoryPools / "
          "HybridReqToTokenPool whose get_recurrent_indices(req_pool_indices) gives them.")
      .def(
          "init_forward_metadata",
          [](const std::shared_ptr<PyBackend>& b, PyForwardBatch& fb, const py::object& idx) {
            const auto indices = recurrent_indices_of(fb, idx);
            {
              py::gil_scoped_release release;  // a forward on this backend may hold its lock
              const std::lock_guard<std::mutex> lock(b->mu);
              b->be.init_forward_metadata(fb.fb, indices);
            }
            fb.set_backend(b);
          },
          py::arg("forward_batch"), py::arg("recurrent_indices"),
          "Per batch, before the first layer: stores the metadata and sets forward_batch.attn_backend to "
          "this backend. recurrent_indices as in get_forward_metadata.")
      .def(
          "accept",
          [](PyBackend& b, const PyForwardBatch& fb, const py::object& accepted, const py::object& pools) {
            const auto acc = to_i32(accepted, "accepted");
            RecurrentStatePool& pool = pool_of(pools);
            py::gil_scoped_release release;
            const std::lock_guard<std::mutex> lock(b.mu);
            b.be.accept(fb.fb, acc, pool);
          },
          py::arg("forward_batch"), py::arg("accepted"), py::arg("pools"),
          "After a TARGET_VERIFY forward of every KDA layer: accepted[i] is the row position (0..d_i) of row "
          "i's last accepted token (a chain: the number of accepted drafts; a tree: the accepted path is "
          "that token's ancestors). Each request's slot then holds the state after its accepted tokens, "
          "every layer, recurrent and conv, with no layer pass. Bad input: ValueError, nothing changed.")
      .def_property_readonly("has_pending_verify",
                             [](const PyBackend& b) { return b.be.has_pending_verify(); })
      .def_property_readonly("forward_metadata", [](PyBackend& b) {
        py::gil_scoped_release release;
        const std::lock_guard<std::mutex> lock(b.mu);
        return b.be.forward_metadata();  // a copy
      });

  py::class_<StateSnapshot>(m, "StateSnapshot",
                            "An interior state to keep in an EXTEND (ForwardBatch.state_snapshots): after "
                            "the first `pos` tokens of batch row `row`'s segment, into pool slot `slot`.")
      .def(py::init([](int32_t row, int32_t pos, int32_t slot) {
             return StateSnapshot{row, pos, slot};
           }),
           py::arg("row"), py::arg("pos"), py::arg("slot"))
      .def_readonly("row", &StateSnapshot::row)
      .def_readonly("pos", &StateSnapshot::pos)
      .def_readonly("slot", &StateSnapshot::slot)
      .def(
          "__eq__",
          [](const StateSnapshot& a, const StateSnapshot& b) {
            return a.row == b.row && a.pos == b.pos && a.slot == b.slot;
          },
          py::is_operator())
      .def("__repr__", &snapshot_repr);

  py::class_<PyForwardBatch>(m, "ForwardBatch",
                             "What one model step runs: per request (in token order) its req_pool_index "
                             "(-1: padded row), its tokens this step and its tokens before.")
      .def(py::init([](ForwardMode mode, const py::object& reqs, const py::object& seq_lens,
                       const py::object& prefix_lens) {
             PyForwardBatch b;
             b.fb.forward_mode = mode;
             b.fb.req_pool_indices = to_i32(reqs, "req_pool_indices");
             if (!seq_lens.is_none()) b.fb.extend_seq_lens = to_i32(seq_lens, "extend_seq_lens");
             if (!prefix_lens.is_none()) b.fb.extend_prefix_lens = to_i32(prefix_lens, "extend_prefix_lens");
             b.fb.validate();
             return b;
           }),
           py::arg("forward_mode"), py::arg("req_pool_indices"), py::arg("extend_seq_lens") = py::none(),
           py::arg("extend_prefix_lens") = py::none())
      .def_static(
          "extend",
          [](const py::object& reqs, const py::object& seq_lens, const py::object& prefix_lens,
             const py::object& snapshots) {
            PyForwardBatch b;
            auto r = to_i32(reqs, "req_pool_indices");
            auto s = to_i32(seq_lens, "extend_seq_lens");
            auto p = prefix_lens.is_none() ? std::vector<int32_t>(r.size(), 0)
                                           : to_i32(prefix_lens, "extend_prefix_lens");
            b.fb = ForwardBatch::extend(std::move(r), std::move(s), std::move(p));
            b.fb.state_snapshots = to_snapshots(snapshots);
            b.fb.validate();
            return b;
          },
          py::arg("req_pool_indices"), py::arg("extend_seq_lens"), py::arg("extend_prefix_lens") = py::none(),
          py::arg("state_snapshots") = py::none(),
          "An EXTEND (prefill) batch; extend_prefix_lens defaults to zeros (fresh requests). "
          "state_snapshots: "
          "interior states to keep (prefix caching), as the property.")
      .def_static(
          "decode",
          [](const py::object& reqs) {
            PyForwardBatch b;
            b.fb = ForwardBatch::decode(to_i32(reqs, "req_pool_indices"));
            b.fb.validate();
            return b;
          },
          py::arg("req_pool_indices"), "A DECODE batch: one token per request.")
      .def_static(
          "target_verify",
          [](const py::object& reqs, const py::object& draft_lens, const py::object& draft_parents) {
            PyForwardBatch b;
            b.fb = ForwardBatch::target_verify(
                to_i32(reqs, "req_pool_indices"), to_i32(draft_lens, "draft_lens"),
                draft_parents.is_none() ? std::vector<int32_t>{} : to_i32(draft_parents, "draft_parents"));
            b.fb.validate();
            return b;
          },
          py::arg("req_pool_indices"), py::arg("draft_lens"), py::arg("draft_parents") = py::none(),
          "A TARGET_VERIFY batch: row i is the request's last accepted token and its draft_lens[i] drafts. "
          "draft_parents (tree drafts): each draft's parent among its row's drafts, -1 for the last accepted "
          "token, row after row; None: chains. Then KDAAttnBackend.accept(batch, accepted, pools).")
      .def_property_readonly("draft_parents", [](const PyForwardBatch& b) { return b.fb.draft_parents; })
      .def_property(
          "state_snapshots", [](const PyForwardBatch& b) { return b.fb.state_snapshots; },
          [](PyForwardBatch& b, const py::object& v) { set_snapshots(b, to_snapshots(v)); },
          "EXTEND only: StateSnapshot(row, pos, slot) (or (row, pos, slot) triples) -- after the first pos "
          "tokens of batch row `row`'s segment, every KDA layer's recurrent and conv state of that request "
          "is "
          "written into pool slot `slot` (allocated by the caller, e.g. RadixCache.reserve, and no slot of "
          "this batch). Set it before init_forward_metadata; reading it gives a copy (StateSnapshot is "
          "immutable: "
          "assign a new list). A bad list: ValueError, the batch unchanged.")
      .def_property(
          "forward_mode", [](const PyForwardBatch& b) { return b.fb.forward_mode; },
          [](PyForwardBatch& b, ForwardMode m) { b.fb.forward_mode = m; })
      .def_property(
          "req_pool_indices", [](const PyForwardBatch& b) { return b.fb.req_pool_indices; },
          [](PyForwardBatch& b, const py::object& v) {
            b.fb.req_pool_indices = to_i32(v, "req_pool_indices");
          })
      .def_property(
          "extend_seq_lens", [](const PyForwardBatch& b) { return b.fb.extend_seq_lens; },
          [](PyForwardBatch& b, const py::object& v) { b.fb.extend_seq_lens = to_i32(v, "extend_seq_lens"); })
      .def_property(
          "extend_prefix_lens", [](const PyForwardBatch& b) { return b.fb.extend_prefix_lens; },
          [](PyForwardBatch& b, const py::object& v) {
            b.fb.extend_prefix_lens = to_i32(v, "extend_prefix_lens");
          })
      .def_property(
          "attn_backend", [](const PyForwardBatch& b) { return b.backend; },
          [](PyForwardBatch& b, std::shared_ptr<PyBackend> be) { b.set_backend(std::move(be)); })
      .def_property_readonly("batch_size", [](const PyForwardBatch& b) { return b.fb.batch_size(); })
      .def_property_readonly("num_tokens", [](const PyForwardBatch& b) { return b.fb.num_tokens(); })
      .def("validate", [](const PyForwardBatch& b) { b.fb.validate(); })
      .def("__repr__", [](const PyForwardBatch& b) {
        return std::string("ForwardBatch(forward_mode=") + to_string(b.fb.forward_mode) +
               ", req_pool_indices=" + join(b.fb.req_pool_indices) +
               ", extend_seq_lens=" + join(b.fb.extend_seq_lens) +
               ", extend_prefix_lens=" + join(b.fb.extend_prefix_lens) +
               snapshots_repr(b.fb.state_snapshots) + ")";
      });

  // ---- pools ----
  py::class_<RecurrentStatePoolConfig>(m, "RecurrentStatePoolConfig")
      .def(py::init([](std::vector<int> layer_ids, int64_t size, int num_heads, int head_k_dim,
                       int head_v_dim, int conv_kernel, int64_t conv_dim, const std::string& conv_dtype) {
             RecurrentStatePoolConfig c;
             c.layer_ids = std::move(layer_ids);
             c.size = size;
             c.num_heads = num_heads;
             c.head_k_dim = head_k_dim;
             c.head_v_dim = head_v_dim;
             c.conv_kernel = conv_kernel;
             c.conv_dim = conv_dim;
             c.conv_dtype = precision_of(conv_dtype);
             return c;
           }),
           py::arg("layer_ids"), py::arg("size"), py::arg("num_heads"), py::arg("head_k_dim"),
           py::arg("head_v_dim"), py::arg("conv_kernel"), py::arg("conv_dim"), py::arg("conv_dtype") = "fp32")
      .def_static("from_config", &pool_config_for, py::arg("config"), py::arg("size"),
                  py::arg("precision") = "fp32", py::arg("layer_ids") = py::none(),
                  "Every KDA layer of the model (or layer_ids), `size` slots, the conv dtype of the "
                  "layers' precision.")
      .def_readwrite("layer_ids", &RecurrentStatePoolConfig::layer_ids)
      .def_readwrite("size", &RecurrentStatePoolConfig::size)
      .def_readwrite("num_heads", &RecurrentStatePoolConfig::num_heads)
      .def_readwrite("head_k_dim", &RecurrentStatePoolConfig::head_k_dim)
      .def_readwrite("head_v_dim", &RecurrentStatePoolConfig::head_v_dim)
      .def_readwrite("conv_kernel", &RecurrentStatePoolConfig::conv_kernel)
      .def_readwrite("conv_dim", &RecurrentStatePoolConfig::conv_dim)
      .def_readwrite("max_verify_tokens", &RecurrentStatePoolConfig::max_verify_tokens,
                     "Speculative decoding: tokens per verify row (d_max + 1); 0: no verify buffer.")
      .def_readwrite("verify_rows", &RecurrentStatePoolConfig::verify_rows,
                     "Rows of a verify batch (0: size, one per request slot).")
      .def_property(
          "conv_dtype",
          [](const RecurrentStatePoolConfig& c) { return std::string(to_string(c.conv_dtype)); },
          [](RecurrentStatePoolConfig& c, const std::string& s) { c.conv_dtype = precision_of(s); });

  py::class_<RecurrentStatePool>(
      m, "RecurrentStatePool",
      "Per-request slots of every KDA layer's recurrent state [L, N+1, H, K, V] fp32 and conv state "
      "[L, N+1, W-1, C]; slot 0 is reserved.")
      .def(py::init<const RecurrentStatePoolConfig&>(), py::arg("config"))
      .def_property_readonly("config", [](const RecurrentStatePool& p) { return p.config(); })
      .def_property_readonly("size", &RecurrentStatePool::size)
      .def_property_readonly("available", &RecurrentStatePool::available)
      .def_property_readonly("num_layers", &RecurrentStatePool::num_layers)
      .def_property_readonly("bytes", &RecurrentStatePool::bytes)
      .def_property_readonly("bytes_per_slot", &RecurrentStatePool::bytes_per_slot,
                             "One slot's states, every layer (what a RadixCache snapshot takes).")
      .def_property_readonly("spec_state_bytes", &RecurrentStatePool::spec_state_bytes,
                             "The verify buffer (speculative decoding), every layer.")
      .def("alloc", &RecurrentStatePool::alloc, py::arg("n"),
           "n cleared slots, all or nothing (RuntimeError when exhausted).")
      .def(
          "free", [](RecurrentStatePool& p, const py::object& s) { p.free(to_i32(s, "slots")); },
          py::arg("slots"))
      .def("is_allocated", &RecurrentStatePool::is_allocated, py::arg("slot"))
      .def("copy_slot", &RecurrentStatePool::copy_slot, py::arg("src"), py::arg("dst"),
           "Every layer's states of src into dst.")
      .def(
          "recurrent_state",
          [](py::object self, int layer_id) {
            return recurrent_view(self.cast<RecurrentStatePool&>(), layer_id, self);
          },
          py::arg("layer_id"),
          "Layer layer_id's recurrent buffer [N+1, H, K, V] float32, a NumPy view of the pool's memory.")
      .def(
          "conv_state",
          [](py::object self, int layer_id) {
            return conv_view(self.cast<RecurrentStatePool&>(), layer_id, self);
          },
          py::arg("layer_id"),
          "Layer layer_id's conv buffer [N+1, W-1, C], a NumPy view of the pool's memory: float32, or "
          "uint16 holding the bf16 bits when the conv dtype is bf16 (conv_state_tensor gives "
          "torch.bfloat16).")
      .def(
          "set_linear_recurrent_layer_cache",
          [](RecurrentStatePool& p, int layer_id, const py::object& slots, const py::object& recurrent,
             const py::object& conv) {
            const auto s = to_i32(slots, "slots");
            const auto& c = p.config();
            const int64_t n = static_cast<int64_t>(s.size());
            std::vector<TensorView> keep;
            const float* r =
                f32_block(recurrent, "recurrent", {n, c.num_heads, c.head_k_dim, c.head_v_dim}, keep);
            const float* v = f32_block(conv, "conv", {n, c.conv_kernel - 1, c.conv_dim}, keep);
            p.set_linear_recurrent_layer_cache(layer_id, s, r, v);
          },
          py::arg("layer_id"), py::arg("slots"), py::arg("recurrent") = py::none(),
          py::arg("conv") = py::none(),
          "Writes float32 states [n, H, K, V] / [n, W-1, C] into the slots (conv rounded to bf16 when the "
          "buffer is bf16); None leaves that buffer as it is.")
      .def(
          "read_linear_recurrent_layer_cache",
          [](const RecurrentStatePool& p, int layer_id, const py::object& slots) {
            const auto s = to_i32(slots, "slots");
            const auto& c = p.config();
            const py::ssize_t n = static_cast<py::ssize_t>(s.size());
            py::array_t<float> r(std::vector<py::ssize_t>{n, c.num_heads, c.head_k_dim, c.head_v_dim});
            py::array_t<float> v(std::vector<py::ssize_t>{n, c.conv_kernel - 1, c.conv_dim});
            p.read_linear_recurrent_layer_cache(layer_id, s, r.mutable_data(), v.mutable_data());
            return py::make_tuple(r, v);
          },
          py::arg("layer_id"), py::arg("slots"), "(recurrent [n, H, K, V], conv [n, W-1, C]) float32 copies.")
      .def("__repr__", [](const RecurrentStatePool& p) {
        const auto& c = p.config();
        return "RecurrentStatePool(size=" + std::to_string(c.size) +
               ", available=" + std::to_string(p.available()) +
               ", layer_ids=" + join(std::vector<int32_t>(c.layer_ids.begin(), c.layer_ids.end())) +
               ", heads=" + std::to_string(c.num_heads) + ", head_dim=" + std::to_string(c.head_k_dim) +
               ", conv_dtype=" + to_string(c.conv_dtype) + ")";
      });

  py::class_<HybridReqToTokenPool>(m, "HybridReqToTokenPool",
                                   "Request index -> recurrent slot; a request keeps its slot until freed.")
      .def(py::init<int64_t, RecurrentStatePool&>(), py::arg("max_requests"), py::arg("recurrent_pool"),
           py::keep_alive<1, 3>())
      .def_property_readonly("size", &HybridReqToTokenPool::size)
      .def_property_readonly("available", &HybridReqToTokenPool::available)
      .def("alloc", &HybridReqToTokenPool::alloc, py::arg("n"),
           "n request indices, each bound to a fresh cleared slot; all or nothing.")
      .def(
          "free", [](HybridReqToTokenPool& p, const py::object& r) { p.free(to_i32(r, "req_pool_indices")); },
          py::arg("req_pool_indices"))
      .def("fork", &HybridReqToTokenPool::fork, py::arg("parent_req_pool_index"),
           "A new request whose state is a copy of the parent's.")
      .def(
          "get_recurrent_indices",
          [](const HybridReqToTokenPool& p, const py::object& r) {
            return p.get_recurrent_indices(to_i32(r, "req_pool_indices"));
          },
          py::arg("req_pool_indices"), "Slot per request index; -1 stays -1 (padded row).")
      .def("slot_of", &HybridReqToTokenPool::slot_of, py::arg("req_pool_index"))
      .def("seq_len", &HybridReqToTokenPool::seq_len, py::arg("req_pool_index"),
           "Tokens the request has run so far (a model step's extend_prefix_lens for it).")
      .def(
          "req_to_token",
          [](const HybridReqToTokenPool& p, int32_t r) {
            const auto s = p.req_to_token(r);
            return std::vector<int32_t>(s.begin(), s.end());
          },
          py::arg("req_pool_index"),
          "The request's MLA token slots in position order (empty without an MLA KV pool).")
      .def_property_readonly(
          "kv_tokens_available",
          [](const HybridReqToTokenPool& p) -> int64_t {
            return p.token_to_kv_pool() ? p.token_to_kv_pool()->available() : 0;
          },
          "Free MLA token slots (0 without an MLA KV pool).")
      .def_property_readonly(
          "recurrent_pool", [](HybridReqToTokenPool& p) -> RecurrentStatePool& { return p.recurrent_pool(); },
          py::return_value_policy::reference_internal);

  py::class_<MemoryPools>(m, "MemoryPools", "The pools a model runner holds (the RFC's memory_pool).")
      .def(py::init<const RecurrentStatePoolConfig&, int64_t>(), py::arg("config"), py::arg("max_requests"))
      .def_static(
          "from_config",
          [](const KimiLinearConfig& cfg, int64_t size, const std::string& precision,
             std::optional<int64_t> max_requests, std::optional<std::vector<int>> layer_ids,
             int max_verify_tokens) {
            auto pc = pool_config_for(cfg, size, precision, std::move(layer_ids));
            pc.max_verify_tokens = max_verify_tokens;
            return std::make_unique<MemoryPools>(pc, max_requests.value_or(size));
          },
          py::arg("config"), py::arg("size"), py::arg("precision") = "fp32",
          py::arg("max_requests") = py::none(), py::arg("layer_ids") = py::none(),
          py::arg("max_verify_tokens") = 0,
          "Pools for every KDA layer of the model (or layer_ids): `size` slots, max_requests (default size) "
          "request indices, the conv dtype of the layers' precision.")
      .def_property_readonly(
          "recurrent_state_pool",
          [](MemoryPools& p) -> RecurrentStatePool& { return p.recurrent_state_pool; },
          py::return_value_policy::reference_internal)
      .def_property_readonly(
          "req_to_token_pool", [](MemoryPools& p) -> HybridReqToTokenPool& { return p.req_to_token_pool; },
          py::return_value_policy::reference_internal);

  // ---- the layer ----
  py::class_<PyLayer, std::shared_ptr<PyLayer>>(m, "KimiDeltaAttention",
                                                "One KDA layer of Kimi-Linear (models/kimi_linear).")
      .def_static("from_pretrained", &layer_from_pretrained, py::arg("path"), py::arg("layer"),
                  py::arg("precision") = "fp32", py::arg("config") = py::none(),
                  py::arg("checkpoint") = py::none(), py::arg("weights") = "bf16",
                  "Decoder layer `layer` (0-based, a KDA layer) of the checkpoint at `path` (config.json and "
                  "model.safetensors or its index), memory-mapped; precision 'fp32' or 'bf16'. A Checkpoint "
                  "passed in is shared (several layers, one mapping). weights: 'bf16' (the precision's dense "
                  "weights), 'int8' (per output channel) or 'int4' (groups of 32): the projections quantized "
                  "at load.")
      .def("__call__", &layer_call, py::arg("hidden_states"), py::arg("forward_batch"), py::arg("pools"),
           "hidden_states [T, D] (torch float32 / bfloat16 or NumPy float32) -> out [T, D] of the same kind "
           "and dtype. The layer's states in `pools` (MemoryPools or RecurrentStatePool) are read and "
           "written in place at the slots of the batch's backend metadata.")
      .def("forward", &layer_call, py::arg("hidden_states"), py::arg("forward_batch"), py::arg("pools"))
      .def_property_readonly("layer_idx", [](const PyLayer& l) { return l.layer->layer_idx(); })
      .def_property_readonly("layer_id", [](const PyLayer& l) { return l.layer->layer_idx(); })
      .def_property_readonly("precision",
                             [](const PyLayer& l) { return std::string(to_string(l.layer->precision())); })
      .def_property_readonly("weights",
                             [](const PyLayer& l) { return std::string(to_string(l.layer->weights())); })
      .def_property_readonly("weight_bytes", [](const PyLayer& l) { return l.layer->weight_bytes(); })
      .def_property_readonly("hidden_size", [](const PyLayer& l) { return l.layer->hidden_size(); })
      .def_property_readonly("num_heads", [](const PyLayer& l) { return l.layer->local_heads(); })
      .def_property_readonly("head_dim", [](const PyLayer& l) { return l.cfg.head_dim; })
      .def_property_readonly("config", [](const PyLayer& l) { return l.cfg; })
      .def_property_readonly("checkpoint", [](const PyLayer& l) { return l.checkpoint; })
      .def("__repr__", [](const PyLayer& l) {
        return "KimiDeltaAttention(layer_idx=" + std::to_string(l.layer->layer_idx()) +
               ", precision=" + to_string(l.layer->precision()) +
               ", weights=" + to_string(l.layer->weights()) +
               ", hidden_size=" + std::to_string(l.layer->hidden_size()) +
               ", num_heads=" + std::to_string(l.layer->local_heads()) +
               ", head_dim=" + std::to_string(l.cfg.head_dim) +
               ", conv=" + std::to_string(l.cfg.short_conv_kernel_size) + ")";
      });
}

}  // namespace kda::python
