// Where a tensor-parallel rank's part of the per-request states sits in the full layouts.
//   recurrent [N, H, K, V]: rank r holds heads [r H/n, (r+1) H/n)       -> [N, H/n, K, V]
//   conv [N, W-1, 3P] (q||k||v): rank r holds channels [r P/n, (r+1) P/n) of each of q, k and v,
//                                laid out q_r||k_r||v_r                  -> [N, W-1, 3P/n]
#pragma once

#include <cstdint>
#include <vector>

namespace kda::distributed {

struct StateDims {
  int64_t n = 0;      // sequences
  int64_t heads = 0;  // H (full)
  int64_t k = 0, v = 0;
  int64_t conv_rows = 0;  // W-1
};

std::vector<float> shard_recurrent(const std::vector<float>& full, const StateDims& d, int rank, int size);
std::vector<float> shard_conv(const std::vector<float>& full, const StateDims& d, int rank, int size);
// Inverse: `parts` holds every rank's shard, rank-major, as allgather returns them.
std::vector<float> unshard_recurrent(const std::vector<float>& parts, const StateDims& d, int size);
std::vector<float> unshard_conv(const std::vector<float>& parts, const StateDims& d, int size);

}  // namespace kda::distributed
