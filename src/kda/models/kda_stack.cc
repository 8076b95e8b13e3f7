#include "kda/models/kda_stack.h"

#include <cmath>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#include "kda/common/bf16.h"
#include "kda/common/seeded.h"
#include "kda/io/safetensors.h"
#include "kda/models/kimi_linear_model.h"

namespace kda::models {

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
                                              distributed::TensorParallel tp, int64_t vocab,
                                              Weights weights) {
  check_tensor_parallel(cfg, tp.size);
  std::unique_ptr<KdaStack> s(new KdaStack(cfg, precision, tp, weights));
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
      auto w = KdaLayerWeights::synthetic(cfg, seed + 1000ULL * static_cast<uint64_t>(l + 1));
      if (tp.size > 1) w = w.shard(cfg, tp.rank, tp.size);  // the same weights as TP 1, this rank's part
      s->layers_[l] = std::make_unique<KimiDeltaAttention>(cfg, s->layer_ids_[l], w, precision, tp, weights);
    } catch (...) {
#pragma omp critical
      err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
  s->init_head(nullptr, vocab, seed);
  return s;
}

std::unique_ptr<KdaStack> KdaStack::from_checkpoint(const std::filesystem::path& dir, int num_layers,
                                                    Precision precision, distributed::TensorParallel tp,
                                                    int64_t vocab, uint64_t seed, Weights weights) {
  const auto cfg = io::load_config(dir);
  check_tensor_parallel(cfg, tp.size);
  std::unique_ptr<KdaStack> s(new KdaStack(cfg, precision, tp, weights));
  s->layer_ids_ = select_layers(cfg, num_layers);
  const io::Checkpoint ckpt(dir);  // memory-mapped: only the tensors read below are touched
  for (const int id : s->layer_ids_) {
    s->layers_.push_back(KimiDeltaAttention::from_checkpoint(ckpt, cfg, id, precision, tp, weights));
    const std::string key = "model.layers." + std::to_string(id) + ".input_layernorm.weight";
    s->norm_w_.push_back(ckpt.contains(key) ? ckpt.load_f32(key, {cfg.hidden_size})
                                            : std::vector<float>(static_cast<size_t>(cfg.hidden_size), 1.0f));
  }
  s->init_head(&ckpt, vocab, seed);
  return s;
}

namespace {
constexpr const char* kEmbedKey = "model.embed_tokens.weight";
constexpr const char* kHeadKey = "lm_head.weight";
constexpr const char* kFinalNormKey = "model.norm.weight";
constexpr uint64_t kEmbedTable = 1, kHeadTable = 2;  // seeded_normals tables

int64_t rows_of(const io::Checkpoint& ckpt, const char* key) {
  const auto& t = ckpt.get(key);
  if (t.shape.size() != 2)
    throw std::runtime_error(std::string(key) + " in " + ckpt.root().string() + ": expected 2 dimensions");
  return t.shape[0];
}
}  // namespace

int64_t KdaStack::checkpoint_vocab(const std::filesystem::path& dir) {
  const io::Checkpoint ckpt(dir);
  if (ckpt.contains(kEmbedKey)) return rows_of(ckpt, kEmbedKey);
  if (ckpt.contains(kHeadKey)) return rows_of(ckpt, kHeadKey);
  return 0;
}

void KdaStack::init_head(const io::Checkpoint* ckpt, int64_t vocab, uint64_t seed) {
  const int64_t D = cfg_.hidden_size;
  const bool has_embed = ckpt && ckpt->contains(kEmbedKey), has_head = ckpt && ckpt->contains(kHeadKey);
  if (has_embed)
    vocab = rows_of(*ckpt, kEmbedKey);
  else if (has_head)
    vocab = rows_of(*ckpt, kHeadKey);
  if (vocab < 1) throw std::invalid_argument("--vocab must be >= 1, got " + std::to_string(vocab));
  vocab_ = vocab;
  const size_t n = static_cast<size_t>(vocab * D);
  auto seeded = [&](uint64_t table, float scale) {
    std::vector<float> w(n);
#pragma omp parallel for schedule(static)
    for (int64_t v = 0; v < vocab; ++v) {
      float* row = w.data() + v * D;
      seeded_normals(seed, table, v, D, row);
      for (int64_t d = 0; d < D; ++d) row[d] *= scale;
    }
    return w;
  };
  embed_ = has_embed ? ckpt->load_f32(kEmbedKey, {vocab, D}) : seeded(kEmbedTable, 1.0f);
  if (precision_ == Precision::BF16) round_bf16_inplace(embed_.data(), embed_.size());  // a bf16 parameter
  {
    const auto w = has_head ? ckpt->load_f32(kHeadKey, {vocab, D})
                            : seeded(kHeadTable, static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))));
    lm_head_ = std::make_unique<layers::Linear>(D, vocab, w, precision_);
  }
  final_norm_w_ = ckpt && ckpt->contains(kFinalNormKey) ? ckpt->load_f32(kFinalNormKey, {D})
                                                        : std::vector<float>(static_cast<size_t>(D), 1.0f);
}

void KdaStack::embed(const int32_t* tokens, int64_t T, float* x) const {
  const int64_t D = cfg_.hidden_size;
  for (int64_t t = 0; t < T; ++t) {
    if (tokens[t] < 0 || tokens[t] >= vocab_)
      throw std::out_of_range("token id " + std::to_string(tokens[t]) + " outside the vocabulary [0, " +
                              std::to_string(vocab_) + ")");
    std::memcpy(x + t * D, embed_.data() + static_cast<int64_t>(tokens[t]) * D, sizeof(float) * D);
  }
}

void KdaStack::next_tokens(const float* h, int64_t M, int32_t* tokens) {
  const int64_t D = cfg_.hidden_size;
  if (M == 0) return;
  head_in_.resize(static_cast<size_t>(M * D));
  logits_.resize(static_cast<size_t>(M * vocab_));
  // The stack keeps its norms in fp32 in either precision (it models the KDA layers alone).
  rms_norm_rows(h, M, D, final_norm_w_.data(), cfg_.rms_norm_eps, Precision::FP32, head_in_.data());
  lm_head_->forward(head_in_.data(), M, logits_.data());
  for (int64_t m = 0; m < M; ++m) {
    const float* l = logits_.data() + m * vocab_;
    int64_t best = 0;
    for (int64_t v = 1; v < vocab_; ++v)
      if (l[v] > l[best]) best = v;
    tokens[m] = static_cast<int32_t>(best);
  }
}

int64_t KdaStack::layer_weight_bytes() const {
  if (layers_.empty()) return 0;
  int64_t total = 0;
  for (const auto& l : layers_) total += l->weight_bytes();
  return total / static_cast<int64_t>(layers_.size());
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
  for (size_t l = 0; l < layers_.size(); ++l) {
    rms_norm_rows(out, T, D, norm_w_[l].data(), cfg_.rms_norm_eps, Precision::FP32, normed_.data());
    layers_[l]->forward(normed_.data(), T, fb, pool, attn_out_.data(), &ws_);
    for (size_t i = 0; i < n; ++i) out[i] += attn_out_[i];
  }
}

}  // namespace kda::models
