// The Kimi-Linear-48B-A3B geometry (config.json of the published checkpoint; kda-numerics.md), in one
// place for the synthetic models, the tests and the benchmarks: hidden 2304, 27 decoder layers of which
// 20 are KDA (the other 7, full_attn_layers, are MLA), 32 heads x 128 (K = V), short conv width 4,
// rms_norm_eps 1e-5.
#pragma once

#include <cstdint>

#include "kda/io/config.h"

namespace kda::io {

// The shape as compile-time constants (array sizes, benchmark arguments).
struct KimiLinear48bShape {
  static constexpr int64_t kHidden = 2304;                   // D
  static constexpr int kHeads = 32;                          // H
  static constexpr int kHeadDim = 128;                       // K = V
  static constexpr int64_t kProjection = kHeads * kHeadDim;  // P = H K
  static constexpr int64_t kConvDim = 3 * kProjection;       // the short conv's channels, q || k || v
  static constexpr int kConvKernel = 4;                      // W
  static constexpr int kLayers = 27;
  static constexpr int kKdaLayers = 20;
  static constexpr double kRmsNormEps = 1e-5;
};

// The same as a model config, as parse_config would read the published config.json.
inline KimiLinearConfig kimi_linear_48b_config() {
  using S = KimiLinear48bShape;
  KimiLinearConfig c;
  c.hidden_size = S::kHidden;
  c.rms_norm_eps = S::kRmsNormEps;
  c.num_hidden_layers = S::kLayers;
  c.num_heads = S::kHeads;
  c.head_dim = S::kHeadDim;
  c.short_conv_kernel_size = S::kConvKernel;
  c.kda_layers = {1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26};
  c.full_attn_layers = {4, 8, 12, 16, 20, 24, 27};
  return c;
}

// The geometry with one decoder layer, a KDA layer: what a single layer's tests and benchmarks build.
inline KimiLinearConfig kimi_linear_48b_one_layer_config() {
  KimiLinearConfig c = kimi_linear_48b_config();
  c.num_hidden_layers = 1;
  c.kda_layers = {1};
  c.full_attn_layers = {};
  return c;
}

}  // namespace kda::io
