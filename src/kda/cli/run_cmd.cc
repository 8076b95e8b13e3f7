#include <cstdio>

#include "kda/cli/commands.h"
#include "kda/distributed/parallel.h"
#include "kda/io/config.h"
#include "kda/io/npy.h"
#include "kda/io/safetensors.h"
#include "kda/runtime/layer_runner.h"

namespace kda::cli {

int run_run(const RunOptions& o) {
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

}  // namespace kda::cli
