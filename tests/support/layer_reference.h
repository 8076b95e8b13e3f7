// The KDA layer in float64, straight from the spec's per-token forward (spec, "Forward"): the reference
// for tests whose weights are not those of the vendored dumps (e.g. a checkpoint stored in BF16), and
// the KDA layers of the whole decoder's reference (model_reference.h).
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

// A KDA layer's weights as the float64 reference reads them: fp32 arrays in kda-numerics.md's shapes.
struct KdaRefWeights {
  const float *q_proj, *k_proj, *v_proj;        // [P, D]
  const float *q_conv1d, *k_conv1d, *v_conv1d;  // [P, 1, W]
  const float *A_log, *dt_bias;                 // [H], [P]
  const float *f_a_proj, *g_a_proj;             // [K, D]
  const float *f_b_proj, *g_b_proj;             // [P, K]
  const float* b_proj;                          // [H, D]
  const float* o_norm;                          // [K]
  const float* o_proj;                          // [D, P]
};
KdaRefWeights ref_weights(const models::KdaLayerWeights& w);

// The core both references share: x [T, D] (packed segments, cu [N+1]) through one KDA layer, token by
// token; segment n continues from and updates recurrent[n] ([H, K, V]) and conv[n] ([W-1, 3P]); out
// [T, D]. bf16: values rounded to bf16 at kda-numerics.md's bf16 points (the caller rounds the weights
// and the input).
void kda_reference_segments(const io::KimiLinearConfig& cfg, const KdaRefWeights& w, const double* x,
                            const std::vector<int64_t>& cu, const std::vector<double*>& recurrent,
                            const std::vector<double*>& conv, double* out, bool bf16);

}  // namespace kda::testing
