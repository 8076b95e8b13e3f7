// kda.KimiLinearForCausalLM: the whole decoder (models/kimi_linear_model.h), called like the KDA layer with
// a ForwardBatch and MemoryPools (make_pools gives pools with the model's KDA slots and MLA token slots),
// returning logits as a NumPy array that owns its buffer, written in place (torch input ids give a torch
// tensor over the same buffer, through torch.from_numpy).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "args.h"
#include "bindings.h"
#include "forward_batch.h"
#include "kda/common/precision.h"
#include "kda/common/weights.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/models/kimi_linear_case.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/models/kimi_moe.h"
#include "tensor.h"

namespace kda::python {

namespace {

namespace fs = std::filesystem;
using mem_cache::MemoryPools;
using models::KimiLinearForCausalLM;

// The model and a lock: the layers share the model's scratch, so one call at a time per model.
struct PyModel {
  std::mutex mu;
  std::unique_ptr<KimiLinearForCausalLM> model;
};

// Token ids: a 1-D int32 / int64 NumPy array or torch tensor, or a sequence of ints.
std::vector<int32_t> ids_of(const py::object& obj, bool& is_torch) {
  is_torch = false;
  if (!py::isinstance<py::array>(obj) && !py::hasattr(obj, "__dlpack__")) return to_i32(obj, "input_ids");
  const TensorView t = as_tensor(obj, "input_ids");
  is_torch = t.is_torch;
  expect_dtype(t, {DType::I32, DType::I64});
  expect_ndim(t, 1);
  std::vector<int32_t> v(static_cast<size_t>(t.shape[0]));
  for (int64_t i = 0; i < t.shape[0]; ++i) {
    const int64_t x =
        t.dtype == DType::I32 ? t.ptr<int32_t>()[i * t.strides[0]] : t.ptr<int64_t>()[i * t.strides[0]];
    if (x < INT32_MIN || x > INT32_MAX)
      throw py::value_error("'input_ids' holds " + std::to_string(x) + ", outside int32");
    v[static_cast<size_t>(i)] = static_cast<int32_t>(x);
  }
  return v;
}

MemoryPools& memory_pools_of(const py::handle& pools) {
  if (!py::isinstance<MemoryPools>(pools))
    throw py::type_error("'pools' must be a MemoryPools (KimiLinearForCausalLM.make_pools), got " +
                         std::string(py::str(py::type::handle_of(pools).attr("__name__"))));
  return pools.cast<MemoryPools&>();
}

py::array_t<float> f32_array(std::vector<py::ssize_t> shape) { return py::array_t<float>(std::move(shape)); }

py::object as_output(py::array_t<float> a, bool torch) {
  if (!torch) return std::move(a);
  return py::module_::import("torch").attr("from_numpy")(a);
}

// One step: hidden_final [T, D] of the batch's tokens, and (with_logits) logits [T, V].
py::object model_step(PyModel& self, const py::object& input_ids, const PyForwardBatch& batch,
                      const py::object& pools, bool with_logits) {
  apply_num_threads();
  bool torch = false;
  const std::vector<int32_t> ids = ids_of(input_ids, torch);
  MemoryPools& mp = memory_pools_of(pools);
  auto& m = *self.model;
  const int64_t T = static_cast<int64_t>(ids.size()), D = m.hidden_size(), V = m.vocab_size();
  // A copy of the batch: the model points it at its own backend when the caller gave none, which must not
  // outlive this call in the caller's batch.
  model_executor::ForwardBatch fb = batch.fb;
  if (!batch.backend) fb.attn_backend = nullptr;
  auto hidden = f32_array({T, D});
  py::array_t<float> logits;
  if (with_logits) logits = f32_array({T, V});
  float* h = hidden.mutable_data();
  float* l = with_logits ? logits.mutable_data() : nullptr;
  {
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> backend_lock;
    if (batch.backend) backend_lock = std::unique_lock<std::mutex>(batch.backend->mu);
    const std::lock_guard<std::mutex> lock(self.mu);
    m.forward(ids.data(), T, fb, mp, h);
    if (l) m.compute_logits(h, T, l);
  }
  return as_output(with_logits ? logits : hidden, torch);
}

py::object compute_logits(PyModel& self, const py::object& hidden) {
  apply_num_threads();
  auto& m = *self.model;
  TensorView x = as_tensor(hidden, "hidden");
  expect_dtype(x, {DType::F32});
  expect_ndim(x, 2);
  if (x.shape[1] != m.hidden_size() || !x.contiguous())
    throw py::value_error("'hidden' must be a contiguous [M, " + std::to_string(m.hidden_size()) +
                          "] float32 array, got " + x.shape_str());
  const int64_t M = x.shape[0];
  auto out = f32_array({M, m.vocab_size()});
  float* o = out.mutable_data();
  {
    py::gil_scoped_release release;
    const std::lock_guard<std::mutex> lock(self.mu);
    m.compute_logits(x.ptr<float>(), M, o);
  }
  return as_output(out, x.is_torch);
}

// A whole case in the model dumps' layout (models/kimi_linear_case.h), as a dict of NumPy arrays.
py::dict run_case(PyModel& self, const py::object& input_ids, const py::object& cu_seqlens, int decode_tail,
                  int prefill_chunks) {
  apply_num_threads();
  bool torch = false;
  const std::vector<int32_t> ids = ids_of(input_ids, torch);
  const std::vector<int32_t> cu =
      cu_seqlens.is_none() ? std::vector<int32_t>{} : to_i32(cu_seqlens, "cu_seqlens");
  models::ModelCaseOptions o;
  o.decode_tail = decode_tail;
  o.prefill_chunks = prefill_chunks;
  models::ModelCaseResult r;
  {
    py::gil_scoped_release release;
    const std::lock_guard<std::mutex> lock(self.mu);
    r = models::run_model_case(*self.model, ids, cu, o);
  }
  const auto& cfg = self.model->config();
  const py::ssize_t T = r.T, N = r.N, H = cfg.num_heads, K = cfg.head_dim, W = cfg.short_conv_kernel_size,
                    P = cfg.projection_size();
  py::dict d;
  const auto put = [&](const std::string& key, std::vector<py::ssize_t> shape, const std::vector<float>& v) {
    auto a = f32_array(std::move(shape));
    if (static_cast<size_t>(a.size()) != v.size())
      throw std::logic_error("run_case: '" + key + "' has " + std::to_string(v.size()) + " values");
    std::copy(v.begin(), v.end(), a.mutable_data());
    d[py::str(key)] = a;
  };
  put("logits", {T, self.model->vocab_size()}, r.logits);
  put("hidden_final", {T, cfg.hidden_size}, r.hidden_final);
  for (const auto& [id, v] : r.kda_recurrent_state)
    put("kda_recurrent_state_" + std::to_string(id), {N, H, K, K}, v);
  for (const auto& [id, v] : r.kda_conv_state)
    put("kda_conv_state_" + std::to_string(id), {N, W - 1, 3 * P}, v);
  for (const auto& [id, v] : r.mla_ckv) put("mla_ckv_" + std::to_string(id), {T, cfg.kv_lora_rank}, v);
  for (const auto& [id, v] : r.mla_kpe) put("mla_kpe_" + std::to_string(id), {T, cfg.qk_rope_head_dim}, v);
  return d;
}

std::shared_ptr<PyModel> from_pretrained(const fs::path& path, const std::string& precision,
                                         const std::string& weights, const std::string& moe_combine,
                                         const std::string& kernel, double kv_norm_eps) {
  models::ModelOptions o;
  o.precision = parse_precision(precision);
  o.weights = parse_weights(weights);
  o.moe_combine = models::parse_moe_combine(moe_combine);
  o.kernel = kernels::parse_kernel_impl(kernel);
  o.kv_norm_eps = kv_norm_eps;
  auto r = std::make_shared<PyModel>();
  py::gil_scoped_release release;
  r->model = KimiLinearForCausalLM::from_pretrained(path, o);
  return r;
}

}  // namespace

void register_model(py::module_& m) {
  py::class_<PyModel, std::shared_ptr<PyModel>>(
      m, "KimiLinearForCausalLM",
      "The whole Kimi-Linear decoder (embedding, KDA / MLA layers, dense MLP / MoE, final norm, LM head).")
      .def_static(
          "from_pretrained", &from_pretrained, py::arg("path"), py::arg("precision") = "fp32",
          py::arg("weights") = "bf16", py::arg("moe_combine") = "unbiased", py::arg("kernel") = "auto",
          py::arg("kv_norm_eps") = 0.0,
          "The checkpoint folder at `path` (config.json, safetensors shards + index). precision 'fp32' | "
          "'bf16'; weights 'bf16' (the precision's dense weights) | 'int8' | 'int4' for every projection, "
          "expert and dense-MLP weight; moe_combine 'unbiased' (vLLM, sglang) | 'biased' (the HF remote "
          "code); kv_norm_eps: kv_a_layernorm's eps (0: rms_norm_eps).")
      .def(
          "make_pools",
          [](const PyModel& self, int64_t max_requests, int64_t kv_tokens, int max_verify_tokens) {
            return self.model->make_pools(max_requests, kv_tokens, max_verify_tokens);
          },
          py::arg("max_requests"), py::arg("kv_tokens"), py::arg("max_verify_tokens") = 0,
          "MemoryPools for this model: max_requests request indices (each with a KDA slot of every KDA "
          "layer) and kv_tokens MLA token slots (every MLA layer's cache rows).")
      .def(
          "__call__",
          [](PyModel& s, const py::object& ids, const PyForwardBatch& fb, const py::object& pools) {
            return model_step(s, ids, fb, pools, true);
          },
          py::arg("input_ids"), py::arg("forward_batch"), py::arg("pools"),
          "One step over the batch's tokens (input_ids [T], T = forward_batch.num_tokens; allocate the "
          "requests with pools.req_to_token_pool.alloc first; each row's extend_prefix_lens is its tokens so "
          "far): logits [T, V] float32, a NumPy array (a torch tensor over the same memory when input_ids is "
          "a torch tensor). The requests' KDA states and MLA cache rows in `pools` move on.")
      .def(
          "forward",
          [](PyModel& s, const py::object& ids, const PyForwardBatch& fb, const py::object& pools) {
            return model_step(s, ids, fb, pools, false);
          },
          py::arg("input_ids"), py::arg("forward_batch"), py::arg("pools"),
          "As calling the model, but returns hidden_final [T, D] (the residual stream before model.norm).")
      .def("compute_logits", &compute_logits, py::arg("hidden"),
           "model.norm + lm_head on hidden [M, D] float32 -> logits [M, V].")
      .def("run_case", &run_case, py::arg("input_ids"), py::arg("cu_seqlens") = py::none(),
           py::arg("decode_tail") = 0, py::arg("prefill_chunks") = 1,
           "A whole case in pools of its own, every sequence starting empty (the model dumps' layout): "
           "{'logits', 'hidden_final', 'kda_recurrent_state_{i}', 'kda_conv_state_{i}', 'mla_ckv_{i}', "
           "'mla_kpe_{i}'} as NumPy arrays. decode_tail: each sequence's last tokens as DECODE steps.")
      .def_property_readonly("config", [](const PyModel& s) { return s.model->config(); })
      .def_property_readonly("precision",
                             [](const PyModel& s) { return std::string(to_string(s.model->precision())); })
      .def_property_readonly("weights",
                             [](const PyModel& s) { return std::string(to_string(s.model->weights())); })
      .def_property_readonly(
          "moe_combine",
          [](const PyModel& s) { return std::string(models::to_string(s.model->options().moe_combine)); })
      .def_property_readonly("vocab_size", [](const PyModel& s) { return s.model->vocab_size(); })
      .def_property_readonly("hidden_size", [](const PyModel& s) { return s.model->hidden_size(); })
      .def_property_readonly("num_layers", [](const PyModel& s) { return s.model->num_layers(); })
      .def_property_readonly("kda_layer_ids", [](const PyModel& s) { return s.model->kda_layer_ids(); })
      .def_property_readonly("mla_layer_ids", [](const PyModel& s) { return s.model->mla_layer_ids(); })
      .def_property_readonly("weight_bytes", [](const PyModel& s) { return s.model->weight_bytes(); })
      .def_property_readonly("active_params", [](const PyModel& s) { return s.model->active_params(); })
      .def("__repr__", [](const PyModel& s) {
        const auto& m = *s.model;
        return "KimiLinearForCausalLM(num_layers=" + std::to_string(m.num_layers()) +
               ", hidden_size=" + std::to_string(m.hidden_size()) +
               ", vocab_size=" + std::to_string(m.vocab_size()) + ", precision=" + to_string(m.precision()) +
               ", weights=" + to_string(m.weights()) +
               ", moe_combine=" + models::to_string(m.options().moe_combine) + ")";
      });
}

}  // namespace kda::python
