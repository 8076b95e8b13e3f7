// Kimi-Linear config.json. parse_config reads the fields a KDA layer needs (a KDA-only config, as the
// layer dumps have, is enough); parse_model_config reads and checks every field the whole decoder needs
// (kimi-linear-model.md, "Config") and refuses what the spec does not define, naming the field.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace kda::io {

struct KimiLinearConfig {
  int64_t hidden_size = 0;
  double rms_norm_eps = 0.0;  // from config.json (1e-5 for the 48B model), never assumed
  int num_hidden_layers = 0;
  int num_heads = 0;  // linear_attn_config.num_heads
  int head_dim = 0;   // linear_attn_config.head_dim (K == V)
  int short_conv_kernel_size = 0;
  std::vector<int> kda_layers;        // as in the file: 1-based
  std::vector<int> full_attn_layers;  // as in the file: 1-based

  // The whole decoder's fields (parse_model_config; zero / empty when only parse_config read the file).
  bool has_model_fields = false;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  // MLA (NoPE): Hm heads; q head dim = qk_nope + qk_rope; cache per token kv_lora_rank + qk_rope values.
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  // MLPs: dense layers (i < first_k_dense_replace, or i % moe_layer_freq != 0, or num_experts == 0)
  // have intermediate_size; MoE layers num_experts routed experts of moe_intermediate_size, the top
  // num_experts_per_token of them per token, and num_shared_experts shared ones (one MLP of
  // moe_intermediate_size * num_shared_experts).
  int64_t intermediate_size = 0;
  int first_k_dense_replace = 0;
  int moe_layer_freq = 1;
  int num_experts = 0;
  int num_experts_per_token = 0;
  int num_shared_experts = 0;
  int64_t moe_intermediate_size = 0;
  bool moe_renormalize = true;
  double routed_scaling_factor = 1.0;
  // Token ids (-1 when absent); informational for the model, used by the tokenizer and serving.
  int64_t bos_token_id = -1, eos_token_id = -1, pad_token_id = -1;

  int projection_size() const { return num_heads * head_dim; }  // P = H * K
  // 0-based decoder layer i is a KDA layer iff (i + 1) is in kda_layers.
  bool is_kda_layer(int layer_idx) const;
  std::vector<int> kda_layer_ids() const;  // 0-based, ascending
  // 0-based decoder layer i is an MLA layer iff (i + 1) is in full_attn_layers.
  bool is_mla_layer(int layer_idx) const;
  std::vector<int> mla_layer_ids() const;  // 0-based, ascending
  // Layer i's MLP is a MoE (spec: num_experts set, i >= first_k_dense_replace, i % moe_layer_freq == 0).
  bool is_moe_layer(int layer_idx) const;
  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }  // 192 for the 48B model
  int kv_cache_dim() const { return kv_lora_rank + qk_rope_head_dim; }     // 576 for the 48B model
};

// Bounds parse_config enforces: far above any published Kimi-Linear shape (hidden 2304, 27 layers, 32 heads
// of 128, conv width 4), low enough that every size derived from them (weights, one slot's state, a
// step's activations) fits int64 with room, and that no single buffer asks for more than tens of GiB.
inline constexpr int64_t kMaxHiddenSize = 1 << 16;
inline constexpr int64_t kMaxHiddenLayers = 1024;
inline constexpr int64_t kMaxHeads = 1024;
inline constexpr int64_t kMaxHeadDim = 1024;
inline constexpr int64_t kMaxConvKernel = 64;
// Elements of one projection's weight, hidden_size x num_heads * head_dim.
inline constexpr int64_t kMaxProjectionElements = int64_t{1} << 32;

inline constexpr int64_t kMaxVocab = int64_t{1} << 24;
inline constexpr int64_t kMaxExperts = 4096;
inline constexpr int64_t kMaxIntermediate = int64_t{1} << 18;
inline constexpr int64_t kMaxLoraRank = 1 << 14;

// Throws std::runtime_error naming the file and the missing, bad or out-of-bounds field.
KimiLinearConfig parse_config(const std::string& json_text, const std::string& what);
KimiLinearConfig load_config(const std::filesystem::path& path_or_dir);  // dir: <dir>/config.json

// The whole decoder's config: parse_config's fields and every model field above, all required (but
// the token ids and tie_word_embeddings, default false), has_model_fields set. Refused, naming the field:
// a layer in neither or both of kda_layers / full_attn_layers, q_lora_rank not null, mla_use_nope not
// true, moe_router_activation_func other than "sigmoid", use_grouped_topk with num_expert_group or
// topk_group other than 1, num_key_value_heads != num_attention_heads, num_experts_per_token outside
// 1..num_experts, and hidden_act other than "silu".
KimiLinearConfig parse_model_config(const std::string& json_text, const std::string& what);
KimiLinearConfig load_model_config(const std::filesystem::path& path_or_dir);

}  // namespace kda::io
