#include <cstdio>
#include <stdexcept>

#include "kda/cli/commands.h"
#include "kda/distributed/parallel.h"
#include "kda/io/config.h"
#include "kda/io/npy.h"
#include "kda/io/safetensors.h"
#include "kda/models/kimi_linear_case.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/models/kimi_moe.h"
#include "kda/runtime/layer_runner.h"
#include "kda/runtime/model_case.h"

namespace kda::cli {

namespace {

// One KDA layer of the checkpoint on a layer case (hidden_states in, the layer's output and states out).
int run_layer(const RunOptions& o) {
  const auto cfg = io::load_config(o.model);
  models::check_tensor_parallel(cfg, o.tp);
  const auto precision = parse_precision(o.precision);
  const auto weights = parse_weights(o.weights);
  const auto kernel = kernels::parse_kernel_impl(o.kernel);
  const auto c = runtime::LayerCase::from_npz(io::read_npz(o.input), cfg);
  auto par = distributed::make_parallel_context(o.tp, 1);
  const io::Checkpoint ckpt(o.model);
  // Each rank loads only its shard; every rank ends with the whole output and states.
  auto layer = models::KimiDeltaAttention::from_checkpoint(ckpt, cfg, o.layer, precision,
                                                           par.tensor_parallel(), weights);
  const auto r = runtime::run_layer_case(*layer, cfg, c, o.decode_tail, kernel);
  if (!par.is_root()) return 0;

  const int64_t H = cfg.num_heads, K = cfg.head_dim, W = cfg.short_conv_kernel_size,
                P = cfg.projection_size();
  io::NpzArchive out;
  out["out"] = io::NpyArray::from_f32({c.T, c.D}, r.out.data());
  out["recurrent_state"] = io::NpyArray::from_f32({c.N, H, K, K}, r.recurrent_state.data());
  out["conv_state"] = io::NpyArray::from_f32({c.N, W - 1, 3 * P}, r.conv_state.data());
  io::write_npz(o.output, out);
  std::printf(
      "kda run: layer %d, %lld tokens in %lld sequences (%s, %s weights, decode tail %d, tp %d) -> %s\n",
      o.layer, static_cast<long long>(c.T), static_cast<long long>(c.N), o.precision.c_str(),
      o.weights.c_str(), o.decode_tail, o.tp, o.output.c_str());
  return 0;
}

// The whole model on a token case: every sequence starts empty; one EXTEND of each sequence's tokens but
// its last decode_tail, then those as single-token DECODE steps. Every option and the whole case are
// checked before the model is loaded, so a bad input costs no load and writes nothing.
int run_tokens(const RunOptions& o) {
  const auto cfg = io::load_model_config(o.model);
  models::ModelOptions mo;
  mo.precision = parse_precision(o.precision);
  mo.weights = parse_weights(o.weights);
  mo.moe_combine = models::parse_moe_combine(o.moe_combine);
  mo.kernel = kernels::parse_kernel_impl(o.kernel);
  const auto c = runtime::TokenCase::from_npz(io::read_npz(o.tokens), cfg, o.tokens);
  c.check_decode_tail(o.decode_tail);
  auto par = distributed::make_parallel_context(o.tp, 1);
  mo.tp = par.tensor_parallel();
  auto model = models::KimiLinearForCausalLM::from_pretrained(o.model, mo);
  models::ModelCaseOptions co;
  co.decode_tail = o.decode_tail;
  auto r = models::run_model_case(*model, c.input_ids, c.cu_seqlens, co);
  runtime::gather_kda_states(r, cfg, mo.tp);  // every rank takes part; rank 0 writes
  if (!par.is_root()) return 0;
  io::write_npz(o.output, runtime::model_case_archive(r, cfg, model->vocab_size()));
  std::printf(
      "kda run: %d layers, %lld tokens in %lld sequences (%s, %s weights, moe %s, decode tail %d, tp %d) -> "
      "%s\n",
      model->num_layers(), static_cast<long long>(c.T), static_cast<long long>(c.N), o.precision.c_str(),
      o.weights.c_str(), o.moe_combine.c_str(), o.decode_tail, o.tp, o.output.c_str());
  return 0;
}

}  // namespace

int run_run(const RunOptions& o) {
  if (!o.tokens.empty()) return run_tokens(o);
  if (o.layer < 0 || o.input.empty())
    throw std::invalid_argument(
        "kda run needs --tokens CASE.npz (the whole model) or --layer N and --input CASE.npz (one KDA "
        "layer)");
  return run_layer(o);
}

}  // namespace kda::cli
