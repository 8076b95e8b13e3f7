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

std::vector<int> KimiLinearConfig::kda_layer_ids() const {
  std::vector<int> ids;
  ids.reserve(kda_layers.size());
  for (int l : kda_layers) ids.push_back(l - 1);
  std::sort(ids.begin(), ids.end());
  return ids;
}

KimiLinearConfig parse_config(const std::string& json_text, const std::string& what) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1E999
    throw std::runtime_error(what + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw std::runtime_error(what + ": config is not a JSON object");

  const FieldReader r(what);
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

KimiLinearConfig load_config(const std::filesystem::path& path_or_dir) {
  const std::filesystem::path file =
      std::filesystem::is_directory(path_or_dir) ? path_or_dir / "config.json" : path_or_dir;
  return parse_config(read_regular_text(file, "config file"), file.string());
}

}  // namespace kda::io
