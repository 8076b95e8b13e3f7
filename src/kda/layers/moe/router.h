// The MoE router's expert selection (spec "MoE"): from fp32 router logits, s = sigmoid(l), the
// selection score c = s + e_score_correction_bias, the top_k experts by descending c (ties to the lower
// expert id) and their combine weights. The fast path keeps a sorted list of the k best per token (one
// pass over the E scores); the reference sorts all E experts. Same signature, same fp32 arithmetic, so
// the two agree exactly (tests compare them).
#pragma once

#include <cstdint>

namespace kda::layers::moe {

struct RouterParams {
  int num_experts = 0;  // E
  int top_k = 0;        // 1 .. E
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
  // false (spec default): w_i = s_i / sum_j s_j * factor. true (the HF remote code): c instead of s.
  bool biased_combine = false;
};

// logits [T, E] (row stride E), bias [E] -> topk_ids [T, top_k] by descending c, topk_weights
// [T, top_k] (w_i, in the same order). With renormalize and top_k > 1 the weights are normalized over
// the selected experts before the factor; otherwise w_i = s_i * factor (c_i * factor when biased).
// Throws std::invalid_argument on a bad top_k / num_experts.
void select_experts(const float* logits, int64_t T, const float* bias, const RouterParams& p,
                    int32_t* topk_ids, float* topk_weights);
void select_experts_reference(const float* logits, int64_t T, const float* bias, const RouterParams& p,
                              int32_t* topk_ids, float* topk_weights);

// sigmoid in fp32 as both paths compute it.
float router_sigmoid(float logit);

}  // namespace kda::layers::moe
