#include "kda/layers/moe/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/kernels/gemm/router_gemm.h"

namespace kda::layers::moe {

namespace {

void check(const RouterParams& p) {
  if (p.num_experts < 1 || p.top_k < 1 || p.top_k > p.num_experts)
    throw std::invalid_argument("MoE router: top_k " + std::to_string(p.top_k) + " must be in 1.." +
                                std::to_string(p.num_experts) + " (num_experts)");
}

// The combine weights of one token's selected experts, from their s and c (in selection order).
void combine(const float* s, const float* c, int k, const RouterParams& p, float* w) {
  const float* v = p.biased_combine ? c : s;
  if (p.renormalize && k > 1) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += v[j];
    for (int j = 0; j < k; ++j) w[j] = v[j] / sum * p.routed_scaling_factor;
  } else {
    for (int j = 0; j < k; ++j) w[j] = v[j] * p.routed_scaling_factor;
  }
}

}  // namespace

RouterGate::RouterGate(const std::vector<float>& w, int64_t E, int64_t D) : E_(E), D_(D) {
  if (E < 1 || D < 1 || static_cast<int64_t>(w.size()) != E * D)
    throw std::invalid_argument("MoE router: " + std::to_string(w.size()) + " gate weights for " +
                                std::to_string(E) + " experts of " + std::to_string(D) + " inputs");
  w_ = allocate_weights(static_cast<size_t>(weight_bytes()));
  kernels::gemm::pack_router(w.data(), E, D, static_cast<float*>(w_.get()));
}

void RouterGate::forward(const float* x, int64_t T, float* logits) const {
  kernels::gemm::router_logits(x, T, D_, static_cast<const float*>(w_.get()), E_, logits);
}

float router_sigmoid(float logit) { return 1.0f / (1.0f + std::exp(-logit)); }

void select_experts(const float* logits, int64_t T, const float* bias, const RouterParams& p,
                    int32_t* topk_ids, float* topk_weights) {
  check(p);
  const int E = p.num_experts, k = p.top_k;
#pragma omp parallel if (T > 64)
  {
    std::vector<float> bs(k), bc(k);  // the k best so far: s and c, sorted by descending c
    std::vector<int32_t> bi(k);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* l = logits + t * E;
      int n = 0;
      for (int e = 0; e < E; ++e) {
        const float s = router_sigmoid(l[e]);
        const float c = s + bias[e];
        // Experts arrive in increasing id, so an equal c never displaces an earlier (lower) id.
        if (n == k && !(c > bc[k - 1])) continue;
        int pos = n < k ? n++ : k - 1;
        while (pos > 0 && c > bc[pos - 1]) {
          bs[pos] = bs[pos - 1];
          bc[pos] = bc[pos - 1];
          bi[pos] = bi[pos - 1];
          --pos;
        }
        bs[pos] = s;
        bc[pos] = c;
        bi[pos] = e;
      }
      std::copy(bi.begin(), bi.end(), topk_ids + t * k);
      combine(bs.data(), bc.data(), k, p, topk_weights + t * k);
    }
  }
}

void select_experts_reference(const float* logits, int64_t T, const float* bias, const RouterParams& p,
                              int32_t* topk_ids, float* topk_weights) {
  check(p);
  const int E = p.num_experts, k = p.top_k;
  std::vector<float> s(E), c(E), ss(k), cs(k);
  std::vector<int32_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) {
      s[e] = router_sigmoid(logits[t * E + e]);
      c[e] = s[e] + bias[e];
    }
    std::iota(order.begin(), order.end(), 0);
    // Descending c, equal c by ascending id.
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      const float ca = c[a], cb = c[b];
      return ca != cb ? ca > cb : a < b;
    });
    for (int j = 0; j < k; ++j) {
      topk_ids[t * k + j] = order[j];
      ss[j] = s[order[j]];
      cs[j] = c[order[j]];
    }
    combine(ss.data(), cs.data(), k, p, topk_weights + t * k);
  }
}

}  // namespace kda::layers::moe
