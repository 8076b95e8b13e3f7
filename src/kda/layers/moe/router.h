// The MoE router's expert selection (spec "MoE"): from fp32 router logits, s = sigmoid(l), the
// selection score c = s + e_score_correction_bias, the top_k experts by descending c (ties to the lower
// expert id) and their combine weights. The fast path keeps a sorted list of the k best per token (one
// pass over the E scores); the reference sorts all E experts. Same signature, same fp32 arithmetic, so
// the two agree exactly (tests compare them).
#pragma once

#include <cstdint>
#include <vector>

#include "kda/common/weight_buffer.h"

namespace kda::layers::moe {

// The router's gate, l = x W^T in fp32 with W [E, D] as the checkpoint stores it, packed at construction
// for kernels/gemm/router_gemm.h (each logit one multiply-add chain over the inputs in order, whatever the
// batch) into a weight buffer (huge pages, as the experts' weights). Thread safety: forward only reads W.
class RouterGate {
 public:
  // std::invalid_argument for E or D < 1 or a w that is not E * D values.
  RouterGate(const std::vector<float>& w, int64_t E, int64_t D);
  int64_t experts() const { return E_; }
  int64_t hidden() const { return D_; }
  int64_t weight_bytes() const { return E_ * D_ * static_cast<int64_t>(sizeof(float)); }
  // logits [T, E] = x [T, D] W^T (both row-major, dense rows).
  void forward(const float* x, int64_t T, float* logits) const;

 private:
  int64_t E_, D_;
  WeightBuffer w_;
};

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
