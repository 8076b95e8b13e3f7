#include "support/model_reference.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>

#include "support/layer_reference.h"
#include "support/ref_math.h"

namespace kda::testing {

namespace {

using Quant = ModelReferenceOptions::Quant;
constexpr double kNoMargin = std::numeric_limits<double>::infinity();

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// The weights as one run of the reference reads them. Projection weights (KDA and MLA projections,
// experts, dense MLPs) take the quantization scheme when one is set, else the bf16 rounding in bf16
// mode; the other weights take the bf16 rounding but A_log, dt_bias and the router's correction bias,
// which are used as stored.
class RefWeights {
 public:
  enum Kind { AsStored, Rounded, Projection };

  RefWeights(const TensorMap& m, const ModelReferenceOptions& o) : m_(m), o_(o) {}

  const float* get(const std::string& key, const std::vector<int64_t>& shape, Kind kind) {
    const auto it = m_.find(key);
    if (it == m_.end()) throw std::invalid_argument("reference_model: missing tensor '" + key + "'");
    const io::StTensor& t = it->second;
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    if (t.shape != shape || static_cast<int64_t>(t.values.size()) != n)
      throw std::invalid_argument("reference_model: tensor '" + key + "' has shape " + shape_str(t.shape) +
                                  " (" + std::to_string(t.values.size()) + " values), expected " +
                                  shape_str(shape));
    if (kind == Projection && o_.quant != Quant::None) return quantized(key, t, shape.back());
    if (kind == AsStored || !o_.bf16) return t.values.data();
    std::vector<float>& r = owned_.emplace_back(t.values);
    for (float& x : r) x = round_bf16(x);
    return r.data();
  }

 private:
  // The engine's scheme in float64: symmetric, scale max|w| / qmax over each output channel (int8) or
  // each group of 32 inputs (int4), round to nearest.
  const float* quantized(const std::string& key, const io::StTensor& t, int64_t cols) {
    const int qmax = o_.quant == Quant::Int8 ? 127 : 7;
    const int64_t g = o_.quant == Quant::Int8 ? cols : 32;
    if (cols % g != 0)
      throw std::invalid_argument("reference_model: int4 needs the input size of '" + key +
                                  "' to be a multiple of 32, got " + std::to_string(cols));
    std::vector<float>& r = owned_.emplace_back(t.values.size());
    for (size_t k0 = 0; k0 < t.values.size(); k0 += g) {
      double amax = 0.0;
      for (int64_t k = 0; k < g; ++k) amax = std::max(amax, std::fabs(static_cast<double>(t.values[k0 + k])));
      const double s = amax / qmax;
      for (int64_t k = 0; k < g; ++k)
        r[k0 + k] = s > 0.0 ? static_cast<float>(std::nearbyint(t.values[k0 + k] / s) * s) : 0.0f;
    }
    return r.data();
  }

  const TensorMap& m_;
  const ModelReferenceOptions& o_;
  std::deque<std::vector<float>> owned_;
};

struct MlpW {
  const float *gate, *up, *down;
  int64_t inter;
};

struct LayerW {
  const float *in_norm = nullptr, *post_norm = nullptr;
  bool kda = false, moe = false;
  KdaRefWeights k{};
  const float *q = nullptr, *kva = nullptr, *kv_norm = nullptr, *kvb = nullptr, *o = nullptr;  // MLA
  MlpW mlp{};  // dense MLP or the shared experts
  bool shared = false;
  const float *router = nullptr, *bias = nullptr;
  std::vector<MlpW> experts;
};

// One sequence's caches: per KDA layer its recurrent and conv states, per MLA layer its cache rows
// (c-hat and k_pe, and the k_nope and v expanded from them).
struct SeqState {
  std::vector<std::vector<double>> S, conv, ckv, kpe, knope, v;
  int64_t len = 0;
};

struct StepOut {
  std::vector<double> hidden, logits;      // [n, D], [n, V] (logits only when asked)
  std::vector<std::vector<int32_t>> topk;  // per layer [n, k] (MoE layers)
  std::vector<double> margin;              // per token: min over MoE layers
};

class RefModel {
 public:
  RefModel(const io::KimiLinearConfig& cfg, const TensorMap& m, const ModelReferenceOptions& o)
      : cfg_(cfg), opts_(o), w_(m, opts_) {
    if (!cfg.has_model_fields)
      throw std::invalid_argument("reference_model: the config has no model fields (parse_model_config)");
    const int64_t D = cfg.hidden_size, H = cfg.num_heads, K = cfg.head_dim, P = H * K,
                  W = cfg.short_conv_kernel_size, V = cfg.vocab_size, Hm = cfg.num_attention_heads,
                  R = cfg.kv_lora_rank, r = cfg.qk_rope_head_dim, dn = cfg.qk_nope_head_dim,
                  dv = cfg.v_head_dim;
    kv_eps_ = o.kv_norm_eps > 0.0 ? o.kv_norm_eps : cfg.rms_norm_eps;
    using RW = RefWeights;
    embed_ = w_.get("model.embed_tokens.weight", {V, D}, RW::Rounded);
    norm_ = w_.get("model.norm.weight", {D}, RW::Rounded);
    lm_head_ = cfg.tie_word_embeddings ? embed_ : w_.get("lm_head.weight", {V, D}, RW::Rounded);
    for (int i = 0; i < cfg.num_hidden_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".", a = p + "self_attn.";
      LayerW l;
      l.in_norm = w_.get(p + "input_layernorm.weight", {D}, RW::Rounded);
      l.post_norm = w_.get(p + "post_attention_layernorm.weight", {D}, RW::Rounded);
      l.kda = cfg.is_kda_layer(i);
      if (l.kda) {
        auto proj = [&](const char* n, std::vector<int64_t> s) { return w_.get(a + n, s, RW::Projection); };
        auto conv = [&](const char* n) { return w_.get(a + n, {P, 1, W}, RW::Rounded); };
        l.k = {proj("q_proj.weight", {P, D}),
               proj("k_proj.weight", {P, D}),
               proj("v_proj.weight", {P, D}),
               conv("q_conv1d.weight"),
               conv("k_conv1d.weight"),
               conv("v_conv1d.weight"),
               w_.get(a + "A_log", {1, 1, H, 1}, RW::AsStored),
               w_.get(a + "dt_bias", {P}, RW::AsStored),
               proj("f_a_proj.weight", {K, D}),
               proj("g_a_proj.weight", {K, D}),
               proj("f_b_proj.weight", {P, K}),
               proj("g_b_proj.weight", {P, K}),
               proj("b_proj.weight", {H, D}),
               w_.get(a + "o_norm.weight", {K}, RW::Rounded),
               proj("o_proj.weight", {D, P})};
      } else {
        l.q = w_.get(a + "q_proj.weight", {Hm * (dn + r), D}, RW::Projection);
        l.kva = w_.get(a + "kv_a_proj_with_mqa.weight", {R + r, D}, RW::Projection);
        l.kv_norm = w_.get(a + "kv_a_layernorm.weight", {R}, RW::Rounded);
        l.kvb = w_.get(a + "kv_b_proj.weight", {Hm * (dn + dv), R}, RW::Projection);
        l.o = w_.get(a + "o_proj.weight", {D, Hm * dv}, RW::Projection);
      }
      l.moe = cfg.is_moe_layer(i);
      auto mlp = [&](const std::string& gate, const std::string& up, const std::string& down, int64_t I) {
        return MlpW{w_.get(gate, {I, D}, RW::Projection), w_.get(up, {I, D}, RW::Projection),
                    w_.get(down, {D, I}, RW::Projection), I};
      };
      if (l.moe) {
        const std::string m = p + "block_sparse_moe.";
        const int64_t E = cfg.num_experts, Ie = cfg.moe_intermediate_size, S = cfg.num_shared_experts;
        l.router = w_.get(m + "gate.weight", {E, D}, RW::Rounded);
        l.bias = w_.get(m + "gate.e_score_correction_bias", {E}, RW::AsStored);
        for (int64_t e = 0; e < E; ++e) {
          const std::string x = m + "experts." + std::to_string(e) + ".";
          l.experts.push_back(mlp(x + "w1.weight", x + "w3.weight", x + "w2.weight", Ie));
        }
        l.shared = S > 0;
        if (l.shared)
          l.mlp = mlp(m + "shared_experts.gate_proj.weight", m + "shared_experts.up_proj.weight",
                      m + "shared_experts.down_proj.weight", Ie * S);
      } else {
        l.mlp = mlp(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight",
                    cfg.intermediate_size);
      }
      layers_.push_back(std::move(l));
    }
  }

  SeqState empty_state() const {
    const int L = cfg_.num_hidden_layers;
    const int64_t H = cfg_.num_heads, K = cfg_.head_dim, W = cfg_.short_conv_kernel_size;
    SeqState s;
    s.S.resize(L);
    s.conv.resize(L);
    s.ckv.resize(L);
    s.kpe.resize(L);
    s.knope.resize(L);
    s.v.resize(L);
    for (int i = 0; i < L; ++i)
      if (layers_[i].kda) {
        s.S[i].assign(H * K * K, 0.0);
        s.conv[i].assign((W - 1) * 3 * H * K, 0.0);
      }
    return s;
  }

  // The tokens ids[cu[b] .. cu[b+1]) continue sequence seqs[b], for every b, through the whole decoder.
  void forward(const std::vector<SeqState*>& seqs, const int32_t* ids, const std::vector<int64_t>& cu,
               bool want_logits, StepOut& out) const {
    const int64_t D = cfg_.hidden_size, V = cfg_.vocab_size, T = cu.back();
    const int L = cfg_.num_hidden_layers;
    std::vector<double> h(T * D), a(T * D), y(T * D);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) h[t * D + d] = embed_[static_cast<int64_t>(ids[t]) * D + d];
    out.topk.assign(L, {});
    out.margin.assign(T, kNoMargin);
    for (int i = 0; i < L; ++i) {
      const LayerW& l = layers_[i];
      rms_norm(h.data(), T, D, l.in_norm, cfg_.rms_norm_eps, a.data());
      if (l.kda) {
        std::vector<double*> S, conv;
        for (SeqState* s : seqs) S.push_back(s->S[i].data()), conv.push_back(s->conv[i].data());
        kda_reference_segments(cfg_, l.k, a.data(), cu, S, conv, y.data(), opts_.bf16);
      } else {
        mla(l, i, seqs, a.data(), cu, y.data());
      }
      add_residual(h, y);
      rms_norm(h.data(), T, D, l.post_norm, cfg_.rms_norm_eps, a.data());
      if (l.moe)
        moe(l, a.data(), T, y.data(), out.topk[i], out.margin);
      else
        mlp(l.mlp, a.data(), T, y.data(), nullptr);
      add_residual(h, y);
    }
    for (size_t b = 0; b < seqs.size(); ++b) seqs[b]->len += cu[b + 1] - cu[b];
    out.hidden = h;
    if (want_logits) {
      rms_norm(h.data(), T, D, norm_, cfg_.rms_norm_eps, a.data());
      out.logits.assign(T * V, 0.0);
      ref_gemm(lm_head_, V, D, a.data(), T, D, out.logits.data(), V);
    }
  }

 private:
  double rb(double x) const { return opts_.bf16 ? ref_round_bf16(x) : x; }

  void add_residual(std::vector<double>& h, const std::vector<double>& y) const {
    for (size_t j = 0; j < h.size(); ++j) h[j] = rb(h[j] + y[j]);
  }

  // y = w * (x / sqrt(mean(x^2) + eps)) per row, rounded once in bf16 mode.
  void rms_norm(const double* x, int64_t n, int64_t d, const float* w, double eps, double* y) const {
    for (int64_t t = 0; t < n; ++t) {
      double ss = 0.0;
      for (int64_t j = 0; j < d; ++j) ss += x[t * d + j] * x[t * d + j];
      const double inv = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
      for (int64_t j = 0; j < d; ++j) y[t * d + j] = rb(w[j] * (x[t * d + j] * inv));
    }
  }

  void gemm(const float* W, int64_t rows, int64_t cols, const double* x, int64_t n, double* y) const {
    ref_gemm(W, rows, cols, x, n, cols, y, rows);
    if (opts_.bf16)
      for (int64_t j = 0; j < rows * n; ++j) y[j] = ref_round_bf16(y[j]);
  }

  // MLA (NoPE), the plain form: k_nope and v expanded from the (rounded) cache rows.
  void mla(const LayerW& l, int i, const std::vector<SeqState*>& seqs, const double* x,
           const std::vector<int64_t>& cu, double* out) const {
    const int64_t D = cfg_.hidden_size, Hm = cfg_.num_attention_heads, R = cfg_.kv_lora_rank,
                  r = cfg_.qk_rope_head_dim, dn = cfg_.qk_nope_head_dim, dv = cfg_.v_head_dim, dq = dn + r,
                  T = cu.back();
    std::vector<double> q(T * Hm * dq), kva(T * (R + r)), chat(T * R), kv(T * Hm * (dn + dv));
    gemm(l.q, Hm * dq, D, x, T, q.data());
    gemm(l.kva, R + r, D, x, T, kva.data());
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> c(kva.begin() + t * (R + r), kva.begin() + t * (R + r) + R);
      rms_norm(c.data(), 1, R, l.kv_norm, kv_eps_, chat.data() + t * R);
    }
    gemm(l.kvb, Hm * (dn + dv), R, chat.data(), T, kv.data());
    std::vector<int64_t> base(seqs.size());
    for (size_t b = 0; b < seqs.size(); ++b) {
      SeqState& s = *seqs[b];
      base[b] = static_cast<int64_t>(s.ckv[i].size()) / R;
      for (int64_t t = cu[b]; t < cu[b + 1]; ++t) {
        s.ckv[i].insert(s.ckv[i].end(), chat.begin() + t * R, chat.begin() + (t + 1) * R);
        s.kpe[i].insert(s.kpe[i].end(), kva.begin() + t * (R + r) + R, kva.begin() + (t + 1) * (R + r));
        for (int64_t hh = 0; hh < Hm; ++hh) {
          const auto row = kv.begin() + t * Hm * (dn + dv) + hh * (dn + dv);
          s.knope[i].insert(s.knope[i].end(), row, row + dn);
          s.v[i].insert(s.v[i].end(), row + dn, row + dn + dv);
        }
      }
    }
    const double scale = 1.0 / std::sqrt(static_cast<double>(dq));
    std::vector<int64_t> seq_of(T);
    for (size_t b = 0; b < seqs.size(); ++b)
      for (int64_t t = cu[b]; t < cu[b + 1]; ++t) seq_of[t] = static_cast<int64_t>(b);
    std::vector<double> o(T * Hm * dv);
    const int64_t work = T * Hm * (base.back() + T) * (dq + dv);
#pragma omp parallel for collapse(2) schedule(dynamic) if (work > (int64_t{1} << 16))
    for (int64_t t = 0; t < T; ++t)
      for (int64_t hh = 0; hh < Hm; ++hh) {
        const int64_t b = seq_of[t], last = base[b] + (t - cu[b]);  // cache rows 0..last
        const SeqState& s = *seqs[b];
        const double* qn = &q[t * Hm * dq + hh * dq];
        const double* qp = qn + dn;
        std::vector<double> score(last + 1);
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= last; ++j) {
          const double* kn = &s.knope[i][(j * Hm + hh) * dn];
          const double* kp = &s.kpe[i][j * r];
          double acc = 0.0;
          for (int64_t e = 0; e < dn; ++e) acc += qn[e] * kn[e];
          for (int64_t e = 0; e < r; ++e) acc += qp[e] * kp[e];
          score[j] = acc * scale;
          mx = std::max(mx, score[j]);
        }
        double sum = 0.0;
        for (double& e : score) sum += (e = std::exp(e - mx));
        double* oh = &o[t * Hm * dv + hh * dv];
        for (int64_t j = 0; j <= last; ++j) {
          const double p = score[j] / sum;
          const double* vj = &s.v[i][(j * Hm + hh) * dv];
          for (int64_t e = 0; e < dv; ++e) oh[e] += p * vj[e];
        }
        for (int64_t e = 0; e < dv; ++e) oh[e] = rb(oh[e]);
      }
    gemm(l.o, D, Hm * dv, o.data(), T, out);
  }

  // E(x) = W_down(silu(W_gate x) * (W_up x)); rows[j] selects the tokens when given.
  void mlp(const MlpW& m, const double* x, int64_t n, double* out, const std::vector<int64_t>* rows) const {
    const int64_t D = cfg_.hidden_size, I = m.inter;
    std::vector<double> xs;
    if (rows) {
      xs.resize(n * D);
      for (int64_t j = 0; j < n; ++j)
        std::copy(x + (*rows)[j] * D, x + ((*rows)[j] + 1) * D, xs.begin() + j * D);
      x = xs.data();
    }
    std::vector<double> g(n * I), u(n * I);
    gemm(m.gate, I, D, x, n, g.data());
    gemm(m.up, I, D, x, n, u.data());
    for (int64_t j = 0; j < n * I; ++j) g[j] = rb(g[j] * sigmoid(g[j]) * u[j]);
    gemm(m.down, D, I, g.data(), n, out);
  }

  void moe(const LayerW& l, const double* x, int64_t T, double* out, std::vector<int32_t>& topk,
           std::vector<double>& margin) const {
    const int64_t D = cfg_.hidden_size, E = cfg_.num_experts, k = cfg_.num_experts_per_token;
    std::vector<double> logits(T * E);
    ref_gemm(l.router, E, D, x, T, D, logits.data(), E);
    topk.assign(T * k, 0);
    std::vector<double> wt(T * k);
    std::vector<std::vector<int64_t>> rows(E);
    std::vector<std::vector<double>> rw(E);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> s(E), c(E);
      for (int64_t e = 0; e < E; ++e) {
        s[e] = sigmoid(logits[t * E + e]);
        c[e] = s[e] + static_cast<double>(l.bias[e]);
      }
      std::vector<int32_t> idx(E);
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(), [&](int32_t p, int32_t q) { return c[p] > c[q]; });
      if (k < E) margin[t] = std::min(margin[t], c[idx[k - 1]] - c[idx[k]]);
      const std::vector<double>& mix = opts_.combine == RefCombine::Biased ? c : s;
      double sum = 0.0;
      for (int64_t j = 0; j < k; ++j) sum += mix[idx[j]];
      const bool renorm = cfg_.moe_renormalize && k > 1;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = idx[j];
        topk[t * k + j] = e;
        rows[e].push_back(t);
        rw[e].push_back((renorm ? mix[e] / sum : mix[e]) * cfg_.routed_scaling_factor);
      }
    }
    std::fill(out, out + T * D, 0.0);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = static_cast<int64_t>(rows[e].size());
      if (n == 0) continue;
      std::vector<double> ye(n * D);
      mlp(l.experts[e], x, n, ye.data(), &rows[e]);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) out[rows[e][j] * D + d] += rw[e][j] * ye[j * D + d];
    }
    if (l.shared) {
      std::vector<double> ys(T * D);
      mlp(l.mlp, x, T, ys.data(), nullptr);
      for (int64_t j = 0; j < T * D; ++j) out[j] += ys[j];
    }
    for (int64_t j = 0; j < T * D; ++j) out[j] = rb(out[j]);
  }

  const io::KimiLinearConfig& cfg_;
  ModelReferenceOptions opts_;
  RefWeights w_;
  double kv_eps_ = 0.0;
  const float *embed_ = nullptr, *norm_ = nullptr, *lm_head_ = nullptr;
  std::vector<LayerW> layers_;
};

}  // namespace

ModelReference reference_model(const io::KimiLinearConfig& cfg, const TensorMap& w,
                               const std::vector<int32_t>& input_ids, const std::vector<int32_t>& cu_seqlens,
                               const ModelReferenceOptions& opts) {
  const int64_t T = static_cast<int64_t>(input_ids.size());
  std::vector<int64_t> cu(cu_seqlens.begin(), cu_seqlens.end());
  if (cu.empty()) cu = {0, T};
  if (cu.size() < 2 || cu.front() != 0 || cu.back() != T)
    throw std::invalid_argument("reference_model: cu_seqlens must run from 0 to the " + std::to_string(T) +
                                " input ids");
  for (size_t b = 1; b < cu.size(); ++b)
    if (cu[b] < cu[b - 1])
      throw std::invalid_argument("reference_model: cu_seqlens decrease at entry " + std::to_string(b));
  for (int64_t t = 0; t < T; ++t)
    if (input_ids[t] < 0 || input_ids[t] >= cfg.vocab_size)
      throw std::invalid_argument("reference_model: token id " + std::to_string(input_ids[t]) + " at " +
                                  std::to_string(t) + " is outside [0, " + std::to_string(cfg.vocab_size) +
                                  ")");
  const RefModel model(cfg, w, opts);
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
  std::vector<SeqState> states;
  for (int64_t n = 0; n < N; ++n) states.push_back(model.empty_state());
  std::vector<SeqState*> ptrs;
  for (auto& s : states) ptrs.push_back(&s);
  StepOut step;
  model.forward(ptrs, input_ids.data(), cu, true, step);

  ModelReference r;
  r.logits = std::move(step.logits);
  r.hidden_final = std::move(step.hidden);
  r.routing_min_margin = kNoMargin;
  for (double m : step.margin) r.routing_min_margin = std::min(r.routing_min_margin, m);
  const int64_t R = cfg.kv_lora_rank, rr = cfg.qk_rope_head_dim;
  for (int i = 0; i < cfg.num_hidden_layers; ++i) {
    if (cfg.is_kda_layer(i)) {
      auto& S = r.kda_recurrent_state[i];
      auto& C = r.kda_conv_state[i];
      for (const auto& s : states) {
        S.insert(S.end(), s.S[i].begin(), s.S[i].end());
        C.insert(C.end(), s.conv[i].begin(), s.conv[i].end());
      }
    } else {
      auto& ckv = r.mla_ckv[i];
      auto& kpe = r.mla_kpe[i];
      ckv.reserve(T * R);
      kpe.reserve(T * rr);
      for (const auto& s : states) {
        ckv.insert(ckv.end(), s.ckv[i].begin(), s.ckv[i].end());
        kpe.insert(kpe.end(), s.kpe[i].begin(), s.kpe[i].end());
      }
    }
    if (cfg.is_moe_layer(i)) r.moe_topk[i] = std::move(step.topk[i]);
  }
  return r;
}

std::vector<int32_t> draw_clear_tokens(const io::KimiLinearConfig& cfg, const TensorMap& w,
                                       const std::vector<int32_t>& seq_lens, uint64_t seed, double margin,
                                       bool bf16_too) {
  ModelReferenceOptions bf;
  bf.bf16 = true;
  const RefModel exact(cfg, w, {});
  std::unique_ptr<RefModel> emulated;
  if (bf16_too) emulated = std::make_unique<RefModel>(cfg, w, bf);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(cfg.vocab_size - 1));
  // Candidates are tried kBatch at a time, each continuing a copy of the sequence's states, so that one
  // pass over the weights serves several draws; the bf16 emulation runs only the candidates float64
  // clears, and the first candidate in draw order that both clear is kept.
  constexpr int kBatch = 8;
  constexpr int kMaxDraws = 4000;
  auto run = [](const RefModel& m, const SeqState& from, const std::vector<int32_t>& cand,
                std::vector<SeqState>& states, StepOut& out) {
    states.assign(cand.size(), from);
    std::vector<SeqState*> ptrs;
    std::vector<int64_t> cu = {0};
    for (auto& s : states) ptrs.push_back(&s), cu.push_back(static_cast<int64_t>(cu.size()));
    m.forward(ptrs, cand.data(), cu, false, out);
  };
  std::vector<int32_t> ids;
  for (size_t b = 0; b < seq_lens.size(); ++b) {
    if (seq_lens[b] < 0) throw std::invalid_argument("draw_clear_tokens: negative sequence length");
    SeqState se = exact.empty_state(), sb = emulated ? emulated->empty_state() : SeqState{};
    for (int32_t pos = 0; pos < seq_lens[b]; ++pos) {
      bool found = false;
      for (int tries = 0; tries < kMaxDraws && !found; tries += kBatch) {
        std::vector<int32_t> cand(kBatch);
        for (auto& c : cand) c = pick(rng);
        std::vector<SeqState> ce, cb;
        StepOut oe, ob;
        run(exact, se, cand, ce, oe);
        std::vector<int32_t> clear, which;
        for (int j = 0; j < kBatch; ++j)
          if (oe.margin[j] >= margin) clear.push_back(cand[j]), which.push_back(j);
        if (clear.empty()) continue;
        if (emulated) run(*emulated, sb, clear, cb, ob);
        for (size_t j = 0; j < clear.size() && !found; ++j)
          if (!emulated || ob.margin[j] >= margin) {
            found = true;
            ids.push_back(clear[j]);
            se = std::move(ce[which[j]]);
            if (emulated) sb = std::move(cb[j]);
          }
      }
      if (!found)
        throw std::runtime_error("draw_clear_tokens: no token in " + std::to_string(kMaxDraws) +
                                 " draws keeps every routing margin >= " + std::to_string(margin) +
                                 " at position " + std::to_string(pos) + " of sequence " + std::to_string(b));
    }
  }
  return ids;
}

}  // namespace kda::testing
