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

// Bounds parse_config enforces: far above any published Kimi-Linear shape (hidden 2304, 27 layers, 32 heads
// of 128, conv width 4), low enough that every size derived from them (weights, one slot's state, a
// step's activations) fits int64 with room, and that no single buffer asks for more than tens of GiB.
inline constexpr int64_t kMaxHiddenSize = 1 << 16;
inline constexpr int64_t kMaxHiddenLayers = 1024;
inline constexpr int64_t kMaxHeads = 1024;
inline constexpr int64_t kMaxHeadDim = 1024;
inline constexpr int64_t kMaxConvKernel = 64;
// Elements of one projection's weight, hidden_size x num_heads * head_dim.
inline constexpr int64_t kMaxProjectionElements = int64_t{1} << 32;

// Throws std::runtime_error naming the file and the missing, bad or out-of-bounds field.
KimiLinearConfig parse_config(const std::string& json_text, const std::string& what);
KimiLinearConfig load_config(const std::filesystem::path& path_or_dir);  // dir: <dir>/config.json

}  // namespace kda::io
