// KimiMLAAttention (models/kimi_mla): the MLA (NoPE) layer of Kimi-Linear (kimi-linear-model.md, "MLA
// attention (NoPE)"), its fp32 and bf16 modes, over the token-level latent cache (MLATokenToKVPool).
//
//   q = W_q x;  a = W_kva x;  c_hat = RMSNorm(a[0:R]; kv_a_layernorm);  k_pe = a[R:R+dr]
//   cache row per token: c_hat | k_pe;  attention over the sequence's cached and new tokens (causal)
//   out = W_o concat_h(o[h])
//
// The attention runs in the plain form (k_nope, v expanded through kv_b) or the absorbed one (W_UK folded
// into the query, W_UV applied to the weighted latent sum); MlaForm::Auto picks per sequence the form with
// less work (layers/attention/mla: decode and short extends on a long prefix absorb, whole-prompt
// prefills expand).
//
// Tensor parallelism: rank r of n owns heads [r Hm/n, (r+1) Hm/n): q_proj's and kv_b_proj's rows of those
// heads, o_proj's columns of them (row-parallel, one allreduce); kv_a_proj_with_mqa and kv_a_layernorm
// are replicated, so every rank computes and caches the whole c_hat / k_pe.
//
// Thread safety: forward uses the layer's own scratch: calls on one layer must not overlap.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kda/common/precision.h"
#include "kda/common/weights.h"
#include "kda/distributed/communicator.h"
#include "kda/io/config.h"
#include "kda/io/safetensors.h"
#include "kda/layers/linear.h"
#include "kda/layers/packed_linears.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/model_executor/forward_batch_info.h"

namespace kda::layers::attention::mla {
struct MlaDims;
struct MlaScratch;
}  // namespace kda::layers::attention::mla

namespace kda::models {

// Throws std::invalid_argument when `tp_size` ranks cannot split the config's MLA heads evenly.
void check_mla_tensor_parallel(const io::KimiLinearConfig& cfg, int tp_size);

// One MLA layer's parameters as fp32 values in the checkpoint's shapes ([out, in]); a TP shard holds
// Hm/n heads where the shapes say Hm.
struct MlaLayerWeights {
  std::vector<float> q_proj;              // [Hm*(dn+dr), D]
  std::vector<float> kv_a_proj_with_mqa;  // [R + dr, D]
  std::vector<float> kv_a_layernorm;      // [R]
  std::vector<float> kv_b_proj;           // [Hm*(dn+dv), R]
  std::vector<float> o_proj;              // [D, Hm*dv]
  // A packed checkpoint's q_proj, kv_a_proj_with_mqa, kv_b_proj and o_proj (io/packed_checkpoint.h);
  // their fp32 values above are then empty.
  layers::PackedLinears packed;

  // Decoder layer `layer_idx` (keys model.layers.{i}.self_attn.*), every shape checked against the
  // config; a non-MLA layer is an error. Rank tp_rank of tp_size reads only its shard; a packed
  // checkpoint (tp_size 1 only) fills `packed` with views of its mapping.
  static MlaLayerWeights load(const io::Checkpoint& ckpt, const io::KimiLinearConfig& cfg, int layer_idx,
                              int tp_rank = 0, int tp_size = 1);
  MlaLayerWeights shard(const io::KimiLinearConfig& cfg, int tp_rank, int tp_size) const;
  // Seeded weights at any config (common/seeded.h draws: the same values whatever builds them).
  static MlaLayerWeights synthetic(const io::KimiLinearConfig& cfg, uint64_t seed);
};

enum class MlaForm { Auto, Plain, Absorbed };

struct MlaOptions {
  double kv_norm_eps = 0.0;  // kv_a_layernorm's eps; 0: rms_norm_eps (the HF remote code uses 1e-6)
  MlaForm form = MlaForm::Auto;
};

class KimiMLAAttention {
 public:
  // `w` holds this rank's shard (the whole layer when tp.size == 1). `weights`: how q_proj,
  // kv_a_proj_with_mqa, kv_b_proj and o_proj hold W (the precision's dense weights, or int8 / int4).
  KimiMLAAttention(const io::KimiLinearConfig& cfg, int layer_idx, const MlaLayerWeights& w,
                   Precision precision, distributed::TensorParallel tp = {}, Weights weights = Weights::BF16,
                   MlaOptions options = {});
  ~KimiMLAAttention();
  KimiMLAAttention(const KimiMLAAttention&) = delete;
  KimiMLAAttention& operator=(const KimiMLAAttention&) = delete;

  static std::unique_ptr<KimiMLAAttention> from_checkpoint(
      const io::Checkpoint& ckpt, const io::KimiLinearConfig& cfg, int layer_idx, Precision precision,
      distributed::TensorParallel tp = {}, Weights weights = Weights::BF16, MlaOptions options = {});

  int layer_idx() const { return layer_idx_; }
  Precision precision() const { return precision_; }
  Weights weights() const { return q_proj_.weights(); }
  const MlaOptions& options() const { return options_; }
  int64_t hidden_size() const { return D_; }
  int64_t local_heads() const { return Hm_; }
  // The projection bytes a decode step reads on this rank: q_proj, kv_a_proj_with_mqa and o_proj as their
  // Linear holds them, and kv_b_proj as the absorbed form's decode rows read it (the int8 / int4 packing,
  // bf16 values in the bf16 mode with bf16 weights, else fp32). The fp32 copy of kv_b's values that the
  // prefill's forms multiply by, and the bf16 mode's bf16 Linear of it, are left out.
  int64_t weight_bytes() const;
  // q_proj, kv_a_proj_with_mqa and o_proj by name (model.layers.{i}.self_attn.<name> in a packed
  // checkpoint); kv_b_proj is no Linear here (see weight_bytes()).
  std::vector<std::pair<std::string, const layers::Linear*>> projections() const;

  // hidden_states [T, D] (already input-RMS-normed) -> out [T, D] (allreduced under TP). EXTEND (each row
  // with extend_prefix_lens[b] cached tokens), DECODE and TARGET_VERIFY (each row's tokens attend to the
  // committed prefix and to their ancestors in the row: a chain, or fb.draft_parents' tree; the caller
  // then keeps the accepted path's token slots with HybridReqToTokenPool::accept_tokens); IDLE /
  // DUMMY_FIRST give zeros and touch nothing.
  // The caller has already called pools.req_to_token_pool.alloc_tokens for this step, so req_to_token(req)
  // holds prefix + new tokens; the layer writes the new tokens' cache rows and attends over the whole
  // sequence. A padded row (-1) gives zero output. Errors (a length mismatch, no KV pool, a mode it does not
  // run) are thrown before the pool or out changes.
  void forward(const float* hidden_states, int64_t T, const model_executor::ForwardBatch& fb,
               mem_cache::MemoryPools& pools, float* out);
  // What a prefill of up to T tokens (one sequence, no cached prefix) uses, grown and touched at load:
  // q, the latent rows, o, the plain form's expanded keys and values, the projections' thread scratch.
  void reserve(int64_t T);

 private:
  // The attention kernels' dims (this rank's heads), built from the members below.
  layers::attention::mla::MlaDims mla_dims() const;

  int layer_idx_;
  Precision precision_;
  distributed::TensorParallel tp_;
  MlaOptions options_;
  int64_t D_, Hm_, dn_, dr_, dv_, R_;
  double eps_;
  float scale_;
  std::vector<float> norm_w_;  // kv_a_layernorm [R]
  layers::Linear q_proj_, kv_a_, o_proj_;
  std::vector<float> w_kvb_;  // kv_b as the attention multiplies by it (bf16-rounded / dequantized values)
  // The same values as the decode rows read them, in the weights' compact format (kimi_mla.cc).
  struct DecodeKvb;
  std::unique_ptr<DecodeKvb> kvb_decode_;
  // With bf16 weights in the bf16 precision, on a CPU where the plain form packs bf16 keys, the same
  // values as a bf16 Linear: the plain form's expansion (prefill) as one bf16 GEMM (MlaAttnArgs::kv_b).
  // Another copy of kv_b (8 MB a layer at the real shapes), in the Linear's layout, beside the row-major
  // one the decode rows read.
  std::unique_ptr<layers::Linear> kv_b16_;
  // Scratch.
  std::vector<float> q_, a_, lat_, o_;
  std::unique_ptr<layers::attention::mla::MlaScratch> plain_kv_;  // the plain form's expanded keys, values
};

}  // namespace kda::models
