#include "kda/layers/radix_linear_attention.h"

#include <stdexcept>
#include <string>

#include "kda/layers/attention/linear/kda_backend.h"

namespace kda::layers {

RadixLinearAttention::RadixLinearAttention(const Params& p) : p_(p) {
  if (p.num_q_heads <= 0 || p.num_k_heads <= 0 || p.num_v_heads <= 0 || p.head_q_dim <= 0 ||
      p.head_k_dim <= 0 || p.head_v_dim <= 0)
    throw std::invalid_argument("RadixLinearAttention: head counts and dims must be positive (layer " +
                                std::to_string(p.layer_id) + ")");
  if (p.num_q_heads != p.num_k_heads || p.head_q_dim != p.head_k_dim)
    throw std::invalid_argument("RadixLinearAttention: q and k heads must match (layer " +
                                std::to_string(p.layer_id) + ")");
  // The backend runs every head of v with the q/k head of the same index (no grouped values): more v
  // heads would read q and k past their heads' columns, fewer would drop q/k heads.
  if (p.num_v_heads != p.num_k_heads)
    throw std::invalid_argument("RadixLinearAttention: v has " + std::to_string(p.num_v_heads) +
                                " heads but q and k have " + std::to_string(p.num_k_heads) +
                                "; the KDA backend needs one head count for q, k and v (layer " +
                                std::to_string(p.layer_id) + ")");
  if (!p.conv_weights || !p.A_log || p.conv_kernel < 1)
    throw std::invalid_argument("RadixLinearAttention: conv weights and A_log are required (layer " +
                                std::to_string(p.layer_id) + ")");
}

void RadixLinearAttention::operator()(const model_executor::ForwardBatch& forward_batch,
                                      const float* mixed_qkv, int64_t qkv_stride, const float* a,
                                      int64_t a_stride, const float* b, int64_t b_stride,
                                      mem_cache::RecurrentStatePool& recurrent_state_pool, float* o) const {
  (*this)(forward_batch,
          attention::linear::LinearAttnInputs::of(mixed_qkv, qkv_stride, a, a_stride, b, b_stride),
          recurrent_state_pool, o);
}

void RadixLinearAttention::operator()(const model_executor::ForwardBatch& forward_batch,
                                      const attention::linear::LinearAttnInputs& in,
                                      mem_cache::RecurrentStatePool& recurrent_state_pool, float* o) const {
  if (!forward_batch.attn_backend)
    throw std::invalid_argument("ForwardBatch has no attn_backend (layer " + std::to_string(p_.layer_id) +
                                ")");
  forward_batch.attn_backend->forward(*this, forward_batch, in, recurrent_state_pool, o);
}

}  // namespace kda::layers
