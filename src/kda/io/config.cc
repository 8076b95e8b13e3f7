#include "kda/io/config.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "kda/io/file.h"
#include "kda/io/json_brief.h"

namespace kda::io {

namespace {

using nlohmann::json;

class FieldReader {
 public:
  explicit FieldReader(const std::string& what) : what_(what) {}

  [[noreturn]] void fail(const std::string& field, const std::string& problem) const {
    throw std::runtime_error(what_ + ": field '" + field + "' " + problem);
  }

  const json& require(const json& obj, const std::string& key, const std::string& field) const {
    const auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) fail(field, "is missing");
    return *it;
  }

  int64_t positive_int(const json& obj, const std::string& key, const std::string& field,
                       int64_t max = std::numeric_limits<int64_t>::max()) const {
    const int64_t v = integer(require(obj, key, field), field);
    if (v <= 0) fail(field, "must be positive, got " + std::to_string(v));
    if (v > max) fail(field, "is too large: " + std::to_string(v) + " (at most " + std::to_string(max) + ")");
    return v;
  }

  // An integer >= 0 (lo) and <= max.
  int64_t int_in(const json& obj, const std::string& key, int64_t lo, int64_t max) const {
    const int64_t v = integer(require(obj, key, key), key);
    if (v < lo || v > max)
      fail(key,
           "must be in " + std::to_string(lo) + ".." + std::to_string(max) + ", got " + std::to_string(v));
    return v;
  }

  bool boolean(const json& obj, const std::string& key) const {
    const json& v = require(obj, key, key);
    if (!v.is_boolean()) fail(key, "must be true or false, got " + json_brief(v));
    return v.get<bool>();
  }

  double finite_number(const json& obj, const std::string& key) const {
    const json& v = require(obj, key, key);
    if (!v.is_number() || !std::isfinite(v.get<double>()))
      fail(key, "must be a finite number, got " + json_brief(v));
    return v.get<double>();
  }

  std::string string(const json& obj, const std::string& key) const {
    const json& v = require(obj, key, key);
    if (!v.is_string()) fail(key, "must be a string, got " + json_brief(v));
    return v.get<std::string>();
  }

  int64_t integer(const json& j, const std::string& field) const {
    if (j.is_number_unsigned()) {
      if (j.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail(field, "is too large");
      return static_cast<int64_t>(j.get<uint64_t>());
    }
    if (!j.is_number_integer()) fail(field, "must be an integer, got " + json_brief(j));
    return j.get<int64_t>();
  }

  // A list of 1-based layer numbers, each in 1..num_layers, without repeats.
  std::vector<int> layer_list(const json& j, const std::string& field, int num_layers) const {
    if (!j.is_array()) fail(field, "must be a list of layer numbers, got " + json_brief(j));
    std::vector<int> out;
    std::set<int64_t> seen;
    for (const auto& e : j) {
      const int64_t v = integer(e, field);
      if (v < 1 || v > num_layers)
        fail(field, "holds layer " + std::to_string(v) + ", outside 1.." + std::to_string(num_layers) +
                        " (layer numbers are 1-based)");
      if (!seen.insert(v).second) fail(field, "lists layer " + std::to_string(v) + " twice");
      out.push_back(static_cast<int>(v));
    }
    return out;
  }

 private:
  const std::string& what_;
};

}  // namespace

bool KimiLinearConfig::is_kda_layer(int layer_idx) const {
  return std::find(kda_layers.begin(), kda_layers.end(), layer_idx + 1) != kda_layers.end();
}

namespace {
std::vector<int> zero_based_sorted(const std::vector<int>& one_based) {
  std::vector<int> ids;
  ids.reserve(one_based.size());
  for (int l : one_based) ids.push_back(l - 1);
  std::sort(ids.begin(), ids.end());
  return ids;
}
}  // namespace

std::vector<int> KimiLinearConfig::kda_layer_ids() const { return zero_based_sorted(kda_layers); }

bool KimiLinearConfig::is_mla_layer(int layer_idx) const {
  return std::find(full_attn_layers.begin(), full_attn_layers.end(), layer_idx + 1) != full_attn_layers.end();
}

std::vector<int> KimiLinearConfig::mla_layer_ids() const { return zero_based_sorted(full_attn_layers); }

bool KimiLinearConfig::is_moe_layer(int layer_idx) const {
  return num_experts > 0 && layer_idx >= first_k_dense_replace && moe_layer_freq > 0 &&
         layer_idx % moe_layer_freq == 0;
}

namespace {

json parse_object(const std::string& json_text, const std::string& what) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1E999
    throw std::runtime_error(what + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw std::runtime_error(what + ": config is not a JSON object");
  return j;
}

KimiLinearConfig kda_fields(const json& j, const FieldReader& r) {
  // Other architectures' configs have fields of the same names (hidden_size, num_hidden_layers) and
  // would otherwise load as a KDA layer of the wrong shapes.
  const json& model_type = r.require(j, "model_type", "model_type");
  if (!model_type.is_string() || model_type.get<std::string>() != "kimi_linear")
    r.fail("model_type", "must be \"kimi_linear\", got " + json_brief(model_type));
  KimiLinearConfig c;
  c.hidden_size = r.positive_int(j, "hidden_size", "hidden_size", kMaxHiddenSize);
  c.num_hidden_layers =
      static_cast<int>(r.positive_int(j, "num_hidden_layers", "num_hidden_layers", kMaxHiddenLayers));

  // Required: the epsilon differs between checkpoints, and a silent default would skew every norm.
  const json& eps = r.require(j, "rms_norm_eps", "rms_norm_eps");
  if (!eps.is_number()) r.fail("rms_norm_eps", "must be a number, got " + json_brief(eps));
  c.rms_norm_eps = eps.get<double>();
  if (!(c.rms_norm_eps > 0.0) || !std::isfinite(c.rms_norm_eps))
    r.fail("rms_norm_eps", "must be positive and finite, got " + json_brief(eps));

  const json& lin = r.require(j, "linear_attn_config", "linear_attn_config");
  if (!lin.is_object()) r.fail("linear_attn_config", "must be an object");
  c.num_heads = static_cast<int>(r.positive_int(lin, "num_heads", "linear_attn_config.num_heads", kMaxHeads));
  c.head_dim = static_cast<int>(r.positive_int(lin, "head_dim", "linear_attn_config.head_dim", kMaxHeadDim));
  if (c.hidden_size * c.projection_size() > kMaxProjectionElements)
    r.fail("hidden_size", "times linear_attn_config.num_heads x head_dim is " +
                              std::to_string(c.hidden_size * c.projection_size()) +
                              " weights per projection (at most " + std::to_string(kMaxProjectionElements) +
                              ")");
  c.short_conv_kernel_size = static_cast<int>(r.positive_int(
      lin, "short_conv_kernel_size", "linear_attn_config.short_conv_kernel_size", kMaxConvKernel));

  c.kda_layers = r.layer_list(r.require(lin, "kda_layers", "linear_attn_config.kda_layers"),
                              "linear_attn_config.kda_layers", c.num_hidden_layers);
  const auto full = lin.find("full_attn_layers");
  if (full != lin.end() && !full->is_null())
    c.full_attn_layers = r.layer_list(*full, "linear_attn_config.full_attn_layers", c.num_hidden_layers);
  for (int l : c.full_attn_layers)
    if (c.is_kda_layer(l - 1))
      r.fail("linear_attn_config.full_attn_layers",
             "lists layer " + std::to_string(l) + ", which kda_layers lists too");
  return c;
}

// The whole decoder's fields (kimi-linear-model.md, "Config").
void model_fields(const json& j, const FieldReader& r, KimiLinearConfig& c) {
  for (int i = 0; i < c.num_hidden_layers; ++i)
    if (!c.is_kda_layer(i) && !c.is_mla_layer(i))
      r.fail("linear_attn_config.full_attn_layers", "and kda_layers together must list every layer; layer " +
                                                        std::to_string(i + 1) + " is in neither");
  c.vocab_size = r.positive_int(j, "vocab_size", "vocab_size", kMaxVocab);
  const auto tie = j.find("tie_word_embeddings");
  if (tie != j.end() && !tie->is_null()) c.tie_word_embeddings = r.boolean(j, "tie_word_embeddings");

  // MLA: only the NoPE, no-q-LoRA form the spec defines.
  const auto q_lora = j.find("q_lora_rank");
  if (q_lora != j.end() && !q_lora->is_null())
    r.fail("q_lora_rank", "must be null (a q LoRA is not defined by the spec), got " + json_brief(*q_lora));
  if (!r.boolean(j, "mla_use_nope"))
    r.fail("mla_use_nope", "must be true (MLA with rotary embeddings is not defined by the spec)");
  c.num_attention_heads =
      static_cast<int>(r.positive_int(j, "num_attention_heads", "num_attention_heads", kMaxHeads));
  c.num_key_value_heads =
      static_cast<int>(r.positive_int(j, "num_key_value_heads", "num_key_value_heads", kMaxHeads));
  if (c.num_key_value_heads != c.num_attention_heads)
    r.fail("num_key_value_heads", "must equal num_attention_heads (" + std::to_string(c.num_attention_heads) +
                                      "), got " + std::to_string(c.num_key_value_heads));
  c.kv_lora_rank = static_cast<int>(r.positive_int(j, "kv_lora_rank", "kv_lora_rank", kMaxLoraRank));
  c.qk_nope_head_dim =
      static_cast<int>(r.positive_int(j, "qk_nope_head_dim", "qk_nope_head_dim", kMaxHeadDim));
  c.qk_rope_head_dim = static_cast<int>(r.int_in(j, "qk_rope_head_dim", 0, kMaxHeadDim));
  c.v_head_dim = static_cast<int>(r.positive_int(j, "v_head_dim", "v_head_dim", kMaxHeadDim));
  const int64_t q_out = int64_t{c.num_attention_heads} * c.qk_head_dim();
  if (c.hidden_size * q_out > kMaxProjectionElements)
    r.fail("num_attention_heads", "x (qk_nope_head_dim + qk_rope_head_dim) x hidden_size is too large");

  // MLPs.
  const auto act = j.find("hidden_act");
  if (act != j.end() && !act->is_null() && r.string(j, "hidden_act") != "silu")
    r.fail("hidden_act", "must be \"silu\", got " + json_brief(*act));
  c.intermediate_size = r.positive_int(j, "intermediate_size", "intermediate_size", kMaxIntermediate);
  const auto experts = j.find("num_experts");
  c.num_experts = experts == j.end() || experts->is_null()
                      ? 0
                      : static_cast<int>(r.int_in(j, "num_experts", 0, kMaxExperts));
  c.first_k_dense_replace = static_cast<int>(r.int_in(j, "first_k_dense_replace", 0, kMaxHiddenLayers));
  c.moe_layer_freq =
      static_cast<int>(r.positive_int(j, "moe_layer_freq", "moe_layer_freq", kMaxHiddenLayers));
  if (c.num_experts > 0) {
    c.num_experts_per_token = static_cast<int>(r.int_in(j, "num_experts_per_token", 1, c.num_experts));
    c.num_shared_experts = static_cast<int>(r.int_in(j, "num_shared_experts", 0, 64));
    c.moe_intermediate_size =
        r.positive_int(j, "moe_intermediate_size", "moe_intermediate_size", kMaxIntermediate);
    c.moe_renormalize = r.boolean(j, "moe_renormalize");
    c.routed_scaling_factor = r.finite_number(j, "routed_scaling_factor");
    if (!(c.routed_scaling_factor > 0.0)) r.fail("routed_scaling_factor", "must be positive");
    const std::string fn = r.string(j, "moe_router_activation_func");
    if (fn != "sigmoid")
      r.fail("moe_router_activation_func",
             "must be \"sigmoid\" (the only router the spec defines), got \"" + fn + "\"");
    const auto grouped = j.find("use_grouped_topk");
    if (grouped != j.end() && !grouped->is_null() && r.boolean(j, "use_grouped_topk")) {
      for (const char* f : {"num_expert_group", "topk_group"}) {
        const auto g = j.find(f);
        if (g != j.end() && !g->is_null() && r.integer(*g, f) != 1)
          r.fail(
              f,
              "must be 1 with use_grouped_topk (grouped top-k over several groups is not implemented), got " +
                  json_brief(*g));
      }
    }
  }
  for (const char* f : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
    const auto t = j.find(f);
    if (t == j.end() || t->is_null()) continue;
    const int64_t v = r.integer(*t, f);
    (std::string(f) == "bos_token_id"   ? c.bos_token_id
     : std::string(f) == "eos_token_id" ? c.eos_token_id
                                        : c.pad_token_id) = v;
  }
  c.has_model_fields = true;
}

}  // namespace

KimiLinearConfig parse_config(const std::string& json_text, const std::string& what) {
  const json j = parse_object(json_text, what);
  return kda_fields(j, FieldReader(what));
}

KimiLinearConfig parse_model_config(const std::string& json_text, const std::string& what) {
  const json j = parse_object(json_text, what);
  const FieldReader r(what);
  KimiLinearConfig c = kda_fields(j, r);
  model_fields(j, r, c);
  return c;
}

KimiLinearConfig load_model_config(const std::filesystem::path& path_or_dir) {
  const std::filesystem::path file =
      std::filesystem::is_directory(path_or_dir) ? path_or_dir / "config.json" : path_or_dir;
  return parse_model_config(read_regular_text(file, "config file"), file.string());
}

KimiLinearConfig load_config(const std::filesystem::path& path_or_dir) {
  const std::filesystem::path file =
      std::filesystem::is_directory(path_or_dir) ? path_or_dir / "config.json" : path_or_dir;
  return parse_config(read_regular_text(file, "config file"), file.string());
}

}  // namespace kda::io
