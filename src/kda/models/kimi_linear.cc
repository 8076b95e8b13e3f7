#include "kda/models/kimi_linear.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kda/common/bf16.h"
#include "kda/common/isa_target.h"
#include "kda/io/packed_checkpoint.h"
#include "kda/kernels/kda/vec_math.h"

namespace kda::models {

namespace {

std::vector<float> concat(std::initializer_list<const std::vector<float>*> parts) {
  size_t n = 0;
  for (auto* p : parts) n += p->size();
  std::vector<float> out;
  out.reserve(n);
  for (auto* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

// bf16 mode rounds a parameter to bf16, as an HF bf16 load does (BF16 checkpoints stay as they are).
// A_log and dt_bias do not come through here: the HF model creates them as fp32 parameters, so a bf16 load
// keeps the checkpoint's values unrounded (spec, "Precision modes").
std::vector<float> param(const std::vector<float>& v, Precision p) {
  std::vector<float> out = v;
  if (p == Precision::BF16) round_bf16_inplace(out.data(), out.size());
  return out;
}

// The projections' names in a packed checkpoint (projections(), load()).
constexpr const char* kFusedProj = "qkv_fa_ga_b_proj";
constexpr const char* kFbProj = "f_b_proj";
constexpr const char* kGbProj = "g_b_proj";
constexpr const char* kOProj = "o_proj";

void check_size(const std::vector<float>& v, size_t n, const char* name) {
  if (v.size() != n)
    throw std::invalid_argument(std::string("KdaLayerWeights: ") + name + " has " + std::to_string(v.size()) +
                                " values, expected " + std::to_string(n));
}

// One (token, head) row of the gated RMS norm: y = o * rsqrt(mean(o^2) + eps) * w * sigmoid(z). kBf16
// applies the bf16 mode's rounding points: o as it is read, y as it is written (as bf16, the input
// o_proj takes, so no conversion pass follows); z comes as bf16.
template <bool kBf16>
[[gnu::always_inline]] inline void gated_norm_row(const float* o,
                                                  const std::conditional_t<kBf16, bf16_t, float>* z,
                                                  const float* w, int K, float eps,
                                                  std::conditional_t<kBf16, bf16_t, float>* y) {
  const auto rd = [](float x) { return kBf16 ? round_bf16(x) : x; };
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int d = 0; d < K; ++d) ss += rd(o[d]) * rd(o[d]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
#pragma omp simd
  for (int d = 0; d < K; ++d) {
    const float v =
        rd(o[d]) * inv * w[d] /
        (1.0f + kernels::portable::vecmath::exp_approx(-kernels::portable::vecmath::to_f32(z[d])));
    if constexpr (kBf16) {
      y[d] = f32_to_bf16(v);
    } else {
      y[d] = v;
    }
  }
}

// The rows compiled per ISA (KDA_TARGET_CLONES): the build targets no particular CPU, and this loop's
// vectorised exp is a visible part of the layer's non-GEMM time. gated_norm_row (and the portable
// vecmath functions, plain C++) are inlined into each clone.
KDA_TARGET_CLONES void gated_norm_rows_f32(const float* o, const float* z, const float* w, int K, float eps,
                                           float* y, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) gated_norm_row<false>(o + r * K, z + r * K, w, K, eps, y + r * K);
}

KDA_TARGET_CLONES void gated_norm_rows_bf16(const float* o, const bf16_t* z, const float* w, int K, float eps,
                                            bf16_t* y, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) gated_norm_row<true>(o + r * K, z + r * K, w, K, eps, y + r * K);
}

}  // namespace

void check_tensor_parallel(const io::KimiLinearConfig& cfg, int tp_size) {
  if (tp_size < 1) throw std::invalid_argument("--tp must be >= 1, got " + std::to_string(tp_size));
  if (cfg.num_heads % tp_size != 0)
    throw std::invalid_argument("tensor parallelism over " + std::to_string(tp_size) +
                                " ranks cannot split " + std::to_string(cfg.num_heads) +
                                " heads evenly (num_heads must be divisible by --tp)");
}

KdaLayerWeights KdaLayerWeights::load(const io::Checkpoint& ckpt, const io::KimiLinearConfig& cfg,
                                      int layer_idx, int tp_rank, int tp_size) {
  if (layer_idx < 0 || layer_idx >= cfg.num_hidden_layers)
    throw std::invalid_argument("layer " + std::to_string(layer_idx) + " is outside the model's " +
                                std::to_string(cfg.num_hidden_layers) + " decoder layers");
  if (!cfg.is_kda_layer(layer_idx))
    throw std::invalid_argument(
        "decoder layer " + std::to_string(layer_idx) +
        " (0-based) is not a KDA layer: linear_attn_config.kda_layers (1-based) does not list " +
        std::to_string(layer_idx + 1));
  check_tensor_parallel(cfg, tp_size);
  const int64_t D = cfg.hidden_size, H = cfg.num_heads, K = cfg.head_dim, P = H * K,
                W = cfg.short_conv_kernel_size;
  const int64_t h0 = tp_rank * H / tp_size, h1 = (tp_rank + 1) * H / tp_size;  // this rank's heads
  const int64_t p0 = h0 * K, p1 = h1 * K;                                      // and channels
  const std::string pre = "model.layers." + std::to_string(layer_idx) + ".self_attn.";
  auto full = [&](const char* name, std::vector<int64_t> shape) { return ckpt.load_f32(pre + name, shape); };
  auto part = [&](const char* name, std::vector<int64_t> shape, int dim, int64_t b, int64_t e) {
    return ckpt.load_f32_slice(pre + name, shape, dim, b, e);
  };
  KdaLayerWeights w;
  if (const auto scheme = io::packed_weights(ckpt)) {
    io::packed_for_load(ckpt, *scheme, tp_size);  // one rank: the whole layer
    w.q_conv1d = full("q_conv1d.weight", {P, 1, W});
    w.k_conv1d = full("k_conv1d.weight", {P, 1, W});
    w.v_conv1d = full("v_conv1d.weight", {P, 1, W});
    w.A_log = full("A_log", {1, 1, H, 1});
    w.dt_bias = full("dt_bias", {P});
    w.o_norm = full("o_norm.weight", {K});
    auto packed = [&](const char* name, int64_t in, int64_t out) {
      w.packed[name] = io::load_packed(ckpt, pre + name, *scheme, in, out);
    };
    packed(kFusedProj, D, 3 * P + 2 * K + H);
    packed(kFbProj, K, P);
    packed(kGbProj, K, P);
    packed(kOProj, P, D);
    return w;
  }
  w.q_proj = part("q_proj.weight", {P, D}, 0, p0, p1);
  w.k_proj = part("k_proj.weight", {P, D}, 0, p0, p1);
  w.v_proj = part("v_proj.weight", {P, D}, 0, p0, p1);
  w.q_conv1d = part("q_conv1d.weight", {P, 1, W}, 0, p0, p1);
  w.k_conv1d = part("k_conv1d.weight", {P, 1, W}, 0, p0, p1);
  w.v_conv1d = part("v_conv1d.weight", {P, 1, W}, 0, p0, p1);
  w.A_log = part("A_log", {1, 1, H, 1}, 2, h0, h1);
  w.dt_bias = part("dt_bias", {P}, 0, p0, p1);
  w.f_a_proj = full("f_a_proj.weight", {K, D});
  w.f_b_proj = part("f_b_proj.weight", {P, K}, 0, p0, p1);
  w.b_proj = part("b_proj.weight", {H, D}, 0, h0, h1);
  w.g_a_proj = full("g_a_proj.weight", {K, D});
  w.g_b_proj = part("g_b_proj.weight", {P, K}, 0, p0, p1);
  w.o_norm = full("o_norm.weight", {K});
  w.o_proj = part("o_proj.weight", {D, P}, 1, p0, p1);
  return w;
}

KdaLayerWeights KdaLayerWeights::shard(const io::KimiLinearConfig& cfg, int tp_rank, int tp_size) const {
  check_tensor_parallel(cfg, tp_size);
  if (tp_rank < 0 || tp_rank >= tp_size)
    throw std::invalid_argument("tensor-parallel rank " + std::to_string(tp_rank) + " outside [0, " +
                                std::to_string(tp_size) + ")");
  const int64_t D = cfg.hidden_size, H = cfg.num_heads, K = cfg.head_dim, P = H * K;
  const int64_t h0 = tp_rank * H / tp_size, h1 = (tp_rank + 1) * H / tp_size, p0 = h0 * K, p1 = h1 * K;
  // Rows [b, e) of a row-major matrix with `cols` columns.
  auto rows = [](const std::vector<float>& v, int64_t cols, int64_t b, int64_t e) {
    return std::vector<float>(v.begin() + b * cols, v.begin() + e * cols);
  };
  KdaLayerWeights s;
  const int64_t W = static_cast<int64_t>(q_conv1d.size()) / P;
  s.q_proj = rows(q_proj, D, p0, p1);
  s.k_proj = rows(k_proj, D, p0, p1);
  s.v_proj = rows(v_proj, D, p0, p1);
  s.q_conv1d = rows(q_conv1d, W, p0, p1);
  s.k_conv1d = rows(k_conv1d, W, p0, p1);
  s.v_conv1d = rows(v_conv1d, W, p0, p1);
  s.A_log = rows(A_log, 1, h0, h1);
  s.dt_bias = rows(dt_bias, 1, p0, p1);
  s.f_a_proj = f_a_proj;
  s.f_b_proj = rows(f_b_proj, K, p0, p1);
  s.b_proj = rows(b_proj, D, h0, h1);
  s.g_a_proj = g_a_proj;
  s.g_b_proj = rows(g_b_proj, K, p0, p1);
  s.o_norm = o_norm;
  s.o_proj.resize(static_cast<size_t>(D * (p1 - p0)));
  for (int64_t d = 0; d < D; ++d)
    std::copy(o_proj.begin() + d * P + p0, o_proj.begin() + d * P + p1, s.o_proj.begin() + d * (p1 - p0));
  return s;
}

KdaLayerWeights KdaLayerWeights::synthetic(const io::KimiLinearConfig& cfg, uint64_t seed) {
  const int64_t D = cfg.hidden_size, H = cfg.num_heads, K = cfg.head_dim, P = H * K,
                W = cfg.short_conv_kernel_size;
  std::mt19937_64 rng(seed);
  auto normal = [&](size_t n, double stddev) {
    std::normal_distribution<float> d(0.0f, static_cast<float>(stddev));
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
  };
  auto uniform = [&](size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
  };
  KdaLayerWeights w;
  const double sd = 1.0 / std::sqrt(static_cast<double>(D));
  w.q_proj = normal(P * D, sd);
  w.k_proj = normal(P * D, sd);
  w.v_proj = normal(P * D, sd);
  w.q_conv1d = normal(P * W, 0.5);
  w.k_conv1d = normal(P * W, 0.5);
  w.v_conv1d = normal(P * W, 0.5);
  w.A_log = uniform(H, 0.0f, std::log(16.0f));  // A in [1, 16], as the model initialises it
  w.dt_bias = normal(P, 0.5);
  w.f_a_proj = normal(K * D, sd);
  w.f_b_proj = normal(P * K, 1.0 / std::sqrt(static_cast<double>(K)));
  w.b_proj = normal(H * D, sd);
  w.g_a_proj = normal(K * D, sd);
  w.g_b_proj = normal(P * K, 1.0 / std::sqrt(static_cast<double>(K)));
  w.o_norm = uniform(K, 0.8f, 1.2f);
  w.o_proj = normal(D * P, 1.0 / std::sqrt(static_cast<double>(P)));
  return w;
}

namespace {

const KdaLayerWeights& checked(const KdaLayerWeights& w, const io::KimiLinearConfig& cfg, int tp_size) {
  check_tensor_parallel(cfg, tp_size);
  const size_t D = cfg.hidden_size, H = cfg.num_heads / tp_size, K = cfg.head_dim, P = H * K,
               W = cfg.short_conv_kernel_size;
  check_size(w.q_conv1d, P * W, "q_conv1d");
  check_size(w.k_conv1d, P * W, "k_conv1d");
  check_size(w.v_conv1d, P * W, "v_conv1d");
  check_size(w.A_log, H, "A_log");
  check_size(w.dt_bias, P, "dt_bias");
  check_size(w.o_norm, K, "o_norm");
  if (!w.packed.empty()) {
    // Packed: each projection is checked as it is built (make_linear), the fp32 ones stay empty.
    if (tp_size > 1) throw std::invalid_argument("KdaLayerWeights: packed projections on one rank only");
    return w;
  }
  check_size(w.q_proj, P * D, "q_proj");
  check_size(w.k_proj, P * D, "k_proj");
  check_size(w.v_proj, P * D, "v_proj");
  check_size(w.f_a_proj, K * D, "f_a_proj");
  check_size(w.f_b_proj, P * K, "f_b_proj");
  check_size(w.b_proj, H * D, "b_proj");
  check_size(w.g_a_proj, K * D, "g_a_proj");
  check_size(w.g_b_proj, P * K, "g_b_proj");
  check_size(w.o_proj, D * P, "o_proj");
  return w;
}

}  // namespace

KimiDeltaAttention::KimiDeltaAttention(const io::KimiLinearConfig& cfg, int layer_idx,
                                       const KdaLayerWeights& w, Precision precision,
                                       distributed::TensorParallel tp, Weights weights)
    : layer_idx_(layer_idx),
      precision_(precision),
      tp_(tp),
      D_(cfg.hidden_size),
      H_(cfg.num_heads / std::max(tp.size, 1)),
      K_(cfg.head_dim),
      P_(H_ * cfg.head_dim),
      W_(cfg.short_conv_kernel_size),
      eps_(cfg.rms_norm_eps),
      conv_w_(param(concat({&checked(w, cfg, tp.size).q_conv1d, &w.k_conv1d, &w.v_conv1d}), precision)),
      A_log_(w.A_log),
      dt_bias_(w.dt_bias),
      o_norm_w_(param(w.o_norm, precision)),
      proj_(layers::make_linear(
          w.packed, kFusedProj, D_, 3 * P_ + 2 * K_ + H_,
          [&] {
            return concat({&w.q_proj, &w.k_proj, &w.v_proj, &w.f_a_proj, &w.g_a_proj, &w.b_proj});
          },
          precision, weights)),
      f_b_(layers::make_linear(
          w.packed, kFbProj, K_, P_, [&] { return w.f_b_proj; }, precision, weights)),
      g_b_(layers::make_linear(
          w.packed, kGbProj, K_, P_, [&] { return w.g_b_proj; }, precision, weights)),
      o_proj_(layers::make_linear(
          w.packed, kOProj, P_, D_, [&] { return w.o_proj; }, precision, weights)),
      attn_(layers::RadixLinearAttention::Params{
          .layer_id = layer_idx,
          .num_q_heads = static_cast<int>(H_),
          .num_k_heads = static_cast<int>(H_),
          .num_v_heads = static_cast<int>(H_),
          .head_q_dim = static_cast<int>(K_),
          .head_k_dim = static_cast<int>(K_),
          .head_v_dim = static_cast<int>(K_),
          .conv_weights = conv_w_.data(),
          .conv_kernel = static_cast<int>(W_),
          .A_log = A_log_.data(),
          .dt_bias = dt_bias_.data(),
          .bf16_activations = precision == Precision::BF16,
      }) {
  if (tp.size > 1 && (!tp.comm || tp.comm->size() != tp.size || tp.comm->rank() != tp.rank))
    throw std::invalid_argument("KimiDeltaAttention: tensor-parallel rank " + std::to_string(tp.rank) +
                                " of " + std::to_string(tp.size) +
                                " needs a communicator of that size and rank");
}

std::unique_ptr<KimiDeltaAttention> KimiDeltaAttention::from_checkpoint(const io::Checkpoint& ckpt,
                                                                        const io::KimiLinearConfig& cfg,
                                                                        int layer_idx, Precision precision,
                                                                        distributed::TensorParallel tp,
                                                                        Weights weights) {
  io::packed_for_load(ckpt, weights, tp.size);  // a packed checkpoint's scheme and rank count, said first
  return std::make_unique<KimiDeltaAttention>(
      cfg, layer_idx, KdaLayerWeights::load(ckpt, cfg, layer_idx, tp.rank, tp.size), precision, tp, weights);
}

std::vector<std::pair<std::string, const layers::Linear*>> KimiDeltaAttention::projections() const {
  return {{kFusedProj, &proj_}, {kFbProj, &f_b_}, {kGbProj, &g_b_}, {kOProj, &o_proj_}};
}

int64_t KimiDeltaAttention::weight_bytes() const {
  return proj_.weight_bytes() + f_b_.weight_bytes() + g_b_.weight_bytes() + o_proj_.weight_bytes();
}

// The workspace a forward of T tokens uses: the fused projection's output, f, z, the kernel output o and
// the gated norm's y (bf16 where the mode stores them so).
void KimiDeltaAttention::fit_workspace(KdaWorkspace& ws, int64_t T) const {
  const auto n = [&](int64_t cols) { return static_cast<size_t>(T * cols); };
  const int64_t n_proj = 3 * P_ + 2 * K_ + H_;
  ws.o.resize(n(P_));
  if (precision_ == Precision::BF16) {
    ws.proj_bf16.resize(n(n_proj));
    ws.f_bf16.resize(n(P_));
    ws.z_bf16.resize(n(P_));
    ws.y_bf16.resize(n(P_));
  } else {
    ws.proj.resize(n(n_proj));
    ws.f.resize(n(P_));
    ws.z.resize(n(P_));
    ws.y.resize(n(P_));
  }
}

void KimiDeltaAttention::reserve(int64_t T, layers::attention::linear::LinearRecurrentAttnBackend& backend,
                                 KdaWorkspace* workspace) {
  if (T <= 0) return;
  KdaWorkspace& ws = workspace ? *workspace : own_ws_;
  if (ws.o.size() < static_cast<size_t>(T * P_)) fit_workspace(ws, T);
  for (const layers::Linear* l : {&proj_, &f_b_, &g_b_, &o_proj_}) l->reserve(T);
  backend.reserve(attn_, T);
}

void KimiDeltaAttention::forward(const float* hidden_states, int64_t T,
                                 const model_executor::ForwardBatch& forward_batch,
                                 mem_cache::RecurrentStatePool& pool, float* out, KdaWorkspace* workspace) {
  using model_executor::ForwardMode;
  forward_batch.validate();
  if (forward_batch.num_tokens() != T)
    throw std::invalid_argument("KimiDeltaAttention layer " + std::to_string(layer_idx_) + ": " +
                                std::to_string(T) + " hidden-state rows for a batch of " +
                                std::to_string(forward_batch.num_tokens()) + " tokens");
  const ForwardMode mode = forward_batch.forward_mode;
  if (mode == ForwardMode::IDLE || mode == ForwardMode::DUMMY_FIRST) {
    // Nothing to compute and no state to touch: the backend's answer for these modes is zeros.
    if (T > 0) std::memset(out, 0, sizeof(float) * T * D_);
    return;
  }
  if (mode == ForwardMode::DRAFT_EXTEND)
    throw std::runtime_error(std::string("forward mode ") + model_executor::to_string(mode) +
                             " (speculative decoding's draft extend) is not supported by the KDA backend");
  if (T == 0) return;

  KdaWorkspace& ws = workspace ? *workspace : own_ws_;
  const bool bf16 = precision_ == Precision::BF16;
  const int64_t n_proj = 3 * P_ + 2 * K_ + H_;
  // 1. q/k/v, f_a, g_a and b in one GEMM. In the bf16 mode its input conversion is the layer input's
  // rounding point (round to nearest even), and it writes bf16: each of its outputs is a rounding point.
  // 2. The gate bottlenecks f = W_fb (W_fa x), z = W_gb (W_ga x), in the bf16 mode bf16 in and out.
  // 3. conv + kernel through the backend.
  // Activations are fp32 or (bf16 mode) bf16 values stored as bf16: half the bytes written and read.
  fit_workspace(ws, T);
  const auto project_and_attend = [&](auto& proj, auto& f, auto& z) {
    auto* pr = proj.data();
    proj_.forward(hidden_states, T, D_, pr, n_proj);
    f_b_.forward(pr + 3 * P_, T, n_proj, f.data(), P_);
    g_b_.forward(pr + 3 * P_ + K_, T, n_proj, z.data(), P_);
    attn_(forward_batch,
          layers::attention::linear::LinearAttnInputs::of(pr, n_proj, f.data(), P_, pr + 3 * P_ + 2 * K_,
                                                          n_proj),
          pool, ws.o.data());
  };
  if (bf16) {
    project_and_attend(ws.proj_bf16, ws.f_bf16, ws.z_bf16);
  } else {
    project_and_attend(ws.proj, ws.f, ws.z);
  }
  // 4. gated RMS norm per (token, head): y = o * rsqrt(mean(o^2) + eps) * w * sigmoid(z). The bf16
  // rounding point of the kernel output o is applied as it is read here, and y's as it is written: y goes
  // to o_proj as bf16 without a conversion pass.
  const int64_t rows = T * H_;
  const float eps = static_cast<float>(eps_);
  const int K = static_cast<int>(K_);
  const float* w = o_norm_w_.data();
  // Static contiguous row ranges, one clone call per thread.
#pragma omp parallel if (rows > 256)
  {
    const int64_t nt = omp_get_num_threads(), th = omp_get_thread_num();
    const int64_t r0 = rows * th / nt, r1 = rows * (th + 1) / nt;
    if (bf16) {
      gated_norm_rows_bf16(ws.o.data(), ws.z_bf16.data(), w, K, eps, ws.y_bf16.data(), r0, r1);
    } else {
      gated_norm_rows_f32(ws.o.data(), ws.z.data(), w, K, eps, ws.y.data(), r0, r1);
    }
  }
  // 5. o_proj; under tensor parallelism each rank holds a partial sum over its channels.
  if (bf16)
    o_proj_.forward(ws.y_bf16.data(), T, P_, out, D_);
  else
    o_proj_.forward(ws.y.data(), T, out);
  if (tp_.size > 1) tp_.comm->allreduce_sum(out, static_cast<size_t>(T * D_));
  if (bf16) round_bf16_inplace(out, static_cast<size_t>(T * D_));
}

}  // namespace kda::models
