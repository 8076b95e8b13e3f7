// RadixLinearAttention: the layer -> backend dispatch entry of a linear-recurrent layer (RFC §4.3.0),
// and the container of the per-layer metadata the backend needs (ids, dims, conv weights, A_log,
// dt_bias). It holds no state: states live in the pool, the backend comes with the ForwardBatch.
#pragma once

#include <cstdint>

#include "kda/layers/attention/linear/kda_backend.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/model_executor/forward_batch_info.h"

namespace kda::layers {

class RadixLinearAttention {
 public:
  struct Params {
    int layer_id = 0;  // decoder layer id (0-based): selects the layer's view of the state pool
    int num_q_heads = 0, num_k_heads = 0, num_v_heads = 0;
    int head_q_dim = 0, head_k_dim = 0, head_v_dim = 0;
    // Depthwise conv weights [C, W] over the channels q||k||v (C = Hq*Dq + Hk*Dk + Hv*Dv).
    const float* conv_weights = nullptr;
    int conv_kernel = 4;
    const float* A_log = nullptr;    // [H]
    const float* dt_bias = nullptr;  // [H * K]
    // bf16 mode, as an HF bf16 run rounds: raw projections handed in as fp32 (mixed_qkv and b) are rounded
    // to bf16 as they are read (the caller need not make a pass over them; bf16 ones are bf16 already),
    // and so is each conv output (after silu). The gate `a` is passed in already rounded.
    bool bf16_activations = false;
  };

  explicit RadixLinearAttention(const Params& p);

  const Params& params() const { return p_; }
  int layer_id() const { return p_.layer_id; }
  int64_t q_dim() const { return int64_t{p_.num_q_heads} * p_.head_q_dim; }
  int64_t k_dim() const { return int64_t{p_.num_k_heads} * p_.head_k_dim; }
  int64_t v_dim() const { return int64_t{p_.num_v_heads} * p_.head_v_dim; }
  int64_t conv_dim() const { return q_dim() + k_dim() + v_dim(); }

  // Dispatches into forward_batch.attn_backend.
  //   mixed_qkv: [T, qkv_stride], raw pre-conv projections q||k||v in the first conv_dim() columns
  //   a: [T, a_stride] raw forget gate f (the kernel applies A_log, dt_bias and softplus)
  //   b: [T, b_stride] beta logits (sigmoid applied in the backend)
  //   o: [T, Hv * Dv] kernel output
  void operator()(const model_executor::ForwardBatch& forward_batch, const float* mixed_qkv,
                  int64_t qkv_stride, const float* a, int64_t a_stride, const float* b, int64_t b_stride,
                  mem_cache::RecurrentStatePool& recurrent_state_pool, float* o) const;
  // The same with each projection fp32 or bf16 (see LinearAttnInputs).
  void operator()(const model_executor::ForwardBatch& forward_batch,
                  const attention::linear::LinearAttnInputs& in,
                  mem_cache::RecurrentStatePool& recurrent_state_pool, float* o) const;

 private:
  Params p_;
};

}  // namespace kda::layers
