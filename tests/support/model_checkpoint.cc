#include "support/model_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numbers>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

#include "kda/common/bf16.h"
#include "support/test_support.h"

namespace kda::testing {

namespace {

// How a tensor is drawn: normal with stddev scale / sqrt(fan-in), 1 + scale * normal (norm weights),
// uniform(-scale, scale), or the KDA decay parameters as the HF model initialises them.
enum class Init { Fan, Norm, Uniform, Normal, ALog, DtBias };

struct KeySpec {
  std::string key;
  std::vector<int64_t> shape;
  Init init;
  double scale;
};

// Every key of the checkpoint in the real checkpoint's order: the embedding, the layers in order, the
// final norm, the LM head. The scales follow the tiny dumps' weights: unit-RMS activations into every
// projection, bottleneck second halves and down projections smaller, router bias ~ N(0, 0.1).
std::vector<KeySpec> model_keys(const io::KimiLinearConfig& cfg) {
  const int64_t D = cfg.hidden_size, H = cfg.num_heads, K = cfg.head_dim, P = H * K,
                W = cfg.short_conv_kernel_size, V = cfg.vocab_size, Hm = cfg.num_attention_heads,
                R = cfg.kv_lora_rank, r = cfg.qk_rope_head_dim, dn = cfg.qk_nope_head_dim,
                dv = cfg.v_head_dim;
  std::vector<KeySpec> keys;
  keys.push_back({"model.embed_tokens.weight", {V, D}, Init::Normal, 1.0});
  for (int i = 0; i < cfg.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    std::vector<KeySpec> layer;
    layer.push_back({p + "input_layernorm.weight", {D}, Init::Norm, 0.1});
    layer.push_back({p + "post_attention_layernorm.weight", {D}, Init::Norm, 0.1});
    const std::string a = p + "self_attn.";
    if (cfg.is_kda_layer(i)) {
      for (const char* n : {"q_proj", "k_proj", "v_proj"}) {
        layer.push_back({a + n + ".weight", {P, D}, Init::Fan, 1.0});
        layer.push_back({a + std::string(n).substr(0, 1) + "_conv1d.weight", {P, 1, W}, Init::Uniform, 0.5});
      }
      layer.push_back({a + "A_log", {1, 1, H, 1}, Init::ALog, 0.0});
      layer.push_back({a + "dt_bias", {P}, Init::DtBias, 0.0});
      layer.push_back({a + "f_a_proj.weight", {K, D}, Init::Fan, 1.0});
      layer.push_back({a + "f_b_proj.weight", {P, K}, Init::Fan, 0.23});
      layer.push_back({a + "b_proj.weight", {H, D}, Init::Fan, 1.0});
      layer.push_back({a + "g_a_proj.weight", {K, D}, Init::Fan, 1.0});
      layer.push_back({a + "g_b_proj.weight", {P, K}, Init::Fan, 0.23});
      layer.push_back({a + "o_norm.weight", {K}, Init::Norm, 0.1});
      layer.push_back({a + "o_proj.weight", {D, P}, Init::Fan, 1.28});
    } else {
      layer.push_back({a + "q_proj.weight", {Hm * (dn + r), D}, Init::Fan, 1.0});
      layer.push_back({a + "kv_a_proj_with_mqa.weight", {R + r, D}, Init::Fan, 0.45});
      layer.push_back({a + "kv_a_layernorm.weight", {R}, Init::Norm, 0.1});
      layer.push_back({a + "kv_b_proj.weight", {Hm * (dn + dv), R}, Init::Fan, 1.0});
      layer.push_back({a + "o_proj.weight", {D, Hm * dv}, Init::Fan, 1.0});
    }
    if (cfg.is_moe_layer(i)) {
      const std::string m = p + "block_sparse_moe.";
      const int64_t E = cfg.num_experts, Ie = cfg.moe_intermediate_size, S = cfg.num_shared_experts;
      layer.push_back({m + "gate.weight", {E, D}, Init::Fan, 1.0});
      layer.push_back({m + "gate.e_score_correction_bias", {E}, Init::Normal, 0.1});
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = m + "experts." + std::to_string(e) + ".";
        layer.push_back({x + "w1.weight", {Ie, D}, Init::Fan, 1.0});
        layer.push_back({x + "w2.weight", {D, Ie}, Init::Fan, 0.5});
        layer.push_back({x + "w3.weight", {Ie, D}, Init::Fan, 1.0});
      }
      if (S > 0) {
        layer.push_back({m + "shared_experts.gate_proj.weight", {Ie * S, D}, Init::Fan, 1.0});
        layer.push_back({m + "shared_experts.up_proj.weight", {Ie * S, D}, Init::Fan, 1.0});
        layer.push_back({m + "shared_experts.down_proj.weight", {D, Ie * S}, Init::Fan, 0.5});
      }
    } else {
      const int64_t I = cfg.intermediate_size;
      layer.push_back({p + "mlp.gate_proj.weight", {I, D}, Init::Fan, 1.0});
      layer.push_back({p + "mlp.up_proj.weight", {I, D}, Init::Fan, 1.0});
      layer.push_back({p + "mlp.down_proj.weight", {D, I}, Init::Fan, 0.5});
    }
    std::sort(layer.begin(), layer.end(), [](const KeySpec& x, const KeySpec& y) { return x.key < y.key; });
    keys.insert(keys.end(), layer.begin(), layer.end());
  }
  keys.push_back({"model.norm.weight", {D}, Init::Norm, 0.1});
  if (!cfg.tie_word_embeddings) keys.push_back({"lm_head.weight", {V, D}, Init::Fan, 1.0});
  return keys;
}

uint64_t fnv1a(const std::string& s, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// A counter-based generator (splitmix64): fast, and every tensor's stream depends only on its key and
// the seed, so tensors can be drawn in parallel.
struct Rng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }  // in (0, 1)
};

std::vector<float> draw(const KeySpec& k, uint64_t seed) {
  const size_t n = static_cast<size_t>(numel(k.shape));
  Rng rng{fnv1a(k.key, seed)};
  std::vector<float> v(n);
  auto normals = [&](double stddev, double mean) {
    for (size_t i = 0; i < n; i += 2) {  // Box-Muller: two normals per two uniforms
      const double r = std::sqrt(-2.0 * std::log(rng.uniform())), a = 2.0 * std::numbers::pi * rng.uniform();
      v[i] = static_cast<float>(mean + stddev * r * std::cos(a));
      if (i + 1 < n) v[i + 1] = static_cast<float>(mean + stddev * r * std::sin(a));
    }
  };
  auto uniforms = [&](double lo, double hi) {
    for (float& x : v) x = static_cast<float>(lo + (hi - lo) * rng.uniform());
  };
  switch (k.init) {
    case Init::Fan:
      normals(k.scale / std::sqrt(static_cast<double>(k.shape.back())), 0.0);
      break;
    case Init::Normal:
      normals(k.scale, 0.0);
      break;
    case Init::Norm:
      normals(k.scale, 1.0);
      break;
    case Init::Uniform:
      uniforms(-k.scale, k.scale);
      break;
    case Init::ALog:  // A ~ U(1, 16), stored as log A
      uniforms(1.0, 16.0);
      for (float& x : v) x = std::log(x);
      break;
    case Init::DtBias:  // dt log-uniform in [1e-3, 1e-1], stored as softplus^-1(dt)
      uniforms(std::log(1e-3), std::log(1e-1));
      for (float& x : v) {
        const double dt = std::exp(static_cast<double>(x));
        x = static_cast<float>(dt + std::log(-std::expm1(-dt)));
      }
      break;
  }
  return v;
}

bool keeps_f32(const std::string& key) {
  return key.size() >= 5 && (key.ends_with(".A_log") || key.ends_with(".dt_bias"));
}

size_t stored_bytes(const io::StTensor& t) {
  return static_cast<size_t>(numel(t.shape)) * (t.dtype == io::StDType::F32 ? 4 : 2);
}

// The real checkpoint's order of a key set: embed_tokens, layers by number, model.norm, lm_head.
std::vector<std::string> ordered_keys(const TensorMap& weights) {
  auto rank = [](const std::string& k) -> std::pair<int64_t, std::string> {
    if (k.rfind("model.embed_tokens.", 0) == 0) return {-1, k};
    if (k.rfind("model.layers.", 0) == 0) return {std::stoll(k.substr(13)), k};
    if (k.rfind("model.norm.", 0) == 0) return {int64_t{1} << 40, k};
    return {(int64_t{1} << 40) + 1, k};
  };
  std::vector<std::string> keys;
  for (const auto& [k, t] : weights) keys.push_back(k);
  std::sort(keys.begin(), keys.end(),
            [&](const std::string& a, const std::string& b) { return rank(a) < rank(b); });
  return keys;
}

}  // namespace

TensorMap random_model_weights(const io::KimiLinearConfig& cfg, uint64_t seed, io::StDType dtype) {
  if (!cfg.has_model_fields)
    throw std::invalid_argument("random_model_weights: the config has no model fields (parse_model_config)");
  if (dtype == io::StDType::F16)
    throw std::invalid_argument("random_model_weights: dtype F16 is not written");
  const std::vector<KeySpec> keys = model_keys(cfg);
  std::vector<io::StTensor> tensors(keys.size());
#pragma omp parallel for schedule(dynamic)
  for (size_t i = 0; i < keys.size(); ++i) {
    io::StTensor& t = tensors[i];
    t.shape = keys[i].shape;
    t.values = draw(keys[i], seed);
    t.dtype = keeps_f32(keys[i].key) ? io::StDType::F32 : dtype;
    if (t.dtype == io::StDType::BF16) round_bf16_inplace(t.values.data(), t.values.size());
  }
  TensorMap out;
  for (size_t i = 0; i < keys.size(); ++i) out.emplace(keys[i].key, std::move(tensors[i]));
  return out;
}

std::string model_config_json(const io::KimiLinearConfig& cfg) {
  using nlohmann::json;
  json j;
  j["architectures"] = {"KimiLinearForCausalLM"};
  j["model_type"] = "kimi_linear";
  j["hidden_size"] = cfg.hidden_size;
  j["num_hidden_layers"] = cfg.num_hidden_layers;
  j["rms_norm_eps"] = cfg.rms_norm_eps;
  j["vocab_size"] = cfg.vocab_size;
  j["tie_word_embeddings"] = cfg.tie_word_embeddings;
  j["linear_attn_config"] = {{"num_heads", cfg.num_heads},
                             {"head_dim", cfg.head_dim},
                             {"short_conv_kernel_size", cfg.short_conv_kernel_size},
                             {"kda_layers", cfg.kda_layers},
                             {"full_attn_layers", cfg.full_attn_layers}};
  j["q_lora_rank"] = nullptr;
  j["mla_use_nope"] = true;
  j["num_attention_heads"] = cfg.num_attention_heads;
  j["num_key_value_heads"] = cfg.num_key_value_heads;
  j["kv_lora_rank"] = cfg.kv_lora_rank;
  j["qk_nope_head_dim"] = cfg.qk_nope_head_dim;
  j["qk_rope_head_dim"] = cfg.qk_rope_head_dim;
  j["v_head_dim"] = cfg.v_head_dim;
  j["hidden_act"] = "silu";
  j["intermediate_size"] = cfg.intermediate_size;
  j["first_k_dense_replace"] = cfg.first_k_dense_replace;
  j["moe_layer_freq"] = cfg.moe_layer_freq;
  if (cfg.num_experts > 0) {
    j["num_experts"] = cfg.num_experts;
    j["num_experts_per_token"] = cfg.num_experts_per_token;
    j["num_shared_experts"] = cfg.num_shared_experts;
    j["moe_intermediate_size"] = cfg.moe_intermediate_size;
    j["moe_renormalize"] = cfg.moe_renormalize;
    j["routed_scaling_factor"] = cfg.routed_scaling_factor;
    j["moe_router_activation_func"] = "sigmoid";
    j["use_grouped_topk"] = true;
    j["num_expert_group"] = 1;
    j["topk_group"] = 1;
  } else {
    j["num_experts"] = nullptr;
  }
  if (cfg.bos_token_id >= 0) j["bos_token_id"] = cfg.bos_token_id;
  if (cfg.eos_token_id >= 0) j["eos_token_id"] = cfg.eos_token_id;
  if (cfg.pad_token_id >= 0) j["pad_token_id"] = cfg.pad_token_id;
  return j.dump(2);
}

void write_model_checkpoint(const std::filesystem::path& dir, const io::KimiLinearConfig& cfg,
                            const TensorMap& weights, int shards) {
  const std::vector<std::string> keys = ordered_keys(weights);
  if (shards < 1 || static_cast<size_t>(shards) > keys.size())
    throw std::invalid_argument("write_model_checkpoint: shards = " + std::to_string(shards) +
                                " must be in 1.." + std::to_string(keys.size()) + " (the number of tensors)");
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir / "config.json", std::ios::binary);
    f << model_config_json(cfg) << "\n";
    if (!f)
      throw std::runtime_error("write_model_checkpoint: cannot write " + (dir / "config.json").string());
  }
  // Contiguous runs of keys, each closed once it reaches its share of the bytes (or when every
  // remaining key must start a shard of its own).
  size_t total = 0;
  for (const auto& k : keys) total += stored_bytes(weights.at(k));
  std::vector<std::vector<std::string>> groups(1);
  size_t in_group = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const size_t remaining_keys = keys.size() - i, remaining_shards = shards - groups.size();
    if (!groups.back().empty() && remaining_shards > 0 &&
        (in_group * shards >= total || remaining_keys <= remaining_shards)) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(keys[i]);
    in_group += stored_bytes(weights.at(keys[i]));
  }
  nlohmann::json map = nlohmann::json::object();
  char name[64];
  for (size_t g = 0; g < groups.size(); ++g) {
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", g + 1, groups.size());
    std::map<std::string, io::StTensor> part;
    for (const auto& k : groups[g]) {
      part.emplace(k, weights.at(k));
      map[k] = name;
    }
    io::write_safetensors(dir / name, part);
  }
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", map}};
  std::ofstream f(dir / "model.safetensors.index.json", std::ios::binary);
  f << index.dump(2) << "\n";
  if (!f) throw std::runtime_error("write_model_checkpoint: cannot write the index in " + dir.string());
}

TensorMap read_model_weights(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> files;
  if (std::filesystem::exists(dir / "model.safetensors.index.json")) {
    std::set<std::string> shards;
    for (const auto& [k, f] :
         io::parse_safetensors_index(read_file(dir / "model.safetensors.index.json"), dir.string()))
      shards.insert(f);
    for (const auto& s : shards) files.push_back(dir / s);
  } else {
    files.push_back(dir / "model.safetensors");
  }
  TensorMap out;
  for (const auto& path : files) {
    const io::SafetensorsFile file(path);
    for (const auto& name : file.names()) {
      const io::TensorView& v = *file.find(name);
      io::StTensor t;
      t.shape = v.shape;
      t.dtype = v.dtype;
      const size_t n = static_cast<size_t>(v.numel());
      t.values.resize(n);
      for (size_t i = 0; i < n; ++i) {
        if (v.dtype == io::StDType::F32) {
          std::memcpy(&t.values[i], v.data + 4 * i, 4);
        } else {
          uint16_t h;
          std::memcpy(&h, v.data + 2 * i, 2);
          t.values[i] = v.dtype == io::StDType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
        }
      }
      if (!out.emplace(name, std::move(t)).second)
        throw std::runtime_error("read_model_weights: tensor '" + name + "' stored twice in " + dir.string());
    }
  }
  return out;
}

}  // namespace kda::testing
