// Step 1 of chunk_kda_opt, staged: the next (chunk, head) unit's rows prepared a row at a time between
// the micro-tiles of the current chunk, each row's cache lines prefetched during the tiles before.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kda/common/bf16.h"
#include "kda/common/isa_target.h"
#include "kda/kernels/kda/avx512.h"
#include "kda/kernels/kda/chunk/common.h"
#include "kda/kernels/kda/prepare.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

// dst[0:n] = src[0:n], 16 floats (one vector move) at a time.
inline void copy_row(float* __restrict dst, const float* __restrict src, int n) {
  int j = 0;
  for (; j + 16 <= n; j += 16) std::memcpy(dst + j, src + j, 16 * sizeof(float));
  if (j < n) std::memcpy(dst + j, src + j, (n - j) * sizeof(float));
}

// dst[0:n] = src[0:n] as fp32.
inline void widen_row(float* __restrict dst, const float* __restrict src, int n) { copy_row(dst, src, n); }
inline void widen_row(float* __restrict dst, const bf16_t* __restrict src, int n) {
  int j = 0;
#if defined(KDA_ISA_AVX512)
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(dst + j, prep::load16(src + j));
#endif
  for (; j < n; ++j) dst[j] = bf16_to_f32(src[j]);
}

// Steps of a micro-tile's inner loop per line it prefetches. One token row of one head is 32 lines of
// fp32 inputs, staged over ~96 steps of 24 FMAs each; at C = 64, K = V = 128 the full micro-tiles of a
// chunk's steps 5-7 have ~7900 steps, more than the 64 rows need.
constexpr int kPfEvery = 3;

// Cache lines for a micro-tile to prefetch, one every kPfEvery steps of its inner loop (see kloop).
struct PfLines {
  const char* const* p = nullptr;
  int n = 0;
};

// Step 1 of the next (chunk, head) unit, done a row at a time between the micro-tiles of the current
// chunk: each row of q, k, g of that unit becomes its Q, Kh, G, E row, v is copied to a contiguous
// block and beta to B, prefetching a few rows ahead. Token rows are H*K floats apart (more when q/k/v
// are column slices of a wider output): the hardware prefetchers do not follow them, and rows a
// multiple of 4 KB apart share L1 sets, so fetching a whole chunk ahead would evict itself; rows taken
// as they arrive land in L2-resident arrays instead, and the next chunk starts from them directly.
class Stager {
 public:
  // Rows (of all four inputs) prefetched ahead of the one prepared. A row's lines are prefetched one at
  // a time over the micro-tiles' loops (see kloop) rather than all at once, so that few misses are in
  // flight at any time (measured faster than a burst of the whole row).
  static constexpr int kAhead = 2;
  static constexpr int kMaxLines = 64;

  struct Unit {
    prep::HeadPrep prep;
    bool bf16;                  // q, k, v are bf16 (else fp32)
    bool g_bf16;                // g is bf16 (else fp32)
    const void *q, *k, *v, *g;  // the unit's first row
    const float* beta;
    int64_t lq, lk, lg, lv, lbeta;  // row strides, in elements
    int rows, V;
    float *Q, *Kh, *G, *E, *Vs, *B;  // destinations (row strides K, V, 1)
  };

  void start(const Unit& u) {
    u_ = u;
    done_ = 0;
    for (pr_ = 0; pr_ < std::min(kAhead - 1, u_.rows); ++pr_) {
      build(pr_);
      flush();
    }
    build(pr_);
  }
  // The lines the next micro-tile prefetches (it advances the list as it goes).
  PfLines& lines() { return cur_; }

  // After a micro-tile: prepares a row once the tiles have prefetched every line of the row after it.
  // Rows are thus prepared at the pace of the tiles' work (a short tile of a triangular product
  // prefetches few lines), never sooner than one row's worth of tile work after their own lines were
  // requested: enough for a miss to memory even on a loaded machine (preparing a row after a fixed
  // count of tiles read it too soon after short ones, and step 1 stalled on its loads).
  void tile_done() {
    while (cur_.n == 0 && done_ < u_.rows) step();
  }
  // Prepares every row left.
  void finish() {
    while (done_ < u_.rows) step();
  }

 private:
  void step() {
    flush();
    build(++pr_);
    if (u_.bf16) {
      u_.g_bf16 ? prepare<bf16_t, bf16_t>(done_) : prepare<bf16_t, float>(done_);
    } else {
      u_.g_bf16 ? prepare<float, bf16_t>(done_) : prepare<float, float>(done_);
    }
    ++done_;
  }

  // Row r of the unit; In is the type of q, k, v, GIn that of g.
  template <class In, class GIn>
  void prepare(int64_t r) {
    const int K = u_.prep.K;
    const auto* q = static_cast<const In*>(u_.q) + r * u_.lq;
    const auto* k = static_cast<const In*>(u_.k) + r * u_.lk;
    const auto* g = static_cast<const GIn*>(u_.g) + r * u_.lg;
    prep::prepare_row(u_.prep, q, k, g, u_.Q + r * K, u_.Kh + r * K, u_.G + r * K, u_.E + r * K);
    widen_row(u_.Vs + r * u_.V, static_cast<const In*>(u_.v) + r * u_.lv, u_.V);
    u_.B[r] = u_.beta[r * u_.lbeta];
  }

  // The list for row r (empty past the last row); lines beyond kMaxLines are prefetched at once.
  void build(int64_t r) {
    int n = 0;
    if (r < u_.rows) {
      const int K = u_.prep.K;
      const int64_t e = u_.bf16 ? 2 : 4, eg = u_.g_bf16 ? 2 : 4;  // bytes per q, k, v element; per g element
      const char* rows[4] = {
          static_cast<const char*>(u_.q) + r * u_.lq * e, static_cast<const char*>(u_.k) + r * u_.lk * e,
          static_cast<const char*>(u_.g) + r * u_.lg * eg, static_cast<const char*>(u_.v) + r * u_.lv * e};
      const int64_t bytes[4] = {K * e, K * e, K * eg, u_.V * e};
      for (int i = 0; i < 4; ++i) {
        const char* p = rows[i];
        const char* end = rows[i] + bytes[i];
        for (; p < end; p += 64) {
          if (n < kMaxLines) {
            lines_[n++] = p;
          } else {
            __builtin_prefetch(p, 0, 3);
          }
        }
      }
    }
    cur_ = {lines_, n};
  }
  // Prefetches what the tiles left of the current list.
  void flush() {
    for (; cur_.n > 0; --cur_.n, ++cur_.p) __builtin_prefetch(*cur_.p, 0, 3);
  }

  Unit u_{};
  int done_ = 0;
  int64_t pr_ = 0;  // the row cur_ prefetches
  const char* lines_[kMaxLines] = {};
  PfLines cur_;
};

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
