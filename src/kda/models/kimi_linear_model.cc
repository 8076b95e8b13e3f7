#include "kda/models/kimi_linear_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "kda/common/bf16.h"
#include "kda/common/isa_target.h"
#include "kda/common/weight_buffer.h"
#include "kda/kernels/gemm/bf16_amx.h"
#include "kda/layers/bf16_vnni_rows.h"

namespace kda::models {

namespace {
std::string str(int64_t v) { return std::to_string(v); }

// h += x, then h rounded to bf16 in the bf16 mode (the residual stream after every addition).
void add_residual(float* h, const float* x, size_t n, Precision precision) {
  if (precision == Precision::BF16) {
#pragma omp parallel for schedule(static) if (n > (1u << 16))
    for (size_t i = 0; i < n; ++i) h[i] = round_bf16(h[i] + x[i]);
  } else {
#pragma omp parallel for schedule(static) if (n > (1u << 16))
    for (size_t i = 0; i < n; ++i) h[i] += x[i];
  }
}
}  // namespace

namespace {
// One row: its sum of squares in 16 interleaved lanes (element d into lane d % 16, each lane summed in
// order, then the lanes folded in halves), an order the vector units run as written and that no ISA
// changes; a single running sum was a chain of dependent adds, the norm's whole cost.
KDA_TARGET_CLONES void rms_norm_row(const float* h, int64_t D, const float* w, float eps, bool bf16,
                                    float* o) {
  constexpr int64_t kLanes = 16;
  float lane[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lane[j] += h[d + j] * h[d + j];
  for (int64_t j = 0; d + j < D; ++j) lane[j] += h[d + j] * h[d + j];
  for (int64_t half = kLanes / 2; half > 0; half /= 2)
    for (int64_t j = 0; j < half; ++j) lane[j] += lane[j + half];
  const float inv = 1.0f / std::sqrt(lane[0] / static_cast<float>(D) + eps);
  if (bf16)
    for (int64_t i = 0; i < D; ++i) o[i] = round_bf16(w[i] * (h[i] * inv));
  else
    for (int64_t i = 0; i < D; ++i) o[i] = w[i] * (h[i] * inv);
}
}  // namespace

void rms_norm_rows(const float* x, int64_t T, int64_t D, const float* w, double eps, Precision precision,
                   float* y) {
  const bool bf16 = precision == Precision::BF16;
  const float feps = static_cast<float>(eps);
#pragma omp parallel for schedule(static) if (T > 16)
  for (int64_t t = 0; t < T; ++t) rms_norm_row(x + t * D, D, w, feps, bf16, y + t * D);
}

int model_layer_count(const io::KimiLinearConfig& cfg, int num_layers) {
  if (num_layers < 0 || num_layers > cfg.num_hidden_layers)
    throw std::invalid_argument("num_layers " + str(num_layers) + ": the model has " +
                                str(cfg.num_hidden_layers) + " decoder layers (0: all)");
  return num_layers == 0 ? cfg.num_hidden_layers : num_layers;
}

// ---------------------------------------------------------------------------------------------------
// KimiDecoderLayer

KimiDecoderLayer::KimiDecoderLayer(int layer_idx, std::vector<float> input_layernorm,
                                   std::vector<float> post_attention_layernorm,
                                   std::unique_ptr<KimiDeltaAttention> kda,
                                   std::unique_ptr<KimiMLAAttention> mla, std::unique_ptr<KimiMLP> mlp,
                                   std::unique_ptr<KimiMoE> moe)
    : layer_idx_(layer_idx),
      input_layernorm_(std::move(input_layernorm)),
      post_attention_layernorm_(std::move(post_attention_layernorm)),
      kda_(std::move(kda)),
      mla_(std::move(mla)),
      mlp_(std::move(mlp)),
      moe_(std::move(moe)) {
  if ((kda_ != nullptr) == (mla_ != nullptr))
    throw std::invalid_argument("decoder layer " + str(layer_idx) + ": exactly one of KDA and MLA attention");
  if ((mlp_ != nullptr) == (moe_ != nullptr))
    throw std::invalid_argument("decoder layer " + str(layer_idx) + ": exactly one of a dense MLP and a MoE");
}

int64_t KimiDecoderLayer::weight_bytes() const {
  const int64_t norms = static_cast<int64_t>(input_layernorm_.size() + post_attention_layernorm_.size()) * 4;
  return norms + (kda_ ? kda_->weight_bytes() : mla_->weight_bytes()) +
         (mlp_ ? mlp_->weight_bytes() : moe_->weight_bytes());
}

int64_t KimiDecoderLayer::active_weight_bytes() const {
  const int64_t norms = static_cast<int64_t>(input_layernorm_.size() + post_attention_layernorm_.size()) * 4;
  return norms + (kda_ ? kda_->weight_bytes() : mla_->weight_bytes()) +
         (mlp_ ? mlp_->weight_bytes() : moe_->active_weight_bytes());
}

void KimiDecoderLayer::forward(float* h, int64_t T, const model_executor::ForwardBatch& fb,
                               mem_cache::MemoryPools& pools, double eps, Precision precision,
                               KdaWorkspace& ws, float* normed, float* tmp) {
  const int64_t D = static_cast<int64_t>(input_layernorm_.size());
  const size_t n = static_cast<size_t>(T * D);
  rms_norm_rows(h, T, D, input_layernorm_.data(), eps, precision, normed);
  if (kda_)
    kda_->forward(normed, T, fb, pools.recurrent_state_pool, tmp, &ws);
  else
    mla_->forward(normed, T, fb, pools, tmp);
  add_residual(h, tmp, n, precision);
  rms_norm_rows(h, T, D, post_attention_layernorm_.data(), eps, precision, normed);
  if (mlp_)
    mlp_->forward(normed, T, tmp);
  else
    moe_->forward(normed, T, tmp);
  add_residual(h, tmp, n, precision);
}

void KimiDecoderLayer::reserve(int64_t T, layers::attention::linear::LinearRecurrentAttnBackend& backend,
                               KdaWorkspace& ws) {
  if (kda_)
    kda_->reserve(T, backend, &ws);
  else
    mla_->reserve(T);
  if (mlp_)
    mlp_->reserve(T);
  else
    moe_->reserve(T);
}

// ---------------------------------------------------------------------------------------------------
// KimiLinearModel

KimiLinearModel::KimiLinearModel(const io::KimiLinearConfig& cfg, Precision precision,
                                 std::vector<float> embed_tokens, int64_t vocab,
                                 std::vector<std::unique_ptr<KimiDecoderLayer>> layers,
                                 std::vector<float> norm)
    : cfg_(cfg), precision_(precision), vocab_(vocab), layers_(std::move(layers)), norm_(std::move(norm)) {
  const int64_t D = cfg.hidden_size;
  if (static_cast<int64_t>(embed_tokens.size()) != vocab * D)
    throw std::invalid_argument("embed_tokens holds " + str(static_cast<int64_t>(embed_tokens.size())) +
                                " values, expected [" + str(vocab) + ", " + str(D) + "]");
  if (static_cast<int64_t>(norm_.size()) != D)
    throw std::invalid_argument("model.norm holds " + str(static_cast<int64_t>(norm_.size())) +
                                " values, expected " + str(D));
  if (precision == Precision::BF16) {
    embed16_.resize(embed_tokens.size());
    f32_to_bf16_array(embed_tokens.data(), embed16_.data(), embed_tokens.size());
    embed16_view_ = embed16_.data();
  } else {
    embed_ = std::move(embed_tokens);
  }
}

KimiLinearModel::KimiLinearModel(const io::KimiLinearConfig& cfg, std::vector<bf16_t> embed_tokens,
                                 int64_t vocab, std::vector<std::unique_ptr<KimiDecoderLayer>> layers,
                                 std::vector<float> norm)
    : cfg_(cfg),
      precision_(Precision::BF16),
      vocab_(vocab),
      embed16_(std::move(embed_tokens)),
      embed16_view_(embed16_.data()),
      layers_(std::move(layers)),
      norm_(std::move(norm)) {
  const int64_t D = cfg.hidden_size;
  if (static_cast<int64_t>(embed16_.size()) != vocab * D)
    throw std::invalid_argument("embed_tokens holds " + str(static_cast<int64_t>(embed16_.size())) +
                                " values, expected [" + str(vocab) + ", " + str(D) + "]");
  if (static_cast<int64_t>(norm_.size()) != D)
    throw std::invalid_argument("model.norm holds " + str(static_cast<int64_t>(norm_.size())) +
                                " values, expected " + str(D));
}

KimiLinearModel::KimiLinearModel(const io::KimiLinearConfig& cfg, const bf16_t* embed_tokens,
                                 std::shared_ptr<const void> owner, int64_t vocab,
                                 std::vector<std::unique_ptr<KimiDecoderLayer>> layers,
                                 std::vector<float> norm)
    : cfg_(cfg),
      precision_(Precision::BF16),
      vocab_(vocab),
      embed16_view_(embed_tokens),
      embed_owner_(std::move(owner)),
      layers_(std::move(layers)),
      norm_(std::move(norm)) {
  if (!embed16_view_ || !embed_owner_)
    throw std::invalid_argument("KimiLinearModel: a mapped embedding table needs its rows and their owner");
  if (static_cast<int64_t>(norm_.size()) != cfg.hidden_size)
    throw std::invalid_argument("model.norm holds " + str(static_cast<int64_t>(norm_.size())) +
                                " values, expected " + str(cfg.hidden_size));
}

int64_t KimiLinearModel::weight_bytes() const {
  const int64_t table16 = embed16_view_ ? vocab_ * cfg_.hidden_size : 0;
  int64_t b = static_cast<int64_t>(embed_.size()) * 4 + table16 * 2 + static_cast<int64_t>(norm_.size()) * 4;
  for (const auto& l : layers_) b += l->weight_bytes();
  return b;
}

void KimiLinearModel::embed(const int32_t* ids, int64_t T, float* h) const {
  const int64_t D = cfg_.hidden_size;
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= vocab_)
      throw std::out_of_range("token id " + str(ids[t]) + " at position " + str(t) +
                              " is outside the vocabulary [0, " + str(vocab_) + ")");
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = static_cast<int64_t>(ids[t]) * D;
    if (precision_ == Precision::BF16)
      bf16_to_f32_array(embed16_view_ + row, h + t * D, static_cast<size_t>(D));
    else
      std::memcpy(h + t * D, embed_.data() + row, sizeof(float) * static_cast<size_t>(D));
  }
}

void KimiLinearModel::forward_layers(float* h, int64_t T, const model_executor::ForwardBatch& fb,
                                     mem_cache::MemoryPools& pools) {
  const size_t n = static_cast<size_t>(T * cfg_.hidden_size);
  normed_.resize(n);
  tmp_.resize(n);
  for (auto& l : layers_)
    l->forward(h, T, fb, pools, cfg_.rms_norm_eps, precision_, ws_, normed_.data(), tmp_.data());
}

void KimiLinearModel::reserve(int64_t T, layers::attention::linear::LinearRecurrentAttnBackend& backend) {
  if (T <= 0) return;
  const size_t n = static_cast<size_t>(T * cfg_.hidden_size);
  if (normed_.size() < n) normed_.resize(n);
  if (tmp_.size() < n) tmp_.resize(n);
  for (auto& l : layers_) l->reserve(T, backend, ws_);
}

// ---------------------------------------------------------------------------------------------------
// KimiLinearForCausalLM

KimiLinearForCausalLM::KimiLinearForCausalLM(const io::KimiLinearConfig& cfg, const ModelOptions& opts)
    : cfg_(cfg), opts_(opts), backend_(opts.kernel) {}

KimiLinearForCausalLM::~KimiLinearForCausalLM() = default;

void KimiLinearForCausalLM::init_ids() {
  const int L = model_layer_count(cfg_, opts_.num_layers);
  kda_ids_.clear();
  mla_ids_.clear();
  for (int i = 0; i < L; ++i) (cfg_.is_kda_layer(i) ? kda_ids_ : mla_ids_).push_back(i);
}

std::vector<int> KimiLinearForCausalLM::moe_layer_ids() const {
  std::vector<int> ids;
  for (int i = 0; i < model_->num_layers(); ++i)
    if (model_->layer(i).is_moe()) ids.push_back(model_->layer(i).layer_idx());
  return ids;
}

mem_cache::RecurrentStatePoolConfig KimiLinearForCausalLM::recurrent_pool_config(int64_t slots) const {
  const int tp = opts_.tp.size;
  mem_cache::RecurrentStatePoolConfig pc;
  pc.layer_ids = kda_ids_;
  pc.size = slots;
  pc.num_heads = cfg_.num_heads / tp;
  pc.head_k_dim = cfg_.head_dim;
  pc.head_v_dim = cfg_.head_dim;
  pc.conv_kernel = cfg_.short_conv_kernel_size;
  pc.conv_dim = 3 * static_cast<int64_t>(cfg_.projection_size()) / tp;
  pc.conv_dtype = opts_.precision;  // bf16 mode: bf16 conv state (kda-numerics.md)
  return pc;
}

mem_cache::MLATokenToKVPoolConfig KimiLinearForCausalLM::kv_pool_config(int64_t tokens) const {
  mem_cache::MLATokenToKVPoolConfig kc;
  // Every rank caches the whole ĉ and k_pe (kv_a_proj_with_mqa is replicated under TP).
  kc.layer_ids = mla_ids_;
  kc.size = mla_ids_.empty() ? 0 : tokens;
  kc.kv_lora_rank = cfg_.kv_lora_rank;
  kc.qk_rope_head_dim = cfg_.qk_rope_head_dim;
  kc.dtype = opts_.precision;
  return kc;
}

std::unique_ptr<mem_cache::MemoryPools> KimiLinearForCausalLM::make_pools(int64_t max_requests,
                                                                          int64_t kv_tokens,
                                                                          int max_verify_tokens,
                                                                          int64_t verify_rows) const {
  auto rc = recurrent_pool_config(max_requests);
  rc.max_verify_tokens = max_verify_tokens;
  rc.verify_rows = verify_rows;
  return std::make_unique<mem_cache::MemoryPools>(rc, max_requests, kv_pool_config(kv_tokens));
}

void KimiLinearForCausalLM::forward(const int32_t* input_ids, int64_t T, model_executor::ForwardBatch& fb,
                                    mem_cache::MemoryPools& pools, float* hidden_final) {
  using model_executor::ForwardMode;
  fb.validate();
  if (T != fb.num_tokens())
    throw std::invalid_argument("KimiLinearForCausalLM::forward: " + str(T) + " input ids for a batch of " +
                                str(fb.num_tokens()) + " tokens");
  const int64_t D = cfg_.hidden_size;
  if (fb.forward_mode == ForwardMode::IDLE || fb.forward_mode == ForwardMode::DUMMY_FIRST) {
    std::fill(hidden_final, hidden_final + T * D, 0.0f);
    return;
  }
  if (fb.forward_mode == ForwardMode::DRAFT_EXTEND)
    throw std::invalid_argument("KimiLinearForCausalLM::forward: DRAFT_EXTEND is not supported");
  // Every check before anything changes: the ids, the requests, the MLA prefixes.
  for (int64_t t = 0; t < T; ++t)
    if (input_ids[t] < 0 || input_ids[t] >= vocab_size())
      throw std::out_of_range("token id " + str(input_ids[t]) + " at position " + str(t) +
                              " is outside the vocabulary [0, " + str(vocab_size()) + ")");
  auto& rtp = pools.req_to_token_pool;
  const auto slots = rtp.get_recurrent_indices(fb.req_pool_indices);  // throws for unknown requests
  const bool has_mla = !mla_ids_.empty();
  if (has_mla && pools.token_to_kv_pool == nullptr)
    throw std::invalid_argument(
        "KimiLinearForCausalLM::forward: the model has MLA layers but the pools hold no "
        "MLA KV pool (kv_pool_config)");
  const int64_t B = fb.batch_size();
  std::vector<int64_t> old_len(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t r = fb.req_pool_indices[b];
    if (r < 0) continue;
    old_len[b] = rtp.seq_len(r);
    if (has_mla && fb.forward_mode == ForwardMode::EXTEND && !fb.extend_prefix_lens.empty() &&
        fb.extend_prefix_lens[b] != old_len[b])
      throw std::invalid_argument("KimiLinearForCausalLM::forward: row " + str(b) + " (request " + str(r) +
                                  ") has extend_prefix_lens " + str(fb.extend_prefix_lens[b]) +
                                  " but the request holds " + str(old_len[b]) + " cached tokens");
  }
  if (fb.attn_backend == nullptr) fb.attn_backend = &backend_;
  std::vector<int32_t> lens(fb.extend_seq_lens.begin(), fb.extend_seq_lens.end());
  // The token slots first (all or nothing), so that a step refused for want of them leaves the backend
  // as it was (its metadata, a pending verify); freed again below if anything after them throws.
  rtp.alloc_tokens(fb.req_pool_indices, lens);
  try {
    if (!kda_ids_.empty()) fb.attn_backend->init_forward_metadata(fb, slots);
    model_->embed(input_ids, T, hidden_final);
    model_->forward_layers(hidden_final, T, fb, pools);
  } catch (...) {
    for (int64_t b = 0; b < B; ++b)
      if (fb.req_pool_indices[b] >= 0) rtp.truncate_tokens(fb.req_pool_indices[b], old_len[b]);
    throw;
  }
}

void KimiLinearForCausalLM::accept(const model_executor::ForwardBatch& fb, std::span<const int32_t> accepted,
                                   mem_cache::MemoryPools& pools) {
  if (fb.forward_mode != model_executor::ForwardMode::TARGET_VERIFY)
    throw std::invalid_argument("KimiLinearForCausalLM::accept: the batch is not a TARGET_VERIFY batch");
  if (static_cast<int64_t>(accepted.size()) != fb.batch_size())
    throw std::invalid_argument(
        "KimiLinearForCausalLM::accept: " + str(static_cast<int64_t>(accepted.size())) +
        " accepted positions for " + str(fb.batch_size()) + " rows");
  auto& rtp = pools.req_to_token_pool;
  // The verify step appended every row's d + 1 tokens after its committed ones; the accepted path keeps
  // its tokens (a chain: the first a + 1; a tree: the accepted position and its ancestors, in order).
  std::vector<int64_t> row_off(accepted.size() + 1, 0), committed(accepted.size(), 0);
  std::vector<std::vector<int32_t>> kept(accepted.size());
  for (size_t b = 0; b < accepted.size(); ++b) {
    row_off[b + 1] = row_off[b] + fb.extend_seq_lens[b] - 1;
    const int32_t r = fb.req_pool_indices[b];
    if (r < 0) continue;
    if (accepted[b] < 0 || accepted[b] >= fb.extend_seq_lens[b])
      throw std::invalid_argument("KimiLinearForCausalLM::accept: row " + str(static_cast<int64_t>(b)) +
                                  " accepted position " + str(accepted[b]) + " outside [0, " +
                                  str(fb.extend_seq_lens[b]) + ")");
    committed[b] = rtp.seq_len(r) - fb.extend_seq_lens[b];
    if (committed[b] < 0)
      throw std::invalid_argument("KimiLinearForCausalLM::accept: request " + str(r) + " holds " +
                                  str(rtp.seq_len(r)) + " tokens, fewer than its verify row's " +
                                  str(fb.extend_seq_lens[b]));
    for (int64_t p = accepted[b];;) {
      kept[b].push_back(static_cast<int32_t>(p));
      if (p == 0) break;
      p = fb.draft_parents.empty() ? p - 1 : fb.draft_parents[static_cast<size_t>(row_off[b] + p - 1)] + 1;
    }
    std::reverse(kept[b].begin(), kept[b].end());
  }
  if (!kda_ids_.empty()) {
    if (fb.attn_backend == nullptr)
      throw std::invalid_argument("KimiLinearForCausalLM::accept: the batch has no attention backend");
    fb.attn_backend->accept(fb, accepted, pools.recurrent_state_pool);
  }
  for (size_t b = 0; b < accepted.size(); ++b)
    if (fb.req_pool_indices[b] >= 0) rtp.accept_tokens(fb.req_pool_indices[b], committed[b], kept[b]);
}

void KimiLinearForCausalLM::reserve(int64_t T,
                                    layers::attention::linear::LinearRecurrentAttnBackend* backend) {
  if (T < 0) throw std::invalid_argument("reserve: negative token count " + str(T));
  model_->reserve(T, backend ? *backend : backend_);
}

void KimiLinearForCausalLM::compute_logits(const float* hidden, int64_t M, float* logits) {
  if (M <= 0) return;
  const int64_t D = cfg_.hidden_size;
  head_in_.resize(static_cast<size_t>(M * D));
  rms_norm_rows(hidden, M, D, model_->norm_weight().data(), cfg_.rms_norm_eps, opts_.precision,
                head_in_.data());
  const int64_t V = vocab_size();
  // Where the CPU has AMX-BF16, every row count goes to the AMX kernel (bf16_amx.h): it reads the head in its
  // tiled layout (each 16-channel block one run of bytes), one pass for up to 64 rows, and writes each row's
  // logits straight to their columns, where oneDNN's kernels read the head more slowly from two rows on
  // (docs/performance.md, "The LM head's row counts") and its one-row gemm wants a layout of its own. A row's
  // logits then do not depend on the rows beside it (a decode row and a verify row agree bit for bit).
  if (head_amx_ != nullptr) {
    head_in_bf16_.resize(static_cast<size_t>(M * D));
    f32_to_bf16_array(head_in_.data(), head_in_bf16_.data(), head_in_bf16_.size());  // exact in bf16
    kernels::gemm::gemm_bf16_amx_tiled(head_in_bf16_.data(), M, D, head_amx_, D, V, logits, V);
    return;
  }
  // Without the AMX head, one row (a batch-1 decode step) goes straight to its columns: oneDNN takes a
  // strided destination through its plain-layout gemm, which at M = 1 reads the head faster than its
  // brgemm kernel does within a model step. At M >= 2 that gemm is far slower than the brgemm kernel on a
  // dense destination, so each block's logits go to a dense buffer first, then to their columns. A head
  // that serves both shapes holds its weights in both layouts (Linear keeps one per layout its calls need).
  // Where the head's Linears send their decode rows to the AVX512_BF16 kernel (Bf16Gemm::OneDnnVnni), up to
  // kVnniMaxRows rows go straight to their columns through it, and one row never reaches oneDNN's plain
  // layout: the head keeps only its blocked one.
  const bool vnni = lm_head_.front().bf16_gemm() == layers::Bf16Gemm::OneDnnVnni && M <= layers::kVnniMaxRows;
  if (lm_head_.size() == 1 || M == 1 || vnni) {
    for (size_t b = 0; b < lm_head_.size(); ++b)
      lm_head_[b].forward(head_in_.data(), M, D, logits + head_begin_[b], V);
    return;
  }
  for (size_t b = 0; b < lm_head_.size(); ++b) {
    const int64_t n = lm_head_[b].out_features();
    head_out_.resize(static_cast<size_t>(M * n));
    lm_head_[b].forward(head_in_.data(), M, D, head_out_.data(), n);
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(logits + m * V + head_begin_[b], head_out_.data() + m * n, sizeof(float) * n);
  }
}

int64_t KimiLinearForCausalLM::head_weight_bytes() const {
  if (head_amx_ != nullptr) return vocab_size() * cfg_.hidden_size * static_cast<int64_t>(sizeof(bf16_t));
  int64_t b = 0;
  for (const auto& l : lm_head_) b += l.weight_bytes();
  return b;
}

bool KimiLinearForCausalLM::amx_head() const {
  return opts_.precision == Precision::BF16 && !opts_.quantize_lm_head && kernels::gemm::cpu_has_amx_bf16() &&
         kernels::gemm::bf16_amx_takes(cfg_.hidden_size);
}

// Drops the head built so far; where the AMX head applies, returns its memory for V x D values in the AMX
// kernel's tiled layout (huge pages, allocate_weights, held by head_owner_; head_amx_ set), else nullptr
// (the head goes to lm_head_).
bf16_t* KimiLinearForCausalLM::reset_head(int64_t V) {
  lm_head_.clear();
  head_begin_.clear();
  head_owner_.reset();
  head_amx_ = nullptr;
  if (!amx_head()) return nullptr;
  head_owner_ = std::shared_ptr<void>(allocate_weights(
      sizeof(bf16_t) * static_cast<size_t>(kernels::gemm::bf16_amx_tiled_size(V, cfg_.hidden_size))));
  head_amx_ = static_cast<const bf16_t*>(head_owner_.get());
  return static_cast<bf16_t*>(head_owner_.get());
}

void KimiLinearForCausalLM::build_head(
    int64_t V, const std::function<void(int64_t, int64_t, std::vector<float>&)>& rows) {
  const int64_t D = cfg_.hidden_size;
  const int64_t per = head_block_rows();
  const Weights hw = opts_.quantize_lm_head ? opts_.weights : Weights::BF16;
  bf16_t* amx = reset_head(V);
  std::vector<float> r;
  for (int64_t b = 0; b < V; b += per) {
    const int64_t e = std::min(V, b + per);
    rows(b, e, r);
    if (static_cast<int64_t>(r.size()) != (e - b) * D)
      throw std::invalid_argument("lm_head rows [" + str(b) + ", " + str(e) +
                                  "): " + str(static_cast<int64_t>(r.size())) + " values, expected " +
                                  str((e - b) * D));
    if (amx != nullptr) {
      kernels::gemm::bf16_amx_tile_rows(r.data(), b, e, D, amx);
    } else {
      lm_head_.emplace_back(D, e - b, r, opts_.precision, hw);
      head_begin_.push_back(b);
    }
  }
}

int64_t KimiLinearForCausalLM::head_block_rows() const {
  return opts_.lm_head_block_rows > 0 ? opts_.lm_head_block_rows
                                      : std::max<int64_t>(1, kHeadBlockValues / cfg_.hidden_size);
}

bool KimiLinearForCausalLM::bf16_head_source() const {
  return opts_.precision == Precision::BF16 && !opts_.quantize_lm_head;
}

void KimiLinearForCausalLM::build_head(int64_t V, const bf16_t* head,
                                       const std::function<void(int64_t, int64_t)>& block_done) {
  if (!bf16_head_source())
    throw std::invalid_argument("build_head: bf16 rows make a dense head in the bf16 precision only");
  const int64_t D = cfg_.hidden_size;
  const int64_t per = head_block_rows();
  bf16_t* amx = reset_head(V);
  for (int64_t b = 0; b < V; b += per) {
    const int64_t e = std::min(V, b + per);
    if (amx != nullptr) {
      kernels::gemm::bf16_amx_tile_rows(head + b * D, b, e, D, amx);
    } else {
      lm_head_.emplace_back(D, e - b, head + b * D, opts_.precision);
      head_begin_.push_back(b);
    }
    if (block_done) block_done(b, e);
  }
}

int64_t KimiLinearForCausalLM::weight_bytes() const { return model_->weight_bytes() + head_weight_bytes(); }

int64_t KimiLinearForCausalLM::active_weight_bytes() const {
  const int64_t D = cfg_.hidden_size;
  int64_t b = D * (opts_.precision == Precision::BF16 ? 2 : 4) + D * 4;  // one embedding row, model.norm
  for (int i = 0; i < model_->num_layers(); ++i) b += model_->layer(i).active_weight_bytes();
  return b + head_weight_bytes();
}

int64_t KimiLinearForCausalLM::active_params() const {
  return kimi_linear_active_params(cfg_, model_->num_layers(), opts_.num_experts, vocab_size());
}

int64_t kimi_linear_active_params(const io::KimiLinearConfig& cfg, int num_layers, int num_experts,
                                  int64_t vocab) {
  // What one token multiplies by, as the spec counts it: projections and conv of the attention layers,
  // the router with the top-k routed and the shared experts, dense MLPs, the LM head (not the embedding
  // row, a lookup); the norms' weights too (a few per layer).
  const int L = model_layer_count(cfg, num_layers);
  const int64_t D = cfg.hidden_size, H = cfg.num_heads, K = cfg.head_dim, P = H * K;
  const int64_t W = cfg.short_conv_kernel_size;
  const int64_t kda = 3 * P * D + 2 * K * D + 2 * P * K + H * D + D * P + 3 * P * W + H + P + K;
  const int64_t Hm = cfg.num_attention_heads, R = cfg.kv_lora_rank, r = cfg.qk_rope_head_dim;
  const int64_t mla = Hm * cfg.qk_head_dim() * D + (R + r) * D + R +
                      Hm * (cfg.qk_nope_head_dim + cfg.v_head_dim) * R + D * Hm * cfg.v_head_dim;
  const int64_t moe = kimi_moe_active_params(cfg, num_experts);
  const int64_t dense = 3 * cfg.intermediate_size * D;
  int64_t total = (vocab > 0 ? vocab : cfg.vocab_size) * D + D;  // lm_head, model.norm
  for (int i = 0; i < L; ++i)
    total += 2 * D + (cfg.is_kda_layer(i) ? kda : mla) + (cfg.is_moe_layer(i) ? moe : dense);
  return total;
}

int64_t kimi_moe_active_params(const io::KimiLinearConfig& cfg, int num_experts) {
  const int64_t D = cfg.hidden_size, E = num_experts > 0 ? num_experts : cfg.num_experts;
  const int64_t k = std::min<int64_t>(cfg.num_experts_per_token, E);
  return E * D + E + (k + cfg.num_shared_experts) * 3 * cfg.moe_intermediate_size * D;
}

}  // namespace kda::models
