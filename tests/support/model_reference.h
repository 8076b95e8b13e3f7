// The whole Kimi-Linear decoder in float64, straight from the spec (kimi-linear-model.md "Decoder", the
// KDA layers from kda-numerics.md), token by token: the ground truth the engine's model tests compare
// against, with the spec's bf16 emulation and the int8/int4 weight schemes as options.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "kda/io/config.h"
#include "support/model_checkpoint.h"

namespace kda::testing {

enum class RefCombine { Unbiased, Biased };

struct ModelReferenceOptions {
  RefCombine combine = RefCombine::Unbiased;
  double kv_norm_eps = 0.0;  // kv_a_layernorm's eps; 0: rms_norm_eps
  // Emulate the spec's bf16 mode: weights rounded to bf16 (but A_log and dt_bias), values rounded at every
  // rounding point of "Precision modes" (KDA layers per kda-numerics.md), arithmetic in float64.
  bool bf16 = false;
  // Weight-only quantization, in float64, by the engine's scheme (int8 per output channel, int4 groups
  // of 32, symmetric, round to nearest) of every projection, expert and dense-MLP weight (not the router,
  // norms, embeddings, conv, lm_head), from the stored values (with bf16 set, the other weights are
  // rounded to bf16 and the quantized ones are not).
  enum class Quant { None, Int8, Int4 } quant = Quant::None;
};

struct ModelReference {
  std::vector<double> logits;        // [T, V]
  std::vector<double> hidden_final;  // [T, D], before model.norm
  // Per KDA layer (0-based decoder index), the dumps' layout: [N, H, K, V] and [N, W-1, 3P].
  std::map<int, std::vector<double>> kda_recurrent_state, kda_conv_state;
  std::map<int, std::vector<double>> mla_ckv, mla_kpe;  // per MLA layer [T, R], [T, r]
  std::map<int, std::vector<int32_t>> moe_topk;         // per MoE layer [T, k], by descending c
  double routing_min_margin = 0.0;  // min over tokens and MoE layers of c_(k) - c_(k+1) (+inf if none)
};

// The whole decoder (spec "Decoder") over input_ids, sequences of cu_seqlens ([N+1]; empty: one
// sequence), each starting empty. Throws std::invalid_argument on a token id outside [0, vocab_size),
// cu_seqlens that disagree with input_ids, or a missing / mis-shaped weight (naming the key).
ModelReference reference_model(const io::KimiLinearConfig& cfg, const TensorMap& w,
                               const std::vector<int32_t>& input_ids, const std::vector<int32_t>& cu_seqlens,
                               const ModelReferenceOptions& opts = {});

// Token ids drawn one at a time so that every MoE routing decision keeps margin >= `margin` in float64
// and, with bf16_too, in the bf16 emulation as well (the dumps' README, "Routing margins": a token is
// drawn again until its routing, given the tokens before it, is clear). Returns the sequences packed in
// order; the same arguments give the same ids. Throws std::runtime_error when a position finds no such
// token in 4000 draws. Each try runs 8 candidates through the float64 decoder together (one pass over
// the weights) and the ones it clears through the bf16 emulation.
std::vector<int32_t> draw_clear_tokens(const io::KimiLinearConfig& cfg, const TensorMap& w,
                                       const std::vector<int32_t>& seq_lens, uint64_t seed, double margin,
                                       bool bf16_too = true);

}  // namespace kda::testing
