// Kimi-Linear config.json: the fields a KDA layer needs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace kda::io {

struct KimiLinearConfig {
  int64_t hidden_size = 0;
  double rms_norm_eps = 0.0;  // from config.json (1e-5 for the 48B model), never assumed
  int num_hidden_layers = 0;
  int num_heads = 0;  // linear_attn_config.num_heads
  int head_dim = 0;   // linear_attn_config.head_dim (K == V)
  int short_conv_kernel_size = 0;
  std::vector<int> kda_layers;        // as in the file: 1-based
  std::vector<int> full_attn_layers;  // as in the file: 1-based

  int projection_size() const { return num_heads * head_dim; }  // P = H * K
  // 0-based decoder layer i is a KDA layer iff (i + 1) is in kda_layers.
  bool is_kda_layer(int layer_idx) const;
  std::vector<int> kda_layer_ids() const;  // 0-based, ascending
};

// Throws std::runtime_error naming the file and the missing or bad field.
KimiLinearConfig parse_config(const std::string& json_text, const std::string& what);
KimiLinearConfig load_config(const std::filesystem::path& path_or_dir);  // dir: <dir>/config.json

}  // namespace kda::io
