#include "support/moe_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>

#include "kda/common/bf16.h"

namespace kda::testing {

namespace {

double rd(double v, bool bf16) { return bf16 ? static_cast<double>(round_bf16(static_cast<float>(v))) : v; }
double wt(float v, bool bf16) { return bf16 ? static_cast<double>(round_bf16(v)) : static_cast<double>(v); }

// One token through one MLP: out[D] (the down output, rounded in bf16).
void mlp_row(const models::MlpWeights& w, const float* x, bool bf16, double* out) {
  const int64_t D = w.hidden, I = w.intermediate;
  std::vector<double> a(static_cast<size_t>(I));
  for (int64_t i = 0; i < I; ++i) {
    double g = 0.0, u = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      g += wt(w.gate_proj[i * D + d], bf16) * x[d];
      u += wt(w.up_proj[i * D + d], bf16) * x[d];
    }
    g = rd(g, bf16);
    u = rd(u, bf16);
    a[i] = rd(g / (1.0 + std::exp(-g)) * u, bf16);
  }
  for (int64_t d = 0; d < D; ++d) {
    double s = 0.0;
    for (int64_t i = 0; i < I; ++i) s += wt(w.down_proj[d * I + i], bf16) * a[i];
    out[d] = rd(s, bf16);
  }
}

struct Routing {
  std::vector<int32_t> ids;
  std::vector<double> w;
  double margin;
};

Routing route(const models::MoeWeights& w, const io::KimiLinearConfig& cfg, int k, models::MoeCombine combine,
              const float* x) {
  const int64_t D = cfg.hidden_size;
  const int E = static_cast<int>(w.experts.size());
  std::vector<double> s(E), c(E);
  for (int e = 0; e < E; ++e) {
    double l = 0.0;
    for (int64_t d = 0; d < D; ++d) l += static_cast<double>(w.router[e * D + d]) * x[d];
    s[e] = 1.0 / (1.0 + std::exp(-l));
    c[e] = s[e] + w.bias[e];
  }
  std::vector<int32_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return c[a] > c[b]; });
  Routing r;
  r.ids.assign(order.begin(), order.begin() + k);
  r.margin = k < E ? c[order[k - 1]] - c[order[k]] : std::numeric_limits<double>::infinity();
  const bool biased = combine == models::MoeCombine::Biased;
  double sum = 0.0;
  for (int j = 0; j < k; ++j) sum += biased ? c[r.ids[j]] : s[r.ids[j]];
  for (int j = 0; j < k; ++j) {
    const double v = biased ? c[r.ids[j]] : s[r.ids[j]];
    r.w.push_back((cfg.moe_renormalize && k > 1 ? v / sum : v) * cfg.routed_scaling_factor);
  }
  return r;
}

}  // namespace

std::vector<double> mlp_reference(const models::MlpWeights& w, const std::vector<float>& x, int64_t T,
                                  bool bf16) {
  const int64_t D = w.hidden;
  if (static_cast<int64_t>(x.size()) != T * D) throw std::invalid_argument("mlp_reference: x is not [T, D]");
  std::vector<double> out(static_cast<size_t>(T * D));
  for (int64_t t = 0; t < T; ++t) mlp_row(w, x.data() + t * D, bf16, out.data() + t * D);
  return out;
}

MoeReference moe_reference(const models::MoeWeights& w, const io::KimiLinearConfig& cfg, int top_k,
                           models::MoeCombine combine, const std::vector<float>& x, int64_t T, bool bf16) {
  const int64_t D = cfg.hidden_size;
  if (static_cast<int64_t>(x.size()) != T * D) throw std::invalid_argument("moe_reference: x is not [T, D]");
  MoeReference ref;
  ref.y.assign(static_cast<size_t>(T * D), 0.0);
  std::vector<double> e_out(static_cast<size_t>(D));
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x.data() + t * D;
    double* yt = ref.y.data() + t * D;
    const Routing r = route(w, cfg, top_k, combine, xt);
    for (int j = 0; j < top_k; ++j) {
      mlp_row(w.experts[r.ids[j]], xt, bf16, e_out.data());
      for (int64_t d = 0; d < D; ++d) yt[d] += r.w[j] * e_out[d];
    }
    if (cfg.num_shared_experts > 0) {
      mlp_row(w.shared, xt, bf16, e_out.data());
      for (int64_t d = 0; d < D; ++d) yt[d] += e_out[d];
    }
    for (int64_t d = 0; d < D; ++d) yt[d] = rd(yt[d], bf16);
    ref.topk.insert(ref.topk.end(), r.ids.begin(), r.ids.end());
    ref.weights.insert(ref.weights.end(), r.w.begin(), r.w.end());
    ref.margin.push_back(r.margin);
  }
  return ref;
}

std::vector<float> clear_routing_inputs(const models::MoeWeights& w, const io::KimiLinearConfig& cfg,
                                        int top_k, int64_t T, uint64_t seed, double min_margin, bool bf16) {
  const int64_t D = cfg.hidden_size;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T * D));
  for (int64_t t = 0; t < T; ++t) {
    float* xt = x.data() + t * D;
    for (int attempt = 0;; ++attempt) {
      if (attempt == 10000) throw std::runtime_error("clear_routing_inputs: no clear token in 10000 draws");
      for (int64_t d = 0; d < D; ++d) xt[d] = bf16 ? round_bf16(nd(rng)) : nd(rng);
      // The router sees x as it is in both modes (fp32 router weights), so one margin covers both.
      if (route(w, cfg, top_k, models::MoeCombine::Unbiased, xt).margin >= min_margin) break;
    }
  }
  return x;
}

}  // namespace kda::testing
