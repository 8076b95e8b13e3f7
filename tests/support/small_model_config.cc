#include "support/small_model_config.h"

#include <utility>

namespace kda::testing {

io::KimiLinearConfig small_model_config(std::vector<int> kda, std::vector<int> mla, int64_t vocab) {
  io::KimiLinearConfig c;
  c.hidden_size = 256;
  c.rms_norm_eps = 1e-5;
  c.num_hidden_layers = static_cast<int>(kda.size() + mla.size());
  c.num_heads = 2;
  c.head_dim = 128;
  c.short_conv_kernel_size = 4;
  c.kda_layers = std::move(kda);
  c.full_attn_layers = std::move(mla);
  c.has_model_fields = true;
  c.vocab_size = vocab;
  c.num_attention_heads = c.num_key_value_heads = 2;
  c.kv_lora_rank = 64;
  c.qk_nope_head_dim = 32;
  c.qk_rope_head_dim = 16;
  c.v_head_dim = 32;
  c.intermediate_size = 512;
  c.first_k_dense_replace = 1;
  c.moe_layer_freq = 1;
  c.num_experts = 4;
  c.num_experts_per_token = 2;
  c.num_shared_experts = 1;
  c.moe_intermediate_size = 64;
  c.routed_scaling_factor = 2.5;
  return c;
}

}  // namespace kda::testing
