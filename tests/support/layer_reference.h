// The KDA layer in float64, straight from the spec's per-token forward (spec, "Forward"): the reference
// for tests whose weights are not those of the vendored dumps (e.g. a checkpoint stored in BF16).
#pragma once

#include <cstdint>
#include <vector>

#include "kda/io/config.h"
#include "kda/models/kimi_linear.h"

namespace kda::testing {

struct LayerReference {
  std::vector<double> out;              // [T, D]
  std::vector<double> recurrent_state;  // [N, H, K, V]
  std::vector<double> conv_state;       // [N, W-1, 3P] raw pre-conv inputs, oldest first, q|k|v
};

// hidden_states [T, D]; cu_seqlens [N+1]; initial states may be empty (zeros).
LayerReference reference_layer(const io::KimiLinearConfig& cfg, const models::KdaLayerWeights& w,
                               const std::vector<float>& hidden_states,
                               const std::vector<int32_t>& cu_seqlens,
                               const std::vector<float>& initial_recurrent_state,
                               const std::vector<float>& initial_conv_state);

}  // namespace kda::testing
