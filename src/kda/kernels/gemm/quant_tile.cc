#include "kda/kernels/gemm/quant_tile.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kda/common/isa_target.h"
#include "kda/kernels/gemm/quant_gemm.h"

namespace kda::kernels::gemm {
namespace {

inline uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }

// w as hi + lo: hi w rounded to nearest even bf16 (truncated instead where rounding would overflow to
// Inf), lo the remainder (exact in fp32, |lo| <= 2^-8 |w|) rounded to nearest even: 16 significant
// bits, |w - (hi + lo)| <= 2^-16 |w|. A NaN w gives a NaN remainder, so hi + lo is NaN.
inline void split(float w, bf16_t& hi, bf16_t& lo) {
  const uint32_t u = bits(w);
  uint32_t h = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  if ((h & 0x7f800000u) == 0x7f800000u && (u & 0x7f800000u) != 0x7f800000u) h = u & 0xffff0000u;
  hi = static_cast<bf16_t>(h >> 16);
  lo = static_cast<bf16_t>(bits(round_bf16(w - std::bit_cast<float>(h))) >> 16);
}

void check(const PackedWeights& w, int64_t n0, int64_t n1, int64_t ld) {
  if (w.format != Weights::Int8 && w.format != Weights::Int4)
    throw std::invalid_argument("bf16_tile_rows: the weights must be int8 or int4");
  if (n0 < 0 || n1 < n0 || n1 > w.out) throw std::invalid_argument("bf16_tile_rows: bad row range");
  if (ld < bf16_tile_depth(w))
    throw std::invalid_argument("bf16_tile_rows: ld " + std::to_string(ld) + " below the tile depth " +
                                std::to_string(bf16_tile_depth(w)));
}

KDA_TARGET_CLONES void int8_row(const int8_t* q, int64_t in, bf16_t* out) {
  for (int64_t k = 0; k < in; ++k) out[k] = static_cast<bf16_t>(bits(static_cast<float>(q[k])) >> 16);
}

// One channel's groups: group g's 16 bytes hold inputs 32g + j (low nibble) and 32g + 16 + j (high).
KDA_TARGET_CLONES void int4_row(const uint8_t* q, const float* scale, int64_t in, bf16_t* out) {
  bf16_t* lo_out = out + in;
  for (int64_t g = 0; g < in / kInt4Group; ++g) {
    const uint8_t* b = q + g * 16;
    const float s = scale[g];
    const int64_t k0 = g * kInt4Group;
    for (int j = 0; j < 16; ++j) {
      const float wl = static_cast<float>((b[j] & 0xF) - 8) * s, wh = static_cast<float>((b[j] >> 4) - 8) * s;
      split(wl, out[k0 + j], lo_out[k0 + j]);
      split(wh, out[k0 + 16 + j], lo_out[k0 + 16 + j]);
    }
  }
}

}  // namespace

int64_t bf16_tile_depth(const PackedWeights& w) { return w.format == Weights::Int4 ? 2 * w.in : w.in; }

void bf16_tile_rows(const PackedWeights& w, int64_t n0, int64_t n1, bf16_t* out, int64_t ld) {
  check(w, n0, n1, ld);
#pragma omp parallel for schedule(static) if ((n1 - n0) * w.in >= (int64_t{1} << 15))
  for (int64_t n = n0; n < n1; ++n) {
    bf16_t* o = out + (n - n0) * ld;
    if (w.format == Weights::Int8) {
      int8_row(static_cast<const int8_t*>(w.data) + n * w.in, w.in, o);
    } else {
      int4_row(static_cast<const uint8_t*>(w.data) + n * (w.in / 2), w.scale + n * (w.in / kInt4Group), w.in,
               o);
    }
  }
}

// Scalar, by the general conversions: int8 converts q with f32_to_bf16 (exact for |q| <= 127); int4
// splits the format table's fp32 dequantization of W.
void bf16_tile_rows_reference(const PackedWeights& w, int64_t n0, int64_t n1, bf16_t* out, int64_t ld) {
  check(w, n0, n1, ld);
  std::vector<float> row(static_cast<size_t>(w.in));
  for (int64_t n = n0; n < n1; ++n) {
    bf16_t* o = out + (n - n0) * ld;
    if (w.format == Weights::Int8) {
      const int8_t* q = static_cast<const int8_t*>(w.data) + n * w.in;
      for (int64_t k = 0; k < w.in; ++k) o[k] = f32_to_bf16(static_cast<float>(q[k]));
      continue;
    }
    dequantize_rows(w, n, n + 1, row.data());
    for (int64_t k = 0; k < w.in; ++k) split(row[k], o[k], o[w.in + k]);
  }
}

namespace {

constexpr int64_t kBlockK = 16, kBlockN = 64;
int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// One group of up to 64 channels' rows (rows [nc, depth], plain) into its blocks.
KDA_TARGET_CLONES void block_group(const bf16_t* rows, int64_t nc, int64_t depth, int64_t kp, bf16_t* out) {
  for (int64_t kb = 0; kb < kp / kBlockK; ++kb) {
    bf16_t* blk = out + kb * kBlockK * kBlockN;
    for (int64_t k2 = 0; k2 < kBlockK / 2; ++k2) {
      const int64_t k = kb * kBlockK + 2 * k2;
      bf16_t* o = blk + k2 * 2 * kBlockN;
      for (int64_t n = 0; n < kBlockN; ++n) {
        const bool live = n < nc;
        o[2 * n] = live && k < depth ? rows[n * depth + k] : bf16_t{0};
        o[2 * n + 1] = live && k + 1 < depth ? rows[n * depth + k + 1] : bf16_t{0};
      }
    }
  }
}

}  // namespace

int64_t bf16_blocked_tile_size(const PackedWeights& w, int64_t channels) {
  return round_up(bf16_tile_depth(w), kBlockK) * round_up(channels, kBlockN);
}

void bf16_tile_blocked(const PackedWeights& w, int64_t n0, int64_t n1, bf16_t* out) {
  const int64_t depth = bf16_tile_depth(w), kp = round_up(depth, kBlockK);
  check(w, n0, n1, depth);
  const int64_t groups = (n1 - n0 + kBlockN - 1) / kBlockN;
  // Each thread's plain rows of one group, allocated here: nothing in the region may throw.
  const int threads = omp_get_max_threads();
  std::vector<bf16_t> rows(static_cast<size_t>(threads * kBlockN * depth));
#pragma omp parallel for schedule(static) if ((n1 - n0) * depth >= (int64_t{1} << 15))
  for (int64_t g = 0; g < groups; ++g) {
    bf16_t* r = rows.data() + omp_get_thread_num() * kBlockN * depth;
    const int64_t c0 = n0 + g * kBlockN, c1 = std::min(n1, c0 + kBlockN);
    for (int64_t n = c0; n < c1; ++n) {
      bf16_t* o = r + (n - c0) * depth;
      if (w.format == Weights::Int8)
        int8_row(static_cast<const int8_t*>(w.data) + n * w.in, w.in, o);
      else
        int4_row(static_cast<const uint8_t*>(w.data) + n * (w.in / 2), w.scale + n * (w.in / kInt4Group),
                 w.in, o);
    }
    block_group(r, c1 - c0, depth, kp, out + g * kp * kBlockN);
  }
}

namespace {

template <class Y>
inline void scale_rows(const float* src, int64_t lds, int64_t M, const float* scale, int64_t n, Y* y,
                       int64_t ldy) {
  const auto store = [](float v) {
    if constexpr (std::is_same_v<Y, bf16_t>)
      return f32_to_bf16(v);
    else
      return v;
  };
  for (int64_t m = 0; m < M; ++m) {
    const float* s = src + m * lds;
    Y* r = y + m * ldy;
    if (scale) {
      for (int64_t c = 0; c < n; ++c) r[c] = store(s[c] * scale[c]);
    } else {
      for (int64_t c = 0; c < n; ++c) r[c] = store(s[c]);
    }
  }
}

}  // namespace

KDA_TARGET_CLONES void scale_columns(const float* src, int64_t lds, int64_t M, const float* scale, int64_t n,
                                     float* y, int64_t ldy) {
  scale_rows(src, lds, M, scale, n, y, ldy);
}
KDA_TARGET_CLONES void scale_columns(const float* src, int64_t lds, int64_t M, const float* scale, int64_t n,
                                     bf16_t* y, int64_t ldy) {
  scale_rows(src, lds, M, scale, n, y, ldy);
}

}  // namespace kda::kernels::gemm
