#include "support/mla_reference.h"

#include <cmath>

#include "kda/common/bf16.h"

namespace kda::testing {
namespace {

double rnd(double v, bool on) { return on ? static_cast<double>(round_bf16(static_cast<float>(v))) : v; }

std::vector<double> widen(const std::vector<float>& v, bool bf16) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = rnd(v[i], bf16);
  return out;
}

// y [N, out] = x [N, in] W^T, W [out, in].
std::vector<double> matmul(const std::vector<double>& x, int64_t N, int64_t in, const std::vector<double>& W,
                           int64_t out, bool bf16) {
  std::vector<double> y(static_cast<size_t>(N * out));
  for (int64_t t = 0; t < N; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0.0;
      for (int64_t i = 0; i < in; ++i) acc += x[t * in + i] * W[o * in + i];
      y[t * out + o] = rnd(acc, bf16);
    }
  return y;
}

}  // namespace

MlaReference reference_mla(const io::KimiLinearConfig& cfg, const models::MlaLayerWeights& w, const float* x,
                           int64_t N, bool bf16, double kv_norm_eps) {
  const int64_t D = cfg.hidden_size, Hm = cfg.num_attention_heads, dn = cfg.qk_nope_head_dim,
                dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim, R = cfg.kv_lora_rank;
  const double eps = kv_norm_eps > 0.0 ? kv_norm_eps : cfg.rms_norm_eps;
  std::vector<double> xd(static_cast<size_t>(N * D));
  for (int64_t i = 0; i < N * D; ++i) xd[i] = rnd(x[i], bf16);
  const auto q = matmul(xd, N, D, widen(w.q_proj, bf16), Hm * (dn + dr), bf16);
  const auto a = matmul(xd, N, D, widen(w.kv_a_proj_with_mqa, bf16), R + dr, bf16);
  const auto nw = widen(w.kv_a_layernorm, bf16);
  MlaReference ref;
  ref.ckv.resize(static_cast<size_t>(N * R));
  ref.kpe.resize(static_cast<size_t>(N * dr));
  for (int64_t t = 0; t < N; ++t) {
    double ss = 0.0;
    for (int64_t j = 0; j < R; ++j) ss += a[t * (R + dr) + j] * a[t * (R + dr) + j];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(R) + eps);
    for (int64_t j = 0; j < R; ++j) ref.ckv[t * R + j] = rnd(a[t * (R + dr) + j] * inv * nw[j], bf16);
    for (int64_t j = 0; j < dr; ++j) ref.kpe[t * dr + j] = a[t * (R + dr) + R + j];
  }
  const auto kv = matmul(ref.ckv, N, R, widen(w.kv_b_proj, bf16), Hm * (dn + dv), bf16);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dn + dr));
  std::vector<double> o(static_cast<size_t>(N * Hm * dv), 0.0), p(static_cast<size_t>(N));
  const int64_t kvw = Hm * (dn + dv), qw = Hm * (dn + dr);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < Hm; ++h) {
      const double* qt = q.data() + t * qw + h * (dn + dr);
      double m = -INFINITY;
      for (int64_t s = 0; s <= t; ++s) {
        const double* k = kv.data() + s * kvw + h * (dn + dv);
        double dot = 0.0;
        for (int64_t j = 0; j < dn; ++j) dot += qt[j] * k[j];
        for (int64_t j = 0; j < dr; ++j) dot += qt[dn + j] * ref.kpe[s * dr + j];
        p[s] = dot * scale;
        m = std::max(m, p[s]);
      }
      double sum = 0.0;
      for (int64_t s = 0; s <= t; ++s) sum += (p[s] = std::exp(p[s] - m));
      for (int64_t j = 0; j < dv; ++j) {
        double acc = 0.0;
        for (int64_t s = 0; s <= t; ++s) acc += p[s] / sum * kv[s * kvw + h * (dn + dv) + dn + j];
        o[t * Hm * dv + h * dv + j] = rnd(acc, bf16);
      }
    }
  ref.out = matmul(o, N, Hm * dv, widen(w.o_proj, bf16), D, bf16);
  return ref;
}

io::KimiLinearConfig mla_test_config(int64_t hidden, int heads, int qk_nope, int qk_rope, int v_head,
                                     int kv_lora) {
  io::KimiLinearConfig c;
  c.hidden_size = hidden;
  c.rms_norm_eps = 1e-5;
  c.num_hidden_layers = 2;
  c.num_heads = 2;
  c.head_dim = 16;
  c.short_conv_kernel_size = 4;
  c.kda_layers = {1};
  c.full_attn_layers = {2};
  c.has_model_fields = true;
  c.vocab_size = 64;
  c.num_attention_heads = heads;
  c.num_key_value_heads = heads;
  c.kv_lora_rank = kv_lora;
  c.qk_nope_head_dim = qk_nope;
  c.qk_rope_head_dim = qk_rope;
  c.v_head_dim = v_head;
  c.intermediate_size = 32;
  return c;
}

}  // namespace kda::testing
