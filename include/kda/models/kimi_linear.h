// KimiDeltaAttention (models/kimi_linear): the KDA layer of Kimi-Linear, the 8-step forward of the spec
// (kda-numerics.md) in its fp32 and bf16 modes.
//
//   1. q/k/v, f_a, g_a and b projections: one fused GEMM over the concatenated weight
//   2. f = W_fb (W_fa x), z = W_gb (W_ga x)
//   3. RadixLinearAttention -> backend: short conv + silu, l2norm, gate, beta, chunk / recurrent kernel
//   4. gated RMS norm per head with sigmoid(z)
//   5. o_proj
//
// Thread safety: forward on one layer from several threads at once is safe when each call passes its own
// KdaWorkspace (and its own backend and batch; pools per the rules of memory_pool.h): the weights are only
// read and each projection locks its own matmul cache (layers::Linear), so those GEMMs take turns. With
// workspace == nullptr the layer's own workspace is used: such calls must not overlap.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kda/common/precision.h"
#include "kda/distributed/communicator.h"
#include "kda/io/config.h"
#include "kda/io/safetensors.h"
#include "kda/layers/linear.h"
#include "kda/layers/packed_linears.h"
#include "kda/layers/radix_linear_attention.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/model_executor/forward_batch_info.h"

namespace kda::models {

// Throws std::invalid_argument when `tp_size` ranks cannot split the config's heads evenly.
void check_tensor_parallel(const io::KimiLinearConfig& cfg, int tp_size);

// One layer's parameters as fp32 values in the checkpoint's shapes (P = H*K, D = hidden); a
// tensor-parallel shard holds H/n heads and P/n channels where the shapes below say H and P.
struct KdaLayerWeights {
  std::vector<float> q_proj, k_proj, v_proj;        // [P, D]
  std::vector<float> q_conv1d, k_conv1d, v_conv1d;  // [P, 1, W]
  std::vector<float> A_log;                         // [1, 1, H, 1]
  std::vector<float> dt_bias;                       // [P]
  std::vector<float> f_a_proj, g_a_proj;            // [K, D]
  std::vector<float> f_b_proj, g_b_proj;            // [P, K]
  std::vector<float> b_proj;                        // [H, D]
  std::vector<float> o_norm;                        // [K]
  std::vector<float> o_proj;                        // [D, P]
  // A packed checkpoint's projections (io/packed_checkpoint.h), by the names projections() gives them;
  // the fp32 projection values above are then empty.
  layers::PackedLinears packed;

  // Decoder layer `layer_idx` (0-based) of a checkpoint, keys model.layers.{i}.self_attn.*; every
  // shape checked against the config. A non-KDA layer is an error. With tensor parallelism, rank
  // tp_rank of tp_size reads only its shard (see shard()) from the memory-mapped checkpoint. A packed
  // checkpoint fills `packed` with views of its mapping (tp_size 1 only).
  static KdaLayerWeights load(const io::Checkpoint& ckpt, const io::KimiLinearConfig& cfg, int layer_idx,
                              int tp_rank = 0, int tp_size = 1);
  // Head-sharded tensor parallelism: rank r of n owns heads [r H/n, (r+1) H/n). q/k/v, f_b, g_b and b
  // are column-parallel (their output rows for those heads), the conv weights and dt_bias are sliced
  // to the rank's channels, A_log to its heads, f_a, g_a and o_norm are replicated, and o_proj is
  // row-parallel (its input columns for those channels; the partial outputs are summed across ranks).
  KdaLayerWeights shard(const io::KimiLinearConfig& cfg, int tp_rank, int tp_size) const;
  static KdaLayerWeights synthetic(const io::KimiLinearConfig& cfg, uint64_t seed);
};

// Scratch a layer needs per forward; one workspace can serve every layer of a model.
struct KdaWorkspace {
  std::vector<float> proj, f, z, o, y;
  // The bf16 mode's projections, f, z and o_norm output: bf16 values (rounding points), stored as bf16.
  std::vector<bf16_t> proj_bf16, f_bf16, z_bf16, y_bf16;
};

class KimiDeltaAttention {
 public:
  // `w` holds this rank's shard (the whole layer when tp.size == 1). `weights`: how the projections (the
  // fused q/k/v/f_a/g_a/b GEMM, f_b, g_b, o_proj) hold W -- the precision's dense weights, or int8 /
  // int4 quantized here, from this rank's shard only (layers/quant_linear.h); the rest is unchanged.
  KimiDeltaAttention(const io::KimiLinearConfig& cfg, int layer_idx, const KdaLayerWeights& w,
                     Precision precision, distributed::TensorParallel tp = {},
                     Weights weights = Weights::BF16);
  KimiDeltaAttention(const KimiDeltaAttention&) = delete;
  KimiDeltaAttention& operator=(const KimiDeltaAttention&) = delete;

  static std::unique_ptr<KimiDeltaAttention> from_checkpoint(const io::Checkpoint& ckpt,
                                                             const io::KimiLinearConfig& cfg, int layer_idx,
                                                             Precision precision,
                                                             distributed::TensorParallel tp = {},
                                                             Weights weights = Weights::BF16);

  int layer_idx() const { return layer_idx_; }
  Precision precision() const { return precision_; }
  Weights weights() const { return proj_.weights(); }
  // The projections' resident weight bytes on this rank (what a decode step reads of them).
  int64_t weight_bytes() const;
  // The projections by name (the fused q/k/v/f_a/g_a/b one is "qkv_fa_ga_b_proj"), as a packed
  // checkpoint names them under model.layers.{i}.self_attn.
  std::vector<std::pair<std::string, const layers::Linear*>> projections() const;
  int64_t hidden_size() const { return D_; }
  int64_t local_heads() const { return H_; }  // heads on this rank
  const distributed::TensorParallel& tp() const { return tp_; }
  const layers::RadixLinearAttention& attn() const { return attn_; }

  // hidden_states [T, D] (already RMS-normed by the decoder layer) -> out [T, D]. T must equal the
  // batch's token count. The layer's recurrent and conv states are read from and written to `pool`
  // in place, at the slots of the backend's forward metadata.
  void forward(const float* hidden_states, int64_t T, const model_executor::ForwardBatch& forward_batch,
               mem_cache::RecurrentStatePool& pool, float* out, KdaWorkspace* workspace = nullptr);
  // What a forward of up to T tokens through `backend` uses, grown and touched at load (the workspace,
  // the projections' thread scratch, the backend's buffers), so a first long prompt does not fault it in.
  void reserve(int64_t T, layers::attention::linear::LinearRecurrentAttnBackend& backend,
               KdaWorkspace* workspace = nullptr);

 private:
  int layer_idx_;
  Precision precision_;
  distributed::TensorParallel tp_;
  int64_t D_, H_, K_, P_, W_;
  double eps_;
  std::vector<float> conv_w_;  // [3P, W], q||k||v
  std::vector<float> A_log_, dt_bias_, o_norm_w_;
  layers::Linear proj_;  // [3P + 2K + H, D]: q | k | v | f_a | g_a | b
  layers::Linear f_b_, g_b_, o_proj_;
  layers::RadixLinearAttention attn_;
  KdaWorkspace own_ws_;
  void fit_workspace(KdaWorkspace& ws, int64_t T) const;
};

}  // namespace kda::models
