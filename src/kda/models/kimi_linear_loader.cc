// KimiLinearForCausalLM::from_pretrained and ::synthetic: building the decoder layer by layer.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>

#include "kda/common/allocator.h"
#include "kda/common/seeded.h"
#include "kda/io/checkpoint_keys.h"
#include "kda/io/packed_checkpoint.h"
#include "kda/io/safetensors.h"
#include "kda/models/kimi_linear_model.h"

namespace kda::models {

namespace {
constexpr const char* kEmbedKey = "model.embed_tokens.weight";
constexpr const char* kHeadKey = "lm_head.weight";
constexpr const char* kNormKey = "model.norm.weight";
constexpr uint64_t kEmbedTable = 1, kHeadTable = 2;  // seeded_normals tables (as KdaStack's)

std::string layer_prefix(int i) { return "model.layers." + std::to_string(i) + "."; }

void check_options(const io::KimiLinearConfig& cfg, const ModelOptions& o) {
  if (!cfg.has_model_fields)
    throw std::invalid_argument(
        "KimiLinearForCausalLM: the config lacks the whole model's fields "
        "(io::parse_model_config reads them)");
  model_layer_count(cfg, o.num_layers);
  if (o.kv_norm_eps < 0.0 || !std::isfinite(o.kv_norm_eps))
    throw std::invalid_argument("kv_norm_eps must be >= 0 (0: rms_norm_eps), got " +
                                std::to_string(o.kv_norm_eps));
  if (o.quantize_lm_head && o.weights == Weights::BF16)
    throw std::invalid_argument(
        "quantize_lm_head (--quantize-lm-head) needs int8 or int4 weights: with bf16 weights "
        "the head is dense already");
  if (o.lm_head_block_rows < 0)
    throw std::invalid_argument("lm_head_block_rows must be >= 0, got " +
                                std::to_string(o.lm_head_block_rows));
  if (o.tp.size < 1 || o.tp.rank < 0 || o.tp.rank >= o.tp.size)
    throw std::invalid_argument("tensor parallel rank " + std::to_string(o.tp.rank) + " of " +
                                std::to_string(o.tp.size));
  if (o.tp.size > 1) {
    check_tensor_parallel(cfg, o.tp.size);  // KDA heads
    if (cfg.num_attention_heads % o.tp.size != 0)
      throw std::invalid_argument("tensor parallelism: " + std::to_string(cfg.num_attention_heads) +
                                  " MLA heads do not split over " + std::to_string(o.tp.size) + " ranks");
  }
}

MlaOptions mla_options(const ModelOptions& o) { return MlaOptions{o.kv_norm_eps, o.mla_form}; }
MoeOptions moe_options(const ModelOptions& o) { return MoeOptions{o.moe_combine, o.num_experts}; }

// Rows [begin, end) of a seeded table.
std::vector<float> seeded_table(uint64_t seed, uint64_t table, int64_t begin, int64_t end, int64_t D,
                                float scale) {
  std::vector<float> w(static_cast<size_t>((end - begin) * D));
#pragma omp parallel for schedule(static)
  for (int64_t v = begin; v < end; ++v) {
    float* row = w.data() + (v - begin) * D;
    seeded_normals(seed, table, v, D, row);
    for (int64_t d = 0; d < D; ++d) row[d] *= scale;
  }
  return w;
}
}  // namespace

std::unique_ptr<KimiLinearForCausalLM> KimiLinearForCausalLM::from_pretrained(
    const std::filesystem::path& dir, const ModelOptions& opts) {
  if (opts.num_experts != 0 || opts.vocab != 0)
    throw std::invalid_argument(
        "from_pretrained: num_experts / vocab overrides apply to synthetic models only");
  const io::KimiLinearConfig cfg = io::load_model_config(dir);  // refuses what the spec does not define
  check_options(cfg, opts);
  const LoadAllocatorScope load_scope;  // the per-tensor temporaries reuse their pages (allocator.h)
  std::unique_ptr<KimiLinearForCausalLM> m(new KimiLinearForCausalLM(cfg, opts));
  m->init_ids();
  const int L = model_layer_count(cfg, opts.num_layers);
  const int64_t D = cfg.hidden_size, V = cfg.vocab_size;
  const Precision prec = opts.precision;
  const auto& tp = opts.tp;
  io::Checkpoint ckpt(dir);
  // A packed checkpoint (kda quantize) is used in place: its scheme must be the one asked for.
  io::packed_for_load(ckpt, opts.weights, tp.size);

  // Stages: 0 the embedding, 1..L the layers, L+1 the final norm and the head. A shard's mapping is
  // dropped after the last stage that reads from it, so the resident set holds the weights built so far
  // and the shards still in use, never the whole checkpoint.
  const bool tied = cfg.tie_word_embeddings;
  auto stage_of = [&](const std::string& key) {
    if (key == kEmbedKey) return 0;  // tied too: the head is built from the copy in memory
    if (key == kNormKey || (key == kHeadKey && !tied)) return L + 1;
    const int l = io::layer_of(key);
    return l >= 0 && l < L ? l + 1 : -1;
  };
  std::map<std::string, int> shard_last;  // shard -> last stage reading it
  const auto names = ckpt.names();
  for (const auto& key : names) {
    const int s = stage_of(key);
    if (s < 0) continue;
    int& last = shard_last[ckpt.shard_of(key)];
    last = std::max(last, s);
  }
  auto release_after = [&](int stage) {
    for (const auto& [shard, last] : shard_last)
      if (last == stage) ckpt.release_shard(shard);
  };

  // The table as the precision keeps it: bf16 read as bf16 (no fp32 copy of 1.5 GB at the real vocab).
  // A BF16 table is read in place from the mapping (its pages the file's, shared between processes):
  // a lookup reads a row as stored, so a copy (750 MB at the real vocab) would gain nothing.
  const bool bf16 = prec == Precision::BF16;
  std::vector<float> embed;
  std::vector<bf16_t> embed16;
  const bf16_t* embed_mapped = nullptr;
  std::shared_ptr<const void> embed_owner;
  if (bf16) {
    const io::TensorView& v = ckpt.get(kEmbedKey);
    if (v.dtype == io::StDType::BF16 && v.shape == std::vector<int64_t>{V, D} &&
        reinterpret_cast<uintptr_t>(v.data) % alignof(bf16_t) == 0) {
      embed_mapped = reinterpret_cast<const bf16_t*>(v.data);
      embed_owner = ckpt.file_of(kEmbedKey);
    } else {
      embed16 = ckpt.load_bf16(kEmbedKey, {V, D});
    }
  } else {
    embed = ckpt.load_f32(kEmbedKey, {V, D});
  }
  release_after(0);
  std::vector<std::unique_ptr<KimiDecoderLayer>> layers;
  layers.reserve(static_cast<size_t>(L));
  for (int i = 0; i < L; ++i) {
    const std::string p = layer_prefix(i);
    auto in_norm = ckpt.load_f32(p + "input_layernorm.weight", {D});
    auto post_norm = ckpt.load_f32(p + "post_attention_layernorm.weight", {D});
    std::unique_ptr<KimiDeltaAttention> kda;
    std::unique_ptr<KimiMLAAttention> mla;
    if (cfg.is_kda_layer(i))
      kda = KimiDeltaAttention::from_checkpoint(ckpt, cfg, i, prec, tp, opts.weights);
    else
      mla = KimiMLAAttention::from_checkpoint(ckpt, cfg, i, prec, tp, opts.weights, mla_options(opts));
    std::unique_ptr<KimiMLP> mlp;
    std::unique_ptr<KimiMoE> moe;
    if (cfg.is_moe_layer(i)) {
      moe = KimiMoE::from_checkpoint(ckpt, cfg, i, prec, tp, opts.weights, moe_options(opts));
    } else {
      const auto w = MlpWeights::load(ckpt, p + "mlp", false, D, cfg.intermediate_size, tp.rank, tp.size);
      mlp = std::make_unique<KimiMLP>(w, prec, tp, opts.weights);
    }
    layers.push_back(std::make_unique<KimiDecoderLayer>(i, std::move(in_norm), std::move(post_norm),
                                                        std::move(kda), std::move(mla), std::move(mlp),
                                                        std::move(moe)));
    release_after(i + 1);
    load_scope.trim();
  }
  auto norm = ckpt.load_f32(kNormKey, {D});
  // The head dense in the precision's type (an explicit option quantizes it), block by block; tied: the
  // embedding's rows. A dense head in the bf16 precision is built from the bf16 rows as they are (the
  // mapping, or the tied table), the others from fp32 blocks.
  const io::TensorView* head_view = tied ? nullptr : &ckpt.get(kHeadKey);
  const bool head_mapped = head_view != nullptr && head_view->dtype == io::StDType::BF16 &&
                           head_view->shape == std::vector<int64_t>{V, D} &&
                           reinterpret_cast<uintptr_t>(head_view->data) % alignof(bf16_t) == 0;
  if (m->bf16_head_source() && tied)
    m->build_head(V, embed_mapped ? embed_mapped : embed16.data());
  else if (m->bf16_head_source() && head_mapped) {
    // Block by block the rows read leave the resident set: the shard may stay mapped (a packed
    // checkpoint's last layer is used in place), and the load's peak then holds one block of them.
    const auto* head = reinterpret_cast<const bf16_t*>(head_view->data);
    m->build_head(V, head, [&](int64_t b, int64_t e) {
      io::drop_resident(head + b * D, sizeof(bf16_t) * static_cast<size_t>((e - b) * D));
    });
  } else if (tied)
    m->build_head(V, [&](int64_t b, int64_t e, std::vector<float>& rows) {
      rows.resize(static_cast<size_t>((e - b) * D));
      if (bf16)
        bf16_to_f32_array((embed_mapped ? embed_mapped : embed16.data()) + b * D, rows.data(), rows.size());
      else
        std::copy(embed.begin() + b * D, embed.begin() + e * D, rows.begin());
    });
  else
    m->build_head(V, [&](int64_t b, int64_t e, std::vector<float>& rows) {
      ckpt.load_f32_slice_into(kHeadKey, {V, D}, 0, b, e, rows);
    });
  release_after(L + 1);
  if (embed_mapped)
    m->model_ = std::make_unique<KimiLinearModel>(cfg, embed_mapped, std::move(embed_owner), V,
                                                  std::move(layers), std::move(norm));
  else if (bf16)
    m->model_ =
        std::make_unique<KimiLinearModel>(cfg, std::move(embed16), V, std::move(layers), std::move(norm));
  else
    m->model_ =
        std::make_unique<KimiLinearModel>(cfg, prec, std::move(embed), V, std::move(layers), std::move(norm));

  // One warning listing what the model did not read (layers past num_layers are skipped on purpose).
  const auto used_v = ckpt.accessed();
  const std::set<std::string> used(used_v.begin(), used_v.end());
  std::string unused;
  int n_unused = 0, n_skipped = 0;
  for (const auto& key : names) {
    if (used.count(key)) continue;
    const int l = io::layer_of(key);
    if (l >= L && l < cfg.num_hidden_layers) {
      ++n_skipped;
      continue;
    }
    unused += (n_unused++ ? ", " : "") + key;
  }
  if (n_unused > 0)
    std::cerr << "warning: " << dir.string() << ": " << n_unused << " tensor" << (n_unused > 1 ? "s" : "")
              << " not used by the model: " << unused << "\n";
  (void)n_skipped;
  return m;
}

std::unique_ptr<KimiLinearForCausalLM> KimiLinearForCausalLM::synthetic(const io::KimiLinearConfig& cfg,
                                                                        const ModelOptions& opts,
                                                                        uint64_t seed) {
  check_options(cfg, opts);
  if (opts.vocab < 0 || opts.num_experts < 0)
    throw std::invalid_argument("synthetic: vocab and num_experts must be >= 0 (0: the config's)");
  const LoadAllocatorScope load_scope;
  std::unique_ptr<KimiLinearForCausalLM> m(new KimiLinearForCausalLM(cfg, opts));
  m->init_ids();
  const int L = model_layer_count(cfg, opts.num_layers);
  const int64_t D = cfg.hidden_size, V = opts.vocab > 0 ? opts.vocab : cfg.vocab_size;
  if (V < 1) throw std::invalid_argument("synthetic: the vocabulary must be >= 1");
  const Precision prec = opts.precision;
  const auto& tp = opts.tp;
  std::vector<std::unique_ptr<KimiDeltaAttention>> kda(static_cast<size_t>(L));
  std::vector<std::unique_ptr<KimiMLAAttention>> mla(static_cast<size_t>(L));
  // Drawing the attention weights is the slow part of a real-shape start-up and layers are independent
  // (each its own seed): built in parallel, errors carried out of the region. The MLPs draw per expert
  // inside, one layer at a time, to keep the transient fp32 weights to one layer's.
  std::exception_ptr err;
#pragma omp parallel for schedule(dynamic, 1)
  for (int i = 0; i < L; ++i) {
    try {
      const uint64_t s = seed + 1000ULL * static_cast<uint64_t>(i + 1);
      if (cfg.is_kda_layer(i)) {
        auto w = KdaLayerWeights::synthetic(cfg, s);
        if (tp.size > 1) w = w.shard(cfg, tp.rank, tp.size);
        kda[i] = std::make_unique<KimiDeltaAttention>(cfg, i, w, prec, tp, opts.weights);
      } else {
        auto w = MlaLayerWeights::synthetic(cfg, s);
        if (tp.size > 1) w = w.shard(cfg, tp.rank, tp.size);
        mla[i] = std::make_unique<KimiMLAAttention>(cfg, i, w, prec, tp, opts.weights, mla_options(opts));
      }
    } catch (...) {
#pragma omp critical
      err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
  std::vector<std::unique_ptr<KimiDecoderLayer>> layers;
  for (int i = 0; i < L; ++i) {
    const uint64_t s = seed + 1000ULL * static_cast<uint64_t>(i + 1) + 500;
    std::unique_ptr<KimiMLP> mlp;
    std::unique_ptr<KimiMoE> moe;
    if (cfg.is_moe_layer(i)) {
      moe = KimiMoE::synthetic(cfg, i, s, prec, tp, opts.weights, moe_options(opts));
    } else {
      auto w = MlpWeights::synthetic(D, cfg.intermediate_size, s);
      if (tp.size > 1) w = w.shard(tp.rank, tp.size);
      mlp = std::make_unique<KimiMLP>(w, prec, tp, opts.weights);
    }
    layers.push_back(std::make_unique<KimiDecoderLayer>(
        i, std::vector<float>(static_cast<size_t>(D), 1.0f), std::vector<float>(static_cast<size_t>(D), 1.0f),
        std::move(kda[i]), std::move(mla[i]), std::move(mlp), std::move(moe)));
  }
  const float head_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  m->build_head(V, [&](int64_t b, int64_t e, std::vector<float>& rows) {
    rows = seeded_table(seed, kHeadTable, b, e, D, head_scale);
  });
  m->model_ =
      std::make_unique<KimiLinearModel>(cfg, prec, seeded_table(seed, kEmbedTable, 0, V, D, 1.0f), V,
                                        std::move(layers), std::vector<float>(static_cast<size_t>(D), 1.0f));
  return m;
}

}  // namespace kda::models
