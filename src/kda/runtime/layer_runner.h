// Runs one KDA layer over a case through the full stack -- pools, backend, layer -- as a serving engine
// would: slots come from the request pool, initial states are placed in those slots, one EXTEND batch
// covers every sequence, and optionally the last tokens of each sequence run as DECODE steps.
// `kda run`, `kda verify` and the tests all go through here.
#pragma once

#include <cstdint>
#include <vector>

#include "kda/io/config.h"
#include "kda/io/npy.h"
#include "kda/kernels/kda/kda.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/models/kimi_linear.h"

namespace kda::runtime {

// One case's inputs (the dump schema): hidden_states [T, D], cu_seqlens [N+1] (absent: one sequence),
// initial_recurrent_state [N, H, K, V] and initial_conv_state [N, W-1, 3P] (each empty when absent).
struct LayerCase {
  int64_t T = 0, D = 0, N = 0;
  std::vector<float> hidden_states;
  std::vector<int32_t> cu_seqlens;
  std::vector<float> initial_recurrent_state;
  std::vector<float> initial_conv_state;

  // Checks every shape against the config and cu_seqlens (starts at 0, non-decreasing, ends at T);
  // std::invalid_argument names the array and what is wrong.
  static LayerCase from_npz(const io::NpzArchive& npz, const io::KimiLinearConfig& cfg);
  int32_t seq_len(int64_t i) const { return cu_seqlens[i + 1] - cu_seqlens[i]; }
};

struct LayerResult {
  std::vector<float> out;              // [T, D]
  std::vector<float> recurrent_state;  // [N, H, K, V]
  std::vector<float> conv_state;       // [N, W-1, 3P]
};

// The pool run_layer_case serves the layer from: `slots` slots of this rank's heads and channels (1/N
// of the whole layer's under N-way tensor parallelism), the conv state in the layer's precision.
mem_cache::RecurrentStatePoolConfig layer_pool_config(const models::KimiDeltaAttention& layer,
                                                      const io::KimiLinearConfig& cfg, int64_t slots);

// decode_tail K: each sequence's last min(K, T_i) tokens run as DECODE steps after an EXTEND of the
// rest (all sequences together; a sequence leaves the batch when it is done). K = 0: EXTEND only.
LayerResult run_layer_case(models::KimiDeltaAttention& layer, const io::KimiLinearConfig& cfg,
                           const LayerCase& c, int decode_tail, kernels::KernelImpl kernel);

}  // namespace kda::runtime
