#include "kda/models/kimi_mla.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kda/common/aligned_scratch.h"
#include "kda/common/bf16.h"
#include "kda/common/seeded.h"
#include "kda/common/weight_buffer.h"
#include "kda/io/packed_checkpoint.h"
#include "kda/kernels/gemm/row_gemv.h"
#include "kda/kernels/gemm/weight_format.h"
#include "kda/layers/attention/mla/mla_attention.h"
#include "kda/layers/quant_linear.h"

namespace kda::models {
namespace {

namespace mla = layers::attention::mla;

std::string str(int64_t v) { return std::to_string(v); }

// bf16 mode rounds a parameter to bf16, as a bf16 checkpoint stores it.
std::vector<float> param(const std::vector<float>& v, Precision p) {
  std::vector<float> out = v;
  if (p == Precision::BF16) round_bf16_inplace(out.data(), out.size());
  return out;
}

void check_size(const std::vector<float>& v, int64_t n, const char* name) {
  if (static_cast<int64_t>(v.size()) != n)
    throw std::invalid_argument(std::string("MlaLayerWeights: ") + name + " has " +
                                str(static_cast<int64_t>(v.size())) + " values, expected " + str(n));
}

void check_mla_config(const io::KimiLinearConfig& cfg) {
  if (!cfg.has_model_fields || cfg.num_attention_heads <= 0 || cfg.kv_lora_rank <= 0 ||
      cfg.qk_nope_head_dim <= 0 || cfg.qk_rope_head_dim <= 0 || cfg.v_head_dim <= 0)
    throw std::invalid_argument(
        "MLA layer: the config has no MLA fields (num_attention_heads, kv_lora_rank, qk_nope_head_dim, "
        "qk_rope_head_dim, v_head_dim): load it with parse_model_config / load_model_config");
}

void check_layer(const io::KimiLinearConfig& cfg, int layer_idx) {
  check_mla_config(cfg);
  if (layer_idx < 0 || layer_idx >= cfg.num_hidden_layers)
    throw std::invalid_argument("layer " + str(layer_idx) + " is outside the model's " +
                                str(cfg.num_hidden_layers) + " decoder layers");
  if (!cfg.is_mla_layer(layer_idx))
    throw std::invalid_argument(
        "decoder layer " + str(layer_idx) +
        " (0-based) is not an MLA layer: linear_attn_config.full_attn_layers (1-based) does "
        "not list " +
        str(layer_idx + 1));
}

void check_rank(int tp_rank, int tp_size) {
  if (tp_rank < 0 || tp_rank >= tp_size)
    throw std::invalid_argument("tensor-parallel rank " + str(tp_rank) + " outside [0, " + str(tp_size) +
                                ")");
}

}  // namespace

void check_mla_tensor_parallel(const io::KimiLinearConfig& cfg, int tp_size) {
  if (tp_size < 1) throw std::invalid_argument("--tp must be >= 1, got " + str(tp_size));
  if (cfg.num_attention_heads % tp_size != 0)
    throw std::invalid_argument("tensor parallelism over " + str(tp_size) + " ranks cannot split " +
                                str(cfg.num_attention_heads) +
                                " MLA heads evenly (num_attention_heads must be divisible by --tp)");
}

MlaLayerWeights MlaLayerWeights::load(const io::Checkpoint& ckpt, const io::KimiLinearConfig& cfg,
                                      int layer_idx, int tp_rank, int tp_size) {
  check_layer(cfg, layer_idx);
  check_mla_tensor_parallel(cfg, tp_size);
  check_rank(tp_rank, tp_size);
  const int64_t D = cfg.hidden_size, Hm = cfg.num_attention_heads, dn = cfg.qk_nope_head_dim,
                dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim, R = cfg.kv_lora_rank;
  const int64_t h0 = tp_rank * Hm / tp_size, h1 = (tp_rank + 1) * Hm / tp_size;
  const std::string pre = "model.layers." + str(layer_idx) + ".self_attn.";
  MlaLayerWeights w;
  if (const auto scheme = io::packed_weights(ckpt)) {
    io::packed_for_load(ckpt, *scheme, tp_size);  // one rank: the whole layer
    w.kv_a_layernorm = ckpt.load_f32(pre + "kv_a_layernorm.weight", {R});
    auto packed = [&](const char* name, int64_t in, int64_t out) {
      w.packed[name] = io::load_packed(ckpt, pre + name, *scheme, in, out);
    };
    packed("q_proj", D, Hm * (dn + dr));
    packed("kv_a_proj_with_mqa", D, R + dr);
    packed("kv_b_proj", R, Hm * (dn + dv));
    packed("o_proj", Hm * dv, D);
    return w;
  }
  w.q_proj =
      ckpt.load_f32_slice(pre + "q_proj.weight", {Hm * (dn + dr), D}, 0, h0 * (dn + dr), h1 * (dn + dr));
  w.kv_a_proj_with_mqa = ckpt.load_f32(pre + "kv_a_proj_with_mqa.weight", {R + dr, D});
  w.kv_a_layernorm = ckpt.load_f32(pre + "kv_a_layernorm.weight", {R});
  w.kv_b_proj =
      ckpt.load_f32_slice(pre + "kv_b_proj.weight", {Hm * (dn + dv), R}, 0, h0 * (dn + dv), h1 * (dn + dv));
  w.o_proj = ckpt.load_f32_slice(pre + "o_proj.weight", {D, Hm * dv}, 1, h0 * dv, h1 * dv);
  return w;
}

MlaLayerWeights MlaLayerWeights::shard(const io::KimiLinearConfig& cfg, int tp_rank, int tp_size) const {
  check_mla_config(cfg);
  check_mla_tensor_parallel(cfg, tp_size);
  check_rank(tp_rank, tp_size);
  const int64_t D = cfg.hidden_size, Hm = cfg.num_attention_heads, dn = cfg.qk_nope_head_dim,
                dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim, R = cfg.kv_lora_rank;
  check_size(q_proj, Hm * (dn + dr) * D, "q_proj");
  check_size(kv_b_proj, Hm * (dn + dv) * R, "kv_b_proj");
  check_size(o_proj, D * Hm * dv, "o_proj");
  const int64_t h0 = tp_rank * Hm / tp_size, h1 = (tp_rank + 1) * Hm / tp_size;
  auto rows = [](const std::vector<float>& v, int64_t cols, int64_t b, int64_t e) {
    return std::vector<float>(v.begin() + b * cols, v.begin() + e * cols);
  };
  MlaLayerWeights s;
  s.q_proj = rows(q_proj, D, h0 * (dn + dr), h1 * (dn + dr));
  s.kv_a_proj_with_mqa = kv_a_proj_with_mqa;
  s.kv_a_layernorm = kv_a_layernorm;
  s.kv_b_proj = rows(kv_b_proj, R, h0 * (dn + dv), h1 * (dn + dv));
  const int64_t c0 = h0 * dv, c1 = h1 * dv, P = Hm * dv;
  s.o_proj.resize(static_cast<size_t>(D * (c1 - c0)));
  for (int64_t d = 0; d < D; ++d)
    std::copy(o_proj.begin() + d * P + c0, o_proj.begin() + d * P + c1, s.o_proj.begin() + d * (c1 - c0));
  return s;
}

MlaLayerWeights MlaLayerWeights::synthetic(const io::KimiLinearConfig& cfg, uint64_t seed) {
  check_mla_config(cfg);
  const int64_t D = cfg.hidden_size, Hm = cfg.num_attention_heads, dn = cfg.qk_nope_head_dim,
                dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim, R = cfg.kv_lora_rank;
  // Tables of this layer's draws (seeded_normals' `table`), apart from the embedding / LM head tables.
  constexpr uint64_t kTableBase = 0x4d4c4100;  // "MLA"
  auto matrix = [&](uint64_t table, int64_t out, int64_t in, double stddev) {
    std::vector<float> v(static_cast<size_t>(out * in));
    for (int64_t r = 0; r < out; ++r) seeded_normals(seed, kTableBase + table, r, in, v.data() + r * in);
    for (auto& x : v) x *= static_cast<float>(stddev);
    return v;
  };
  MlaLayerWeights w;
  w.q_proj = matrix(1, Hm * (dn + dr), D, 1.0 / std::sqrt(static_cast<double>(D)));
  w.kv_a_proj_with_mqa = matrix(2, R + dr, D, 1.0 / std::sqrt(static_cast<double>(D)));
  w.kv_a_layernorm = matrix(3, 1, R, 0.1);
  for (auto& x : w.kv_a_layernorm) x += 1.0f;  // near 1, as a trained norm weight
  w.kv_b_proj = matrix(4, Hm * (dn + dv), R, 1.0 / std::sqrt(static_cast<double>(R)));
  w.o_proj = matrix(5, D, Hm * dv, 1.0 / std::sqrt(static_cast<double>(Hm * dv)));
  return w;
}

namespace {

const MlaLayerWeights& checked(const MlaLayerWeights& w, const io::KimiLinearConfig& cfg, int tp_size) {
  check_mla_config(cfg);
  check_mla_tensor_parallel(cfg, tp_size);
  const int64_t D = cfg.hidden_size, Hm = cfg.num_attention_heads / tp_size, dn = cfg.qk_nope_head_dim,
                dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim, R = cfg.kv_lora_rank;
  check_size(w.kv_a_layernorm, R, "kv_a_layernorm");
  if (!w.packed.empty()) {
    // Packed: each projection is checked as it is built (make_linear, packed_kvb).
    if (tp_size > 1) throw std::invalid_argument("MlaLayerWeights: packed projections on one rank only");
    return w;
  }
  check_size(w.q_proj, Hm * (dn + dr) * D, "q_proj");
  check_size(w.kv_a_proj_with_mqa, (R + dr) * D, "kv_a_proj_with_mqa");
  check_size(w.kv_b_proj, Hm * (dn + dv) * R, "kv_b_proj");
  check_size(w.o_proj, D * Hm * dv, "o_proj");
  return w;
}

// A packed checkpoint's kv_b, checked against the layer; null where the weights hold it in fp32.
std::shared_ptr<const kernels::gemm::PackedMatrix> packed_kvb(const MlaLayerWeights& mw, int64_t R,
                                                              int64_t out, Weights weights) {
  const auto packed = mw.packed.find("kv_b_proj");
  if (packed == mw.packed.end()) return nullptr;
  const kernels::gemm::PackedWeights& v = packed->second->view();
  if (v.format != weights || v.in != R || v.out != out)
    throw std::invalid_argument("projection 'kv_b_proj' is packed as " + std::string(to_string(v.format)) +
                                " [" + str(v.out) + ", " + str(v.in) + "], the layer wants " +
                                to_string(weights) + " [" + str(out) + ", " + str(R) + "]");
  return packed->second;
}

}  // namespace

// kv_b twice: as the attention kernels multiply by it, fp32 (w_kvb_: the precision's values, bf16-rounded
// in the bf16 mode, or the int8 / int4 scheme's dequantized values, so that both forms see what a kv_b
// Linear would), and as the absorbed form's decode rows read it (rows): the int8 / int4 packing those
// values come from, or in the bf16 mode with bf16 weights the values in bf16 (exact: they are
// bf16-rounded), else w_kvb_ itself. A decode step reads kv_b once per layer; the compact copy is a half
// (bf16) to a seventh (int4) of the fp32 one's bytes.
struct KimiMLAAttention::DecodeKvb {
  std::shared_ptr<const kernels::gemm::PackedMatrix> packed;
  WeightBuffer bf16;
  kernels::gemm::RowMatrix rows;
};

KimiMLAAttention::~KimiMLAAttention() = default;

mla::MlaDims KimiMLAAttention::mla_dims() const {
  return mla::MlaDims{static_cast<int>(Hm_), static_cast<int>(dn_), static_cast<int>(dr_),
                      static_cast<int>(dv_), static_cast<int>(R_)};
}

KimiMLAAttention::KimiMLAAttention(const io::KimiLinearConfig& cfg, int layer_idx, const MlaLayerWeights& w,
                                   Precision precision, distributed::TensorParallel tp, Weights weights,
                                   MlaOptions options)
    : layer_idx_(layer_idx),
      precision_(precision),
      tp_(tp),
      options_(options),
      D_(cfg.hidden_size),
      Hm_(cfg.num_attention_heads / std::max(tp.size, 1)),
      dn_(cfg.qk_nope_head_dim),
      dr_(cfg.qk_rope_head_dim),
      dv_(cfg.v_head_dim),
      R_(cfg.kv_lora_rank),
      eps_(options.kv_norm_eps > 0.0 ? options.kv_norm_eps : cfg.rms_norm_eps),
      scale_(static_cast<float>(1.0 /
                                std::sqrt(static_cast<double>(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)))),
      norm_w_(param(checked(w, cfg, std::max(tp.size, 1)).kv_a_layernorm, precision)),
      q_proj_(layers::make_linear(
          w.packed, "q_proj", D_, Hm_ * (dn_ + dr_), [&] { return w.q_proj; }, precision, weights)),
      kv_a_(layers::make_linear(
          w.packed, "kv_a_proj_with_mqa", D_, R_ + dr_, [&] { return w.kv_a_proj_with_mqa; }, precision,
          weights)),
      o_proj_(layers::make_linear(
          w.packed, "o_proj", Hm_ * dv_, D_, [&] { return w.o_proj; }, precision, weights)),
      kvb_decode_(std::make_unique<DecodeKvb>()) {
  check_layer(cfg, layer_idx);
  const int64_t kvb_out = Hm_ * (dn_ + dv_);
  DecodeKvb& dk = *kvb_decode_;
  using kernels::gemm::RowFormat;
  const auto packed = packed_kvb(w, R_, kvb_out, weights);
  // A packed layer's fp32 tensors are not checked by size (checked() above): kv_b's is, where it is used.
  if (!packed && static_cast<int64_t>(w.kv_b_proj.size()) != kvb_out * R_)
    throw std::invalid_argument("kv_b_proj holds " + str(static_cast<int64_t>(w.kv_b_proj.size())) +
                                " values, expected [" + str(kvb_out) + ", " + str(R_) + "]");
  if (weights == Weights::Int8 || weights == Weights::Int4) {
    // Packed here from fp32 as a kv_b QuantLinear would pack it, where the checkpoint did not.
    dk.packed = packed ? packed
                       : std::make_shared<const kernels::gemm::PackedMatrix>(weights, w.kv_b_proj.data(), R_,
                                                                             kvb_out);
    const kernels::gemm::PackedWeights& v = dk.packed->view();
    w_kvb_ = kernels::gemm::dequantize(v);
    dk.rows = {weights == Weights::Int8 ? RowFormat::Int8 : RowFormat::Int4, v.data, v.scale, kvb_out, R_};
  } else {
    w_kvb_ = packed ? kernels::gemm::dequantize(packed->view()) : param(w.kv_b_proj, precision);
    dk.rows = {RowFormat::F32, w_kvb_.data(), nullptr, kvb_out, R_};
    if (precision == Precision::BF16) {
      dk.bf16 = allocate_weights(w_kvb_.size() * sizeof(bf16_t));
      f32_to_bf16_array(w_kvb_.data(), static_cast<bf16_t*>(dk.bf16.get()), w_kvb_.size());
      dk.rows = {RowFormat::BF16, dk.bf16.get(), nullptr, kvb_out, R_};
    }
  }
  // Only where the plain form takes it: with bf16 keys (plain_bf16_keys), which it packs from its rows.
  const mla::MlaDims dims = mla_dims();
  if (precision == Precision::BF16 && weights == Weights::BF16 && mla::plain_bf16_keys(dims, true))
    kv_b16_ = std::make_unique<layers::Linear>(R_, Hm_ * (dn_ + dv_), w_kvb_, precision);
  if (options.kv_norm_eps < 0.0)
    throw std::invalid_argument("MlaOptions.kv_norm_eps must be >= 0 (0: rms_norm_eps), got " +
                                std::to_string(options.kv_norm_eps));
  if (tp.size > 1 && (!tp.comm || tp.comm->size() != tp.size || tp.comm->rank() != tp.rank))
    throw std::invalid_argument("KimiMLAAttention: tensor-parallel rank " + str(tp.rank) + " of " +
                                str(tp.size) + " needs a communicator of that size and rank");
}

std::unique_ptr<KimiMLAAttention> KimiMLAAttention::from_checkpoint(const io::Checkpoint& ckpt,
                                                                    const io::KimiLinearConfig& cfg,
                                                                    int layer_idx, Precision precision,
                                                                    distributed::TensorParallel tp,
                                                                    Weights weights, MlaOptions options) {
  io::packed_for_load(ckpt, weights, tp.size);  // a packed checkpoint's scheme and rank count, said first
  return std::make_unique<KimiMLAAttention>(cfg, layer_idx,
                                            MlaLayerWeights::load(ckpt, cfg, layer_idx, tp.rank, tp.size),
                                            precision, tp, weights, options);
}

std::vector<std::pair<std::string, const layers::Linear*>> KimiMLAAttention::projections() const {
  return {{"q_proj", &q_proj_}, {"kv_a_proj_with_mqa", &kv_a_}, {"o_proj", &o_proj_}};
}

int64_t KimiMLAAttention::weight_bytes() const {
  return q_proj_.weight_bytes() + kv_a_.weight_bytes() + o_proj_.weight_bytes() +
         kernels::gemm::row_bytes(kvb_decode_->rows, kvb_decode_->rows.rows);
}

void KimiMLAAttention::reserve(int64_t T) {
  if (T <= 0) return;
  // forward's sizes (steps 1, 3 and 4 below) for T new tokens of one sequence of T tokens.
  const int64_t qw = Hm_ * (dn_ + dr_), lw = R_ + dr_;
  grow(q_, T * qw);
  grow(a_, T * lw);
  grow(lat_, T * lw);
  grow(o_, T * Hm_ * dv_);
  if (!plain_kv_) plain_kv_ = std::make_unique<mla::MlaScratch>();
  const mla::MlaDims dims = mla_dims();
  const bool absorb = options_.form == MlaForm::Absorbed ||
                      (options_.form == MlaForm::Auto && mla::prefer_absorbed(dims, 0, T));
  if (!absorb) mla::reserve_plain(dims, T, precision_ == Precision::BF16, kv_b16_ != nullptr, *plain_kv_);
  for (const layers::Linear* l : {&q_proj_, &kv_a_, &o_proj_}) l->reserve(T);
  if (kv_b16_ && !absorb) kv_b16_->reserve(T);
}

void KimiMLAAttention::forward(const float* hidden_states, int64_t T, const model_executor::ForwardBatch& fb,
                               mem_cache::MemoryPools& pools, float* out) {
  using model_executor::ForwardMode;
  fb.validate();
  const std::string who = "KimiMLAAttention layer " + str(layer_idx_);
  if (fb.num_tokens() != T)
    throw std::invalid_argument(who + ": " + str(T) + " hidden-state rows for a batch of " +
                                str(fb.num_tokens()) + " tokens");
  const ForwardMode mode = fb.forward_mode;
  if (mode == ForwardMode::IDLE || mode == ForwardMode::DUMMY_FIRST) {
    if (T > 0) std::memset(out, 0, sizeof(float) * static_cast<size_t>(T * D_));
    return;
  }
  const bool verify = mode == ForwardMode::TARGET_VERIFY;
  if (mode != ForwardMode::EXTEND && mode != ForwardMode::DECODE && !verify)
    throw std::runtime_error(who + ": forward mode " + model_executor::to_string(mode) +
                             " is not supported by the MLA layer (EXTEND, DECODE, TARGET_VERIFY, IDLE, "
                             "DUMMY_FIRST)");
  // State snapshots (prefix caching) are the KDA layers' business: the batch carries them for those.
  mem_cache::MLATokenToKVPool* pool = pools.token_to_kv_pool.get();
  if (!pool) throw std::invalid_argument(who + ": the memory pools have no MLA KV pool (token_to_kv_pool)");
  const mem_cache::MLAKVLayerView view = pool->get_kv_buffer(layer_idx_);  // unknown layer: error
  if (view.row_elems != R_ + dr_)
    throw std::invalid_argument(who + ": the KV pool's rows hold " + str(view.row_elems) +
                                " values, the layer " + str(R_ + dr_) + " (kv_lora_rank + qk_rope_head_dim)");
  const auto& rtp = pools.req_to_token_pool;

  // Every check before anything is written: the rows' lengths against the pool's mapping.
  const int64_t B = fb.batch_size();
  std::vector<std::span<const int32_t>> toks(static_cast<size_t>(B));
  std::vector<int64_t> row0(static_cast<size_t>(B) + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t req = fb.req_pool_indices[b];
    const int64_t E = fb.extend_seq_lens[b];
    row0[b + 1] = row0[b] + E;
    if (req == -1) continue;
    toks[b] = rtp.req_to_token(req);
    const int64_t L = rtp.seq_len(req);
    // DECODE carries no prefix lengths (every row continues its sequence): the pool's length says it.
    // EXTEND's are the caller's claim, checked against the pool (empty: no cached prefix, as the KDA
    // backend reads it).
    const int64_t P = mode == ForwardMode::DECODE || verify ? L - E
                      : fb.extend_prefix_lens.empty()       ? 0
                                                            : fb.extend_prefix_lens[b];
    if (P < 0 || L != P + E || static_cast<int64_t>(toks[b].size()) != L)
      throw std::invalid_argument(who + ": batch row " + str(b) + " (request " + str(req) + ") has " +
                                  str(L) + " tokens and " + str(static_cast<int64_t>(toks[b].size())) +
                                  " token slots, the step prefix " + str(P) + " + extend " + str(E) +
                                  " (call alloc_tokens before the forward)");
    for (const int32_t s : toks[b])
      if (s < 1 || s >= view.num_slots)
        throw std::invalid_argument(who + ": request " + str(req) + " maps to token slot " + str(s) +
                                    " outside the KV pool [1, " + str(view.num_slots - 1) + "]");
  }
  if (T == 0) return;

  const bool bf16 = precision_ == Precision::BF16;
  const int64_t qw = Hm_ * (dn_ + dr_), lw = R_ + dr_;
  // 1. q and a = [c | k_pe]; in the bf16 mode each is a GEMM output, rounded.
  q_.resize(static_cast<size_t>(T * qw));
  a_.resize(static_cast<size_t>(T * lw));
  q_proj_.forward(hidden_states, T, q_.data());
  kv_a_.forward(hidden_states, T, a_.data());
  if (bf16) {
    round_bf16_inplace(q_.data(), q_.size());
    round_bf16_inplace(a_.data(), a_.size());
  }
  // 2. c_hat = RMSNorm(c; kv_a_layernorm), statistics in fp32, rounded once after the weight multiply.
  const float eps = static_cast<float>(eps_);
#pragma omp parallel for if (T > 64)
  for (int64_t t = 0; t < T; ++t) {
    float* c = a_.data() + t * lw;
    float ss = 0.0f;
    for (int64_t j = 0; j < R_; ++j) ss += c[j] * c[j];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(R_) + eps);
    for (int64_t j = 0; j < R_; ++j) {
      const float v = c[j] * inv * norm_w_[static_cast<size_t>(j)];
      c[j] = bf16 ? round_bf16(v) : v;
    }
  }
  // 3. The new tokens' cache rows (c_hat | k_pe), then every attended sequence's rows in position order,
  // read from the cache (the new ones read back: in the bf16 mode what the cache holds is what is attended
  // to), gathered or in place (below).
  for (int64_t b = 0; b < B; ++b) {
    if (fb.req_pool_indices[b] == -1) continue;
    const int64_t E = row0[b + 1] - row0[b], P = static_cast<int64_t>(toks[b].size()) - E;
    for (int64_t i = 0; i < E; ++i) {
      const int64_t slot = toks[b][static_cast<size_t>(P + i)];
      const float* src = a_.data() + (row0[b] + i) * lw;
      if (view.kv_f32)
        std::copy_n(src, lw, view.kv_f32 + slot * lw);
      else
        f32_to_bf16_array(src, view.kv_bf16 + slot * lw, static_cast<size_t>(lw));
    }
  }
  // TARGET_VERIFY trees: each row's visibility matrix (a token sees its ancestors and itself); chains
  // (no draft_parents) are causal.
  std::vector<std::vector<uint8_t>> visible(verify && !fb.draft_parents.empty() ? static_cast<size_t>(B) : 0);
  for (int64_t b = 0, at_parent = 0; b < static_cast<int64_t>(visible.size()); ++b) {
    const int64_t E = row0[b + 1] - row0[b];
    auto& v = visible[static_cast<size_t>(b)];
    v.assign(static_cast<size_t>(E * E), 0);
    for (int64_t i = 0; i < E; ++i) {
      v[static_cast<size_t>(i * E + i)] = 1;
      if (i == 0) continue;
      // Token i is draft i - 1; its parent draft p is token p + 1 (-1: the last accepted token, token 0).
      const int64_t parent = fb.draft_parents[static_cast<size_t>(at_parent + i - 1)] + 1;
      for (int64_t m = 0; m < parent + 1; ++m)
        v[static_cast<size_t>(i * E + m)] = v[static_cast<size_t>(parent * E + m)];
    }
    at_parent += E - 1;
  }
  // A decode row of the absorbed form reads the pool's rows in place (MlaSeq::slots); the others are
  // gathered into lat_.
  const mla::MlaDims dims = mla_dims();
  std::vector<uint8_t> absorb(static_cast<size_t>(B), 0);
  int64_t lat_rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t E = row0[b + 1] - row0[b];
    if (fb.req_pool_indices[b] == -1 || E == 0) continue;
    const int64_t L = static_cast<int64_t>(toks[b].size());
    absorb[b] = options_.form == MlaForm::Absorbed ||
                (options_.form == MlaForm::Auto && mla::prefer_absorbed(dims, L - E, E));
    if (!absorb[b] || E != 1) lat_rows += L;
  }
  lat_.resize(static_cast<size_t>(lat_rows * lw));
  std::vector<mla::MlaSeq> plain, absorbed;
  int64_t at = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t E = row0[b + 1] - row0[b];
    if (fb.req_pool_indices[b] == -1 || E == 0) continue;
    const int64_t L = static_cast<int64_t>(toks[b].size());
    const auto& tk = toks[b];
    mla::MlaSeq seq{row0[b], L - E, E, nullptr,
                    visible.empty() ? nullptr : visible[static_cast<size_t>(b)].data()};
    if (absorb[b] && E == 1) {
      seq.slots = tk.data();
      seq.pool_f32 = view.kv_f32;
      seq.pool_bf16 = view.kv_f32 ? nullptr : view.kv_bf16;
    } else {
      float* dst = lat_.data() + at * lw;
      constexpr int64_t kRun = 64;  // rows per share of the threads
#pragma omp parallel for if (L > 256)
      for (int64_t s0 = 0; s0 < L; s0 += kRun)
        mla::pool_rows_f32(tk.data(), view.kv_f32, view.kv_bf16, lw, s0, std::min(kRun, L - s0), 0, lw,
                           dst + s0 * lw, lw);
      at += L;
      seq.latent = dst;
    }
    (absorb[b] ? absorbed : plain).push_back(seq);
  }
  // 4. Attention; a padded row's o stays zero, so its output is zero.
  o_.assign(static_cast<size_t>(T * Hm_ * dv_), 0.0f);
  if (!plain_kv_) plain_kv_ = std::make_unique<mla::MlaScratch>();
  mla::MlaAttnArgs args{dims,
                        q_.data(),
                        qw,
                        {},
                        w_kvb_.data(),
                        scale_,
                        bf16,
                        o_.data(),
                        Hm_ * dv_,
                        plain_kv_.get(),
                        kv_b16_.get(),
                        kvb_decode_->rows};
  if (!plain.empty()) {
    args.seqs = plain;
    mla::mla_attention_plain(args);
  }
  if (!absorbed.empty()) {
    args.seqs = absorbed;
    mla::mla_attention_absorbed(args);
  }
  // 5. o_proj; under tensor parallelism each rank holds a partial sum over its heads.
  o_proj_.forward(o_.data(), T, out);
  if (tp_.size > 1) tp_.comm->allreduce_sum(out, static_cast<size_t>(T * D_));
  if (bf16) round_bf16_inplace(out, static_cast<size_t>(T * D_));
}

}  // namespace kda::models
