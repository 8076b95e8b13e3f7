#include "support/layer_reference.h"

#include <cmath>

namespace kda::testing {

namespace {

// y[o] = sum_i W[o, i] x[i], W row-major [rows, cols].
std::vector<double> matvec(const std::vector<float>& W, int64_t rows, int64_t cols, const double* x) {
  std::vector<double> y(rows, 0.0);
  for (int64_t o = 0; o < rows; ++o) {
    double acc = 0.0;
    for (int64_t i = 0; i < cols; ++i) acc += static_cast<double>(W[o * cols + i]) * x[i];
    y[o] = acc;
  }
  return y;
}

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

}  // namespace

LayerReference reference_layer(const io::KimiLinearConfig& cfg, const models::KdaLayerWeights& w,
                               const std::vector<float>& hidden_states,
                               const std::vector<int32_t>& cu_seqlens,
                               const std::vector<float>& initial_recurrent_state,
                               const std::vector<float>& initial_conv_state) {
  const int64_t D = cfg.hidden_size, H = cfg.num_heads, K = cfg.head_dim, P = H * K,
                W = cfg.short_conv_kernel_size;
  const int64_t N = static_cast<int64_t>(cu_seqlens.size()) - 1, T = cu_seqlens.back(), C = 3 * P;
  const double scale = 1.0 / std::sqrt(static_cast<double>(K));
  LayerReference r;
  r.out.assign(T * D, 0.0);
  r.recurrent_state.assign(N * H * K * K, 0.0);
  r.conv_state.assign(N * (W - 1) * C, 0.0);
  for (size_t i = 0; i < initial_recurrent_state.size(); ++i)
    r.recurrent_state[i] = initial_recurrent_state[i];
  for (size_t i = 0; i < initial_conv_state.size(); ++i) r.conv_state[i] = initial_conv_state[i];
  const std::vector<float>* conv_w[3] = {&w.q_conv1d, &w.k_conv1d, &w.v_conv1d};
  const std::vector<float>* proj_w[3] = {&w.q_proj, &w.k_proj, &w.v_proj};
  for (int64_t n = 0; n < N; ++n) {
    double* S = &r.recurrent_state[n * H * K * K];
    double* window = &r.conv_state[n * (W - 1) * C];  // [W-1, C], oldest first
    for (int64_t t = cu_seqlens[n]; t < cu_seqlens[n + 1]; ++t) {
      const std::vector<double> x(hidden_states.begin() + t * D, hidden_states.begin() + (t + 1) * D);
      // Steps 1-2: projections, then the causal conv over the window and the current raw input.
      std::vector<double> raw(C), qkv(C);
      for (int j = 0; j < 3; ++j) {
        const auto y = matvec(*proj_w[j], P, D, x.data());
        std::copy(y.begin(), y.end(), raw.begin() + j * P);
      }
      for (int64_t c = 0; c < C; ++c) {
        const float* wc = &(*conv_w[c / P])[(c % P) * W];
        double acc = wc[W - 1] * raw[c];
        for (int64_t i = 0; i < W - 1; ++i) acc += wc[i] * window[i * C + c];
        qkv[c] = acc * sigmoid(acc);
      }
      for (int64_t i = 0; i + 1 < W - 1; ++i)
        for (int64_t c = 0; c < C; ++c) window[i * C + c] = window[(i + 1) * C + c];
      if (W > 1)
        for (int64_t c = 0; c < C; ++c) window[(W - 2) * C + c] = raw[c];
      // Steps 3-4: gate and beta.
      const auto fa = matvec(w.f_a_proj, K, D, x.data());
      const auto f = matvec(w.f_b_proj, P, K, fa.data());
      const auto b = matvec(w.b_proj, H, D, x.data());
      const auto ga = matvec(w.g_a_proj, K, D, x.data());
      const auto z = matvec(w.g_b_proj, P, K, ga.data());
      std::vector<double> y(P);
      for (int64_t h = 0; h < H; ++h) {
        const double* q = &qkv[h * K];
        const double* k = &qkv[P + h * K];
        const double* v = &qkv[2 * P + h * K];
        // Step 5: l2norm (eps inside the sqrt), the scale on q only.
        double sq = 0.0, sk = 0.0;
        for (int64_t d = 0; d < K; ++d) sq += q[d] * q[d], sk += k[d] * k[d];
        const double iq = scale / std::sqrt(sq + 1e-6), ik = 1.0 / std::sqrt(sk + 1e-6);
        // Step 6: decay rows, delta rule, output from the updated state.
        double* Sh = S + h * K * K;
        const double beta = sigmoid(b[h]);
        for (int64_t d = 0; d < K; ++d) {
          const double zz = static_cast<double>(f[h * K + d]) + w.dt_bias[h * K + d];
          const double g =
              -std::exp(static_cast<double>(w.A_log[h])) * (zz > 20.0 ? zz : std::log1p(std::exp(zz)));
          for (int64_t e = 0; e < K; ++e) Sh[d * K + e] *= std::exp(g);
        }
        std::vector<double> u(K), o(K, 0.0);
        for (int64_t e = 0; e < K; ++e) {
          double acc = 0.0;
          for (int64_t d = 0; d < K; ++d) acc += Sh[d * K + e] * k[d] * ik;
          u[e] = v[e] - acc;
        }
        for (int64_t d = 0; d < K; ++d)
          for (int64_t e = 0; e < K; ++e) Sh[d * K + e] += beta * k[d] * ik * u[e];
        for (int64_t e = 0; e < K; ++e)
          for (int64_t d = 0; d < K; ++d) o[e] += Sh[d * K + e] * q[d] * iq;
        // Step 7: gated RMS norm.
        double ss = 0.0;
        for (int64_t e = 0; e < K; ++e) ss += o[e] * o[e];
        const double inv = 1.0 / std::sqrt(ss / static_cast<double>(K) + cfg.rms_norm_eps);
        for (int64_t e = 0; e < K; ++e) y[h * K + e] = o[e] * inv * w.o_norm[e] * sigmoid(z[h * K + e]);
      }
      // Step 8.
      const auto out = matvec(w.o_proj, D, P, y.data());
      std::copy(out.begin(), out.end(), r.out.begin() + t * D);
    }
  }
  return r;
}

}  // namespace kda::testing
