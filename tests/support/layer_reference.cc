#include "support/layer_reference.h"

#include <cmath>

#include "support/ref_math.h"

namespace kda::testing {

namespace {

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

// Below this many multiply-adds a loop runs on one thread: a team's start costs more than the work.
constexpr int64_t kParallelWork = int64_t{1} << 16;

}  // namespace

KdaRefWeights ref_weights(const models::KdaLayerWeights& w) {
  return {w.q_proj.data(),   w.k_proj.data(),   w.v_proj.data(),  w.q_conv1d.data(), w.k_conv1d.data(),
          w.v_conv1d.data(), w.A_log.data(),    w.dt_bias.data(), w.f_a_proj.data(), w.g_a_proj.data(),
          w.f_b_proj.data(), w.g_b_proj.data(), w.b_proj.data(),  w.o_norm.data(),   w.o_proj.data()};
}

void kda_reference_segments(const io::KimiLinearConfig& cfg, const KdaRefWeights& w, const double* x,
                            const std::vector<int64_t>& cu, const std::vector<double*>& recurrent,
                            const std::vector<double*>& conv, double* out, bool bf16) {
  const int64_t D = cfg.hidden_size, H = cfg.num_heads, K = cfg.head_dim, P = H * K,
                W = cfg.short_conv_kernel_size, C = 3 * P;
  const int64_t N = static_cast<int64_t>(cu.size()) - 1, T = cu.back();
  const double scale = 1.0 / std::sqrt(static_cast<double>(K));
  auto round_all = [&](std::vector<double>& v) {
    if (bf16)
      for (double& e : v) e = ref_round_bf16(e);
  };
  // Step 1: the raw projections q|k|v of every token (the conv state holds them as they are).
  std::vector<double> raw(T * C), qkv(T * C);
  const float* proj_w[3] = {w.q_proj, w.k_proj, w.v_proj};
  for (int j = 0; j < 3; ++j) ref_gemm(proj_w[j], P, D, x, T, D, raw.data() + j * P, C);
  round_all(raw);
  // Step 2: the causal conv per channel over the window and the current raw input, token by token.
  const float* conv_w[3] = {w.q_conv1d, w.k_conv1d, w.v_conv1d};
  for (int64_t n = 0; n < N; ++n) {
    double* window = conv[n];  // [W-1, C], oldest first
#pragma omp parallel for schedule(static) if ((cu[n + 1] - cu[n]) * C * W > kParallelWork)
    for (int64_t c = 0; c < C; ++c) {
      const float* wc = conv_w[c / P] + (c % P) * W;
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        double acc = wc[W - 1] * raw[t * C + c];
        for (int64_t i = 0; i < W - 1; ++i) acc += wc[i] * window[i * C + c];
        const double y = acc * sigmoid(acc);
        qkv[t * C + c] = bf16 ? ref_round_bf16(y) : y;
        for (int64_t i = 0; i + 1 < W - 1; ++i) window[i * C + c] = window[(i + 1) * C + c];
        if (W > 1) window[(W - 2) * C + c] = raw[t * C + c];
      }
    }
  }
  // Steps 3-4: gate and beta (bottlenecks rounded between their two GEMMs).
  std::vector<double> fa(T * K), f(T * P), b(T * H), ga(T * K), z(T * P);
  ref_gemm(w.f_a_proj, K, D, x, T, D, fa.data(), K);
  round_all(fa);
  ref_gemm(w.f_b_proj, P, K, fa.data(), T, K, f.data(), P);
  round_all(f);
  ref_gemm(w.b_proj, H, D, x, T, D, b.data(), H);
  round_all(b);
  ref_gemm(w.g_a_proj, K, D, x, T, D, ga.data(), K);
  round_all(ga);
  ref_gemm(w.g_b_proj, P, K, ga.data(), T, K, z.data(), P);
  round_all(z);
  // Steps 5-7 per (segment, head), token by token: l2norm, decay, delta rule, output from the updated
  // state, gated RMS norm.
  std::vector<double> y(T * P);
#pragma omp parallel for collapse(2) schedule(dynamic) if (T * H * K * K > kParallelWork)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      double* Sh = recurrent[n] + h * K * K;
      std::vector<double> u(K), o(K);
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        const double* q = &qkv[t * C + h * K];
        const double* k = &qkv[t * C + P + h * K];
        const double* v = &qkv[t * C + 2 * P + h * K];
        double sq = 0.0, sk = 0.0;
        for (int64_t d = 0; d < K; ++d) sq += q[d] * q[d], sk += k[d] * k[d];
        const double iq = scale / std::sqrt(sq + 1e-6), ik = 1.0 / std::sqrt(sk + 1e-6);
        const double beta = sigmoid(b[t * H + h]);
        for (int64_t d = 0; d < K; ++d) {
          const double zz = f[t * P + h * K + d] + static_cast<double>(w.dt_bias[h * K + d]);
          const double g =
              -std::exp(static_cast<double>(w.A_log[h])) * (zz > 20.0 ? zz : std::log1p(std::exp(zz)));
          const double decay = std::exp(g);
          for (int64_t e = 0; e < K; ++e) Sh[d * K + e] *= decay;
        }
        for (int64_t e = 0; e < K; ++e) u[e] = v[e];
        for (int64_t d = 0; d < K; ++d) {
          const double kd = k[d] * ik;
          for (int64_t e = 0; e < K; ++e) u[e] -= Sh[d * K + e] * kd;
        }
        for (int64_t d = 0; d < K; ++d) {
          const double bk = beta * k[d] * ik;
          for (int64_t e = 0; e < K; ++e) Sh[d * K + e] += bk * u[e];
        }
        for (int64_t e = 0; e < K; ++e) o[e] = 0.0;
        for (int64_t d = 0; d < K; ++d) {
          const double qd = q[d] * iq;
          for (int64_t e = 0; e < K; ++e) o[e] += Sh[d * K + e] * qd;
        }
        if (bf16)
          for (int64_t e = 0; e < K; ++e) o[e] = ref_round_bf16(o[e]);
        double ss = 0.0;
        for (int64_t e = 0; e < K; ++e) ss += o[e] * o[e];
        const double inv = 1.0 / std::sqrt(ss / static_cast<double>(K) + cfg.rms_norm_eps);
        for (int64_t e = 0; e < K; ++e) {
          const double ye = o[e] * inv * w.o_norm[e] * sigmoid(z[t * P + h * K + e]);
          y[t * P + h * K + e] = bf16 ? ref_round_bf16(ye) : ye;
        }
      }
    }
  // Step 8.
  ref_gemm(w.o_proj, D, P, y.data(), T, P, out, D);
  if (bf16)
    for (int64_t i = 0; i < T * D; ++i) out[i] = ref_round_bf16(out[i]);
}

LayerReference reference_layer(const io::KimiLinearConfig& cfg, const models::KdaLayerWeights& w,
                               const std::vector<float>& hidden_states,
                               const std::vector<int32_t>& cu_seqlens,
                               const std::vector<float>& initial_recurrent_state,
                               const std::vector<float>& initial_conv_state) {
  const int64_t D = cfg.hidden_size, H = cfg.num_heads, K = cfg.head_dim, P = H * K,
                W = cfg.short_conv_kernel_size;
  const int64_t N = static_cast<int64_t>(cu_seqlens.size()) - 1, T = cu_seqlens.back(), C = 3 * P;
  LayerReference r;
  r.out.assign(T * D, 0.0);
  r.recurrent_state.assign(N * H * K * K, 0.0);
  r.conv_state.assign(N * (W - 1) * C, 0.0);
  for (size_t i = 0; i < initial_recurrent_state.size(); ++i)
    r.recurrent_state[i] = initial_recurrent_state[i];
  for (size_t i = 0; i < initial_conv_state.size(); ++i) r.conv_state[i] = initial_conv_state[i];
  const std::vector<double> x(hidden_states.begin(), hidden_states.begin() + T * D);
  std::vector<int64_t> cu(cu_seqlens.begin(), cu_seqlens.end());
  std::vector<double*> recurrent(N), conv(N);
  for (int64_t n = 0; n < N; ++n) {
    recurrent[n] = r.recurrent_state.data() + n * H * K * K;
    conv[n] = r.conv_state.data() + n * (W - 1) * C;
  }
  kda_reference_segments(cfg, ref_weights(w), x.data(), cu, recurrent, conv, r.out.data(), false);
  return r;
}

}  // namespace kda::testing
