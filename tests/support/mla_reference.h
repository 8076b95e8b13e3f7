// The MLA (NoPE) layer in float64, straight from the spec's per-token formulas (kimi-linear-model.md,
// "MLA attention (NoPE)"), in the plain form: the tests' ground truth for KimiMLAAttention. Optionally
// with the bf16 mode's rounding points emulated (weights, the layer input, q, a, c_hat, kv, each head's
// o and the output rounded to bf16; everything else float64).
#pragma once

#include <cstdint>
#include <vector>

#include "kda/io/config.h"
#include "kda/models/kimi_mla.h"

namespace kda::testing {

struct MlaReference {
  std::vector<double> out;  // [N, D]
  std::vector<double> ckv;  // [N, R]   c_hat per token (the cache rows)
  std::vector<double> kpe;  // [N, dr]  k_pe per token
};

// One sequence's hidden states x [N, D] (already input-normed), attended causally from its first token.
// w: the whole layer's weights (tp 1). kv_norm_eps 0: rms_norm_eps.
MlaReference reference_mla(const io::KimiLinearConfig& cfg, const models::MlaLayerWeights& w, const float* x,
                           int64_t N, bool bf16_rounding = false, double kv_norm_eps = 0.0);

// A config with the model fields an MLA layer reads: layer 1 of 2 is the MLA layer (layer 0 a KDA one).
io::KimiLinearConfig mla_test_config(int64_t hidden, int heads, int qk_nope, int qk_rope, int v_head,
                                     int kv_lora);

}  // namespace kda::testing
