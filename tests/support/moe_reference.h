// The MoE and dense MLPs in float64, straight from the spec ("MoE", "Precision modes"): the reference
// for tests of models::KimiMLP and models::KimiMoE. With bf16 the spec's bf16 mode is emulated: weights
// rounded to bf16 (the router and the correction bias stay as given), the gate/up outputs, silu*up, each
// MLP's down output rounded, y rounded once after the routed sum and the shared expert; x as given.
#pragma once

#include <cstdint>
#include <vector>

#include "kda/io/config.h"
#include "kda/models/kimi_moe.h"

namespace kda::testing {

// x [T, D] -> [T, D].
std::vector<double> mlp_reference(const models::MlpWeights& w, const std::vector<float>& x, int64_t T,
                                  bool bf16);

struct MoeReference {
  std::vector<double> y;        // [T, D]
  std::vector<int32_t> topk;    // [T, k], by descending c (ties to the lower id)
  std::vector<double> weights;  // [T, k] combine weights
  std::vector<double> margin;   // [T] c_(k) - c_(k+1) (infinity when k == E)
};

// top_k experts of w.experts.size(); the config gives moe_renormalize, routed_scaling_factor and whether
// there is a shared expert (num_shared_experts > 0).
MoeReference moe_reference(const models::MoeWeights& w, const io::KimiLinearConfig& cfg, int top_k,
                           models::MoeCombine combine, const std::vector<float>& x, int64_t T, bool bf16);

// T tokens of N(0, 1) hidden values (bf16 values when bf16) whose routing margin in the reference is at
// least min_margin in float64 and, when bf16, in the bf16 emulation too: a token is drawn again until
// its selection is clear (the dumps' rule; expert selection is a discontinuity).
std::vector<float> clear_routing_inputs(const models::MoeWeights& w, const io::KimiLinearConfig& cfg,
                                        int top_k, int64_t T, uint64_t seed, double min_margin, bool bf16);

}  // namespace kda::testing
