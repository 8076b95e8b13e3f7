#include "kda/models/quantize_checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/allocator.h"
#include "kda/io/checkpoint_keys.h"
#include "kda/io/config.h"
#include "kda/io/file.h"
#include "kda/io/packed_checkpoint.h"
#include "kda/io/safetensors.h"
#include "kda/kernels/gemm/weight_format.h"
#include "kda/layers/moe/swiglu.h"
#include "kda/models/kimi_linear.h"
#include "kda/models/kimi_mla.h"
#include "kda/models/kimi_moe.h"

namespace kda::models {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The source tensors a layer's packed projections replace (the rest of the layer is copied as it is):
// what KdaLayerWeights, MlaLayerWeights and MlpWeights read as projections.
const std::vector<std::string>& kda_projection_keys() {
  static const std::vector<std::string> k = {"q_proj", "k_proj",   "v_proj",   "f_a_proj", "g_a_proj",
                                             "b_proj", "f_b_proj", "g_b_proj", "o_proj"};
  return k;
}
const std::vector<std::string>& mla_projection_keys() {
  static const std::vector<std::string> k = {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"};
  return k;
}

std::string shard_name(int s, int n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", s + 1, n);
  return buf;
}

void check_out_dir(const fs::path& out) {
  std::error_code ec;
  if (!fs::exists(out, ec)) return;
  if (!fs::is_directory(out, ec))
    throw std::invalid_argument("--out " + out.string() + " exists and is not a directory");
  if (!fs::is_empty(out, ec))
    throw std::invalid_argument("--out " + out.string() +
                                " exists and is not empty: kda quantize writes a new folder (remove it or "
                                "name another)");
}

}  // namespace

QuantizeSummary quantize_checkpoint(const fs::path& model, const fs::path& out, Weights weights) {
  if (weights != Weights::Int8 && weights != Weights::Int4)
    throw std::invalid_argument(std::string("kda quantize: --weights must be int8 or int4, got ") +
                                to_string(weights) + " (bf16 checkpoints load as they are)");
  if (!fs::is_directory(model))
    throw std::invalid_argument("--model " + model.string() + " is not a checkpoint folder");
  check_out_dir(out);
  std::error_code ec;
  if (fs::equivalent(model, out, ec)) throw std::invalid_argument("--out must differ from --model");
  const LoadAllocatorScope load_scope;  // each tensor's fp32 copy reuses the last one's pages (allocator.h)
  const io::KimiLinearConfig cfg = io::load_model_config(model);
  io::Checkpoint ckpt(model);
  if (const auto w = io::packed_weights(ckpt))
    throw std::invalid_argument("--model " + model.string() + " is already a packed " + to_string(*w) +
                                " checkpoint; quantize its source checkpoint");
  const int L = cfg.num_hidden_layers;
  const int n_shards = L + 1;
  const int64_t D = cfg.hidden_size;
  fs::create_directories(out);

  // A source shard is unmapped after the last output shard that reads from it (as the loader does), so
  // the resident set holds one layer's source and packed weights, not the whole checkpoint.
  const std::vector<std::string> names = ckpt.names();
  auto stage_of = [&](const std::string& key) {
    const int l = io::layer_of(key);
    return l >= 0 && l < L ? l : L;
  };
  std::map<std::string, int> shard_last;
  for (const auto& key : names) {
    int& last = shard_last[ckpt.shard_of(key)];
    last = std::max(last, stage_of(key));
  }

  QuantizeSummary sum;
  sum.layers = L;
  json weight_map = json::object();
  const auto meta = io::packed_metadata(weights);
  std::set<std::string> replaced;  // source projections written packed
  for (int s = 0; s <= L; ++s) {
    std::vector<io::StRawTensor> tensors;
    // The layer's modules stay alive until its shard is written: the packed tensors are views of them.
    std::unique_ptr<KimiDeltaAttention> kda;
    std::unique_ptr<KimiMLAAttention> mla;
    std::unique_ptr<KimiMoE> moe;
    std::unique_ptr<KimiMLP> mlp;
    std::unique_ptr<kernels::gemm::PackedMatrix> kv_b;
    auto pack = [&](const std::string& name, const layers::Linear& lin) {
      const kernels::gemm::PackedMatrix* p = lin.packed();
      if (!p || p->view().format != weights)
        throw std::logic_error("kda quantize: projection " + name + " was not packed as " +
                               to_string(weights));
      io::append_packed(tensors, name, *p);
      ++sum.packed;
    };
    auto pack_mlp = [&](const std::string& prefix, const layers::moe::SwigluMlp& m) {
      pack(prefix + ".gate_up_proj", m.gate_up());
      pack(prefix + ".down_proj", m.down());
    };
    // An expert as the MoE slices it: pieces.{p}.gate_up_proj / down_proj.
    auto pack_pieces = [&](const std::string& prefix, const layers::moe::SwigluPieces& m) {
      for (int q = 0; q < m.pieces(); ++q) pack_mlp(prefix + ".pieces." + std::to_string(q), m.piece(q));
    };
    if (s < L) {
      const std::string p = "model.layers." + std::to_string(s) + ".";
      const std::string attn = p + "self_attn.";
      if (cfg.is_kda_layer(s)) {
        kda = KimiDeltaAttention::from_checkpoint(ckpt, cfg, s, Precision::FP32, {}, weights);
        for (const auto& [name, lin] : kda->projections()) pack(attn + name, *lin);
        for (const auto& k : kda_projection_keys()) replaced.insert(attn + k + ".weight");
      } else {
        mla = KimiMLAAttention::from_checkpoint(ckpt, cfg, s, Precision::FP32, {}, weights);
        for (const auto& [name, lin] : mla->projections()) pack(attn + name, *lin);
        // kv_b is no Linear in the layer: packed here as the layer packs it (effective_kvb).
        const int64_t R = cfg.kv_lora_rank,
                      out_kvb = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim);
        const auto w = ckpt.load_f32(attn + "kv_b_proj.weight", {out_kvb, R});
        kv_b = std::make_unique<kernels::gemm::PackedMatrix>(weights, w.data(), R, out_kvb);
        io::append_packed(tensors, attn + "kv_b_proj", *kv_b);
        ++sum.packed;
        for (const auto& k : mla_projection_keys()) replaced.insert(attn + k + ".weight");
      }
      if (cfg.is_moe_layer(s)) {
        moe = KimiMoE::from_checkpoint(ckpt, cfg, s, Precision::FP32, {}, weights);
        const std::string m = p + "block_sparse_moe.";
        for (int e = 0; e < moe->num_experts(); ++e) {
          const std::string x = m + "experts." + std::to_string(e);
          pack_pieces(x, moe->expert(e));
          for (const char* k : {".w1.weight", ".w2.weight", ".w3.weight"}) replaced.insert(x + k);
        }
        if (const layers::moe::SwigluPieces* sh = moe->shared_expert()) {
          pack_pieces(m + "shared_experts", *sh);
          for (const char* k : {".gate_proj.weight", ".up_proj.weight", ".down_proj.weight"})
            replaced.insert(m + "shared_experts" + k);
        }
      } else {
        mlp = std::make_unique<KimiMLP>(MlpWeights::load(ckpt, p + "mlp", false, D, cfg.intermediate_size),
                                        Precision::FP32, distributed::TensorParallel{}, weights);
        pack_mlp(p + "mlp", mlp->mlp());
        for (const char* k : {".gate_proj.weight", ".up_proj.weight", ".down_proj.weight"})
          replaced.insert(p + "mlp" + k);
      }
    }
    // The stage's other tensors, bytes as they are (the loader converts them as it does a plain
    // checkpoint's).
    for (const auto& key : names) {
      if (stage_of(key) != s || replaced.count(key)) continue;
      const io::TensorView& v = ckpt.get(key);
      tensors.push_back({key, v.dtype, v.shape, v.data, v.nbytes});
      ++sum.copied;
    }
    const std::string file = shard_name(s, n_shards);
    io::write_safetensors_raw(out / file, tensors, meta);
    for (const auto& t : tensors) {
      weight_map[t.name] = file;
      sum.bytes += static_cast<int64_t>(t.nbytes);
    }
    for (const auto& [shard, last] : shard_last)
      if (last == s) ckpt.release_shard(shard);
  }

  // config.json with the scheme, the folder's other files as they are, then the index: a folder without
  // it is not a checkpoint, so an interrupted run leaves nothing a loader would take.
  json config = json::parse(io::read_regular_text(model / "config.json", "config file"));
  config["quantization_config"] = {{"quant_method", "kda"},
                                   {"kda_format", io::kPackedFormat},
                                   {"weights", to_string(weights)},
                                   {"group_size", weights == Weights::Int4 ? 32 : 0}};
  const std::string config_text = config.dump(2) + "\n";
  io::write_file_atomic(out / "config.json", config_text.data(), config_text.size());
  for (const auto& entry : fs::directory_iterator(model)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || name == "config.json" || name == "model.safetensors.index.json" ||
        entry.path().extension() == ".safetensors")
      continue;
    fs::copy_file(entry.path(), out / name, fs::copy_options::overwrite_existing);
  }
  json meta_json = json::object();
  for (const auto& [k, v] : meta) meta_json[k] = v;
  meta_json["total_size"] = sum.bytes;
  const std::string index = json{{"metadata", meta_json}, {"weight_map", weight_map}}.dump(2) + "\n";
  io::write_file_atomic(out / "model.safetensors.index.json", index.data(), index.size());
  return sum;
}

}  // namespace kda::models
