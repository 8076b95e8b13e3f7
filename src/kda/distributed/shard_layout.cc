#include "kda/distributed/shard_layout.h"

#include <algorithm>

namespace kda::distributed {

namespace {

// Moves one rank's blocks between the full layout and its shard layout. Recurrent: per sequence one
// block of H/n heads. Conv: per (sequence, row) three blocks of P/n channels (q, k, v).
template <bool kToShard>
void move_recurrent(const StateDims& d, int rank, int size, const float* src, float* dst) {
  const int64_t hl = d.heads / size, head = d.k * d.v, blk = hl * head;
  for (int64_t i = 0; i < d.n; ++i) {
    const int64_t full_off = (i * d.heads + rank * hl) * head, shard_off = i * blk;
    if (kToShard)
      std::copy_n(src + full_off, blk, dst + shard_off);
    else
      std::copy_n(src + shard_off, blk, dst + full_off);
  }
}

template <bool kToShard>
void move_conv(const StateDims& d, int rank, int size, const float* src, float* dst) {
  const int64_t P = d.heads * d.k, pl = P / size;
  for (int64_t row = 0; row < d.n * d.conv_rows; ++row)
    for (int64_t part = 0; part < 3; ++part) {
      const int64_t full_off = row * 3 * P + part * P + rank * pl, shard_off = row * 3 * pl + part * pl;
      if (kToShard)
        std::copy_n(src + full_off, pl, dst + shard_off);
      else
        std::copy_n(src + shard_off, pl, dst + full_off);
    }
}

}  // namespace

std::vector<float> shard_recurrent(const std::vector<float>& full, const StateDims& d, int rank, int size) {
  std::vector<float> out(full.size() / size);
  move_recurrent<true>(d, rank, size, full.data(), out.data());
  return out;
}

std::vector<float> shard_conv(const std::vector<float>& full, const StateDims& d, int rank, int size) {
  std::vector<float> out(full.size() / size);
  move_conv<true>(d, rank, size, full.data(), out.data());
  return out;
}

std::vector<float> unshard_recurrent(const std::vector<float>& parts, const StateDims& d, int size) {
  std::vector<float> full(parts.size());
  const size_t per = parts.size() / size;
  for (int r = 0; r < size; ++r) move_recurrent<false>(d, r, size, parts.data() + r * per, full.data());
  return full;
}

std::vector<float> unshard_conv(const std::vector<float>& parts, const StateDims& d, int size) {
  std::vector<float> full(parts.size());
  const size_t per = parts.size() / size;
  for (int r = 0; r < size; ++r) move_conv<false>(d, r, size, parts.data() + r * per, full.data());
  return full;
}

}  // namespace kda::distributed
