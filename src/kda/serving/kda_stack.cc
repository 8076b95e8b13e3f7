#include "kda/serving/kda_stack.h"

#include <cmath>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#include "kda/io/safetensors.h"

namespace kda::serving {

io::KimiLinearConfig kimi_linear_48b_config() {
  io::KimiLinearConfig c;
  c.hidden_size = 2304;
  c.rms_norm_eps = 1e-5;
  c.num_hidden_layers = 27;
  c.num_heads = 32;
  c.head_dim = 128;
  c.short_conv_kernel_size = 4;
  c.kda_layers = {1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26};
  c.full_attn_layers = {4, 8, 12, 16, 20, 24, 27};
  return c;
}

std::vector<int> KdaStack::select_layers(const io::KimiLinearConfig& cfg, int num_layers) {
  std::vector<int> ids = cfg.kda_layer_ids();
  if (ids.empty()) throw std::invalid_argument("the model has no KDA layer (linear_attn_config.kda_layers)");
  if (num_layers < 0 || num_layers > static_cast<int>(ids.size()))
    throw std::invalid_argument("--layers " + std::to_string(num_layers) + ": the model has " +
                                std::to_string(ids.size()) + " KDA layers (0 or omitted: all)");
  if (num_layers > 0) ids.resize(static_cast<size_t>(num_layers));
  return ids;
}

std::unique_ptr<KdaStack> KdaStack::synthetic(const io::KimiLinearConfig& cfg, int num_layers,
                                              Precision precision, uint64_t seed,
                                              distributed::TensorParallel tp) {
  models::check_tensor_parallel(cfg, tp.size);
  std::unique_ptr<KdaStack> s(new KdaStack(cfg, precision, tp));
  s->layer_ids_ = select_layers(cfg, num_layers);
  const int L = static_cast<int>(s->layer_ids_.size());
  s->layers_.resize(L);
  s->norm_w_.assign(L, std::vector<float>(static_cast<size_t>(cfg.hidden_size), 1.0f));
  // Drawing ~40 M normals per real-shape layer is the slow part of start-up; layers are independent
  // (each has its own seed), so they are built in parallel. Errors are carried out of the region.
  std::exception_ptr err;
#pragma omp parallel for schedule(dynamic, 1)
  for (int l = 0; l < L; ++l) {
    try {
      auto w = models::KdaLayerWeights::synthetic(cfg, seed + 1000ULL * static_cast<uint64_t>(l + 1));
      if (tp.size > 1) w = w.shard(cfg, tp.rank, tp.size);  // the same weights as TP 1, this rank's part
      s->layers_[l] = std::make_unique<models::KimiDeltaAttention>(cfg, s->layer_ids_[l], w, precision, tp);
    } catch (...) {
#pragma omp critical
      err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
  return s;
}

std::unique_ptr<KdaStack> KdaStack::from_checkpoint(const std::filesystem::path& dir, int num_layers,
                                                    Precision precision, distributed::TensorParallel tp) {
  const auto cfg = io::load_config(dir);
  models::check_tensor_parallel(cfg, tp.size);
  std::unique_ptr<KdaStack> s(new KdaStack(cfg, precision, tp));
  s->layer_ids_ = select_layers(cfg, num_layers);
  const io::Checkpoint ckpt(dir);  // memory-mapped: only the tensors read below are touched
  for (const int id : s->layer_ids_) {
    s->layers_.push_back(models::KimiDeltaAttention::from_checkpoint(ckpt, cfg, id, precision, tp));
    const std::string key = "model.layers." + std::to_string(id) + ".input_layernorm.weight";
    s->norm_w_.push_back(ckpt.contains(key) ? ckpt.load_f32(key, {cfg.hidden_size})
                                            : std::vector<float>(static_cast<size_t>(cfg.hidden_size), 1.0f));
  }
  return s;
}

int64_t KdaStack::slot_bytes(const io::KimiLinearConfig& cfg, int num_layers, Precision precision) {
  const int64_t H = cfg.num_heads, K = cfg.head_dim, W = cfg.short_conv_kernel_size;
  const int64_t rec = H * K * K * static_cast<int64_t>(sizeof(float));
  const int64_t conv = (W - 1) * 3 * H * K * (precision == Precision::BF16 ? 2 : 4);
  return num_layers * (rec + conv);
}

mem_cache::RecurrentStatePoolConfig KdaStack::pool_config(int64_t slots) const {
  mem_cache::RecurrentStatePoolConfig pc;
  pc.layer_ids = layer_ids_;
  pc.size = slots;
  pc.num_heads = cfg_.num_heads / tp_.size;
  pc.head_k_dim = cfg_.head_dim;
  pc.head_v_dim = cfg_.head_dim;
  pc.conv_kernel = cfg_.short_conv_kernel_size;
  pc.conv_dim = 3 * static_cast<int64_t>(cfg_.projection_size()) / tp_.size;
  pc.conv_dtype = precision_;  // bf16 mode keeps the conv state in bf16 (spec, "Precision modes")
  return pc;
}

void KdaStack::forward(const float* x, int64_t T, const model_executor::ForwardBatch& fb,
                       mem_cache::RecurrentStatePool& pool, float* out) {
  const int64_t D = cfg_.hidden_size;
  const size_t n = static_cast<size_t>(T * D);
  std::memcpy(out, x, sizeof(float) * n);
  normed_.resize(n);
  attn_out_.resize(n);
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  for (size_t l = 0; l < layers_.size(); ++l) {
    // The decoder layer's input RMSNorm, in fp32: y = x * rsqrt(mean(x^2) + eps) * w.
    const float* w = norm_w_[l].data();
#pragma omp parallel for schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; ++t) {
      const float* h = out + t * D;
      float* y = normed_.data() + t * D;
      float ss = 0.0f;
      for (int64_t d = 0; d < D; ++d) ss += h[d] * h[d];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
      for (int64_t d = 0; d < D; ++d) y[d] = h[d] * inv * w[d];
    }
    layers_[l]->forward(normed_.data(), T, fb, pool, attn_out_.data(), &ws_);
    for (size_t i = 0; i < n; ++i) out[i] += attn_out_[i];
  }
}

}  // namespace kda::serving
