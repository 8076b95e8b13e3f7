// The Kimi-Linear-48B-A3B geometry (config.json of the published checkpoint; kda-numerics.md), in one
// place for the synthetic models, the tests and the benchmarks: hidden 2304, 27 decoder layers of which
// 20 are KDA (the other 7, full_attn_layers, are MLA), 32 heads x 128 (K = V), short conv width 4,
// rms_norm_eps 1e-5.
#pragma once

#include <cstdint>

#include "kda/io/config.h"

namespace kda::io {

// The shape as compile-time constants (array sizes, benchmark arguments).
struct KimiLinear48bShape {
  static constexpr int64_t kHidden = 2304;                   // D
  static constexpr int kHeads = 32;                          // H
  static constexpr int kHeadDim = 128;                       // K = V
  static constexpr int64_t kProjection = kHeads * kHeadDim;  // P = H K
  static constexpr int64_t kConvDim = 3 * kProjection;       // the short conv's channels, q || k || v
  static constexpr int kConvKernel = 4;                      // W
  static constexpr int kLayers = 27;
  static constexpr int kKdaLayers = 20;
  static constexpr double kRmsNormEps = 1e-5;
  // MLA (NoPE) and the MLPs.
  static constexpr int kMlaHeads = 32;
  static constexpr int kKvLoraRank = 512;
  static constexpr int kQkNope = 128;
  static constexpr int kQkRope = 64;
  static constexpr int kVHead = 128;
  static constexpr int64_t kIntermediate = 9216;  // the dense MLP (layer 0)
  static constexpr int kExperts = 256;            // routed experts per MoE layer
  static constexpr int kExpertsPerToken = 8;      // top-k
  static constexpr int kSharedExperts = 1;
  static constexpr int64_t kMoeIntermediate = 1024;  // one expert's width
  static constexpr double kRoutedScalingFactor = 2.446;
  static constexpr int64_t kVocab = 163840;
};

// The same as a model config, as parse_config would read the published config.json.
inline KimiLinearConfig kimi_linear_48b_config() {
  using S = KimiLinear48bShape;
  KimiLinearConfig c;
  c.hidden_size = S::kHidden;
  c.rms_norm_eps = S::kRmsNormEps;
  c.num_hidden_layers = S::kLayers;
  c.num_heads = S::kHeads;
  c.head_dim = S::kHeadDim;
  c.short_conv_kernel_size = S::kConvKernel;
  c.kda_layers = {1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26};
  c.full_attn_layers = {4, 8, 12, 16, 20, 24, 27};
  c.has_model_fields = true;
  c.vocab_size = S::kVocab;
  c.tie_word_embeddings = false;
  c.num_attention_heads = S::kMlaHeads;
  c.num_key_value_heads = S::kMlaHeads;
  c.kv_lora_rank = S::kKvLoraRank;
  c.qk_nope_head_dim = S::kQkNope;
  c.qk_rope_head_dim = S::kQkRope;
  c.v_head_dim = S::kVHead;
  c.intermediate_size = S::kIntermediate;
  c.first_k_dense_replace = 1;
  c.moe_layer_freq = 1;
  c.num_experts = S::kExperts;
  c.num_experts_per_token = S::kExpertsPerToken;
  c.num_shared_experts = S::kSharedExperts;
  c.moe_intermediate_size = S::kMoeIntermediate;
  c.moe_renormalize = true;
  c.routed_scaling_factor = S::kRoutedScalingFactor;
  c.bos_token_id = 163584;
  c.eos_token_id = 163586;
  c.pad_token_id = 163839;
  return c;
}

// The geometry with one decoder layer, a KDA layer: what a single layer's tests and benchmarks build
// (the KDA fields only, as a layer's config has them).
inline KimiLinearConfig kimi_linear_48b_one_layer_config() {
  KimiLinearConfig c;
  const KimiLinearConfig full = kimi_linear_48b_config();
  c.hidden_size = full.hidden_size;
  c.rms_norm_eps = full.rms_norm_eps;
  c.num_heads = full.num_heads;
  c.head_dim = full.head_dim;
  c.short_conv_kernel_size = full.short_conv_kernel_size;
  c.num_hidden_layers = 1;
  c.kda_layers = {1};
  c.full_attn_layers = {};
  return c;
}

}  // namespace kda::io
