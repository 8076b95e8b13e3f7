#include "kda/kernels/gemm/bf16_amx.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kda/kernels/gemm/amx_tiles.h"

namespace kda::kernels::gemm {

namespace amx {

void check_bf16_gemm_args(const char* what, const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w,
                          int64_t K, int64_t N, const float* y, int64_t ldy) {
  const std::string f(what);
  if (K < 1 || N < 1 || M < 0)
    throw std::invalid_argument(f + ": bad sizes M " + std::to_string(M) + ", K " + std::to_string(K) +
                                ", N " + std::to_string(N));
  if (ldx < K || ldy < N) throw std::invalid_argument(f + ": a row stride below its row's size");
  if (M > 0 && (x == nullptr || w == nullptr || y == nullptr)) throw std::invalid_argument(f + ": null data");
}

}  // namespace amx

namespace {
using amx::check_bf16_gemm_args;
}  // namespace

void gemm_bf16_amx_reference(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
                             float* y, int64_t ldy) {
  check_bf16_gemm_args("gemm_bf16_amx_reference", x, M, ldx, w, K, N, y, ldy);
  // x transposed to [K, M]: the rows' sums then advance side by side, each still k ascending.
  std::vector<float> xt(static_cast<size_t>(K * M)), wf(static_cast<size_t>(K)), acc(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[k * M + m] = bf16_to_f32(x[m * ldx + k]);
  for (int64_t n = 0; n < N; ++n) {
    bf16_to_f32_array(w + n * K, wf.data(), static_cast<size_t>(K));
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float wk = wf[k];
      const float* xk = xt.data() + k * M;
      for (int64_t m = 0; m < M; ++m) acc[m] += xk[m] * wk;
    }
    for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = acc[m];
  }
}

#if defined(KDA_AMX_BUILD)

// cpu_has_amx_bf16 is defined in quant_amx.cc, beside cpu_has_amx_int8 (one grant of the tile data).

namespace {

// Below this many weights a call runs on one thread (the fork costs more than the work).
constexpr int64_t kParallelMin = int64_t{1} << 15;
constexpr int64_t kC = 16;      // channels per block: rows of the A and C tiles
constexpr int64_t kCols = 16;   // rows of x per group: columns of the B and C tiles
constexpr int64_t kGroups = 4;  // groups per pass over W: the C tiles beside one A and three B tiles
constexpr int64_t kStep = 32;   // inputs per A tile row (64 bytes)

using amx::TileConfig;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,amx-tile,amx-bf16")

// Tiles: 0 the weights (`channels` channels by 32 inputs), 1 to 3 a group's x (16 input pairs by `cols`
// rows' words), 4 to 7 the groups' sums (`channels` by `cols`). With one group, 2 and 3 hold weights too
// (four_blocks). Columns and rows past them are never read.
inline void configure(int64_t channels, int64_t cols, int64_t groups) {
  TileConfig c;
  for (int t : {0, 2, 3}) {
    c.rows[t] = static_cast<uint8_t>(channels);
    c.colsb[t] = 2 * kStep;
  }
  for (int t : {1, 2, 3}) {
    if (t > 1 && groups == 1) continue;
    c.rows[t] = kStep / 2;
    c.colsb[t] = static_cast<uint16_t>(4 * cols);
  }
  for (int t : {4, 5, 6, 7}) {
    c.rows[t] = static_cast<uint8_t>(channels);
    c.colsb[t] = static_cast<uint16_t>(4 * cols);
  }
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// The tile shape, configured only when it changes (the last block of fewer channels).
class Tiles {
 public:
  Tiles() = default;
  ~Tiles() {
    if (channels_ > 0) _tile_release();
  }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  void shape(int64_t channels, int64_t cols, int64_t groups) {
    if (channels != channels_ || cols != cols_ || groups != groups_)
      configure(channels_ = channels, cols_ = cols, groups_ = groups);
  }

 private:
  int64_t channels_ = 0, cols_ = 0, groups_ = 0;
};

// o [channels][kCols] (a stored C tile) into y's rows [m0, m0 + mr) and columns [n0, n0 + nc).
inline void write_out(const float* o, int64_t m0, int64_t mr, int64_t n0, int64_t nc, float* y, int64_t ldy) {
  for (int64_t m = 0; m < mr; ++m) {
    float* yr = y + (m0 + m) * ldy + n0;
    for (int64_t n = 0; n < nc; ++n) yr[n] = o[n * kCols + m];
  }
}

// Full channel blocks of the tiled layout from nb0, four a pass, against one group of `rows` rows of x
// (`cols` columns): each step's x tile serves four weight tiles (0, 2, 3, then 0 again), four C tiles (4
// to 7) summing side by side. Every sum is the one-block pass's, in the same order. With one block a
// pass, 2 to 16 rows read the LM head slower than one row (one run per thread, each step's product
// waiting on the last): docs/performance.md, "The LM head's rows four blocks a pass". Returns the first
// block left (fewer than four, or a last block of fewer channels).
int64_t four_blocks(const uint32_t* xb, int64_t rows, int64_t cols, const bf16_t* w, int64_t K, int64_t N,
                    int64_t nb0, int64_t nb1, float* y, int64_t ldy, Tiles& tiles) {
  constexpr int64_t kBlocks = 4, kAhead = 2;  // steps prefetched ahead into L1, as one block a pass
  alignas(64) float o[kC * kCols];
  tiles.shape(kC, cols, 1);
  const int64_t bs = kC * K;  // values per block
  int64_t nb = nb0;
  for (; nb + kBlocks <= nb1 && (nb + kBlocks) * kC <= N; nb += kBlocks) {
    const bf16_t* a = w + nb * bs;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t k = 0; k < K; k += kStep) {
      if (k + kAhead * kStep < K)
        for (int64_t b = 0; b < kBlocks; ++b)
          for (int64_t j = 0; j < kC; ++j)
            _mm_prefetch(reinterpret_cast<const char*>(a + b * bs + (k + kAhead * kStep) * kC + j * kStep),
                         _MM_HINT_T0);
      _tile_loadd(1, xb + k / 2 * kCols, 4 * kCols);
      _tile_loadd(0, a + k * kC, 2 * kStep);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(2, a + bs + k * kC, 2 * kStep);
      _tile_dpbf16ps(5, 2, 1);
      _tile_loadd(3, a + 2 * bs + k * kC, 2 * kStep);
      _tile_dpbf16ps(6, 3, 1);
      _tile_loadd(0, a + 3 * bs + k * kC, 2 * kStep);
      _tile_dpbf16ps(7, 0, 1);
    }
    const int64_t n0 = nb * kC;
    _tile_stored(4, o, 4 * kCols);
    KDA_TILE_FENCE();
    write_out(o, 0, rows, n0, kC, y, ldy);
    KDA_TILE_FENCE();
    _tile_stored(5, o, 4 * kCols);
    KDA_TILE_FENCE();
    write_out(o, 0, rows, n0 + kC, kC, y, ldy);
    KDA_TILE_FENCE();
    _tile_stored(6, o, 4 * kCols);
    KDA_TILE_FENCE();
    write_out(o, 0, rows, n0 + 2 * kC, kC, y, ldy);
    KDA_TILE_FENCE();
    _tile_stored(7, o, 4 * kCols);
    KDA_TILE_FENCE();
    write_out(o, 0, rows, n0 + 3 * kC, kC, y, ldy);
    KDA_TILE_FENCE();
  }
  return nb;
}

// Channel blocks [nb0, nb1) of W (kTiled: W in the tiled layout, else [N, K]) against the pass's `rows`
// rows of x, arranged in xb (arrange()) as `groups` groups of `cols` columns each.
template <bool kTiled>
void blocks(const uint32_t* xb, int64_t rows, int64_t groups, int64_t cols, const bf16_t* w, int64_t K,
            int64_t N, int64_t nb0, int64_t nb1, float* y, int64_t ldy) {
  Tiles tiles;
  alignas(64) float o[kC * kCols];
  // One row keeps one block a pass: four read it no faster (the doc section of four_blocks).
  if constexpr (kTiled)
    if (groups == 1 && rows > 1) nb0 = four_blocks(xb, rows, cols, w, K, N, nb0, nb1, y, ldy, tiles);
  const int64_t P = K / 2 * kCols;  // words per group
  // Steps prefetched ahead: 2; in the tiled layout with more than one group 32 (32 KB), where the block's
  // one run is read at the tile products' pace and 2 steps left it waiting on memory; at one group 32
  // steps were slower (docs/performance.md, "The LM head in tile order").
  const int64_t ahead = kTiled && groups > 1 ? 32 : 2;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const int64_t n0 = nb * kC, nc = std::min(kC, N - n0);
    const bf16_t* a = w + n0 * K;  // either layout: the block's values start at its first channel's row
    // This block's lines two steps ahead into L1; memory's reads are left to the hardware's prefetchers,
    // which follow the block's run (tiled) or its 16 channels' runs. Software prefetches of the next block
    // into L2, 16 lines a step, held the head's read below those prefetchers' rate (each takes an L1 miss
    // slot until its line is in: docs/performance.md, "The LM head in one copy").
    tiles.shape(nc, cols, groups);
    _tile_zero(4);
    if (groups > 1) _tile_zero(5);
    if (groups > 2) _tile_zero(6);
    if (groups > 3) _tile_zero(7);
    for (int64_t k = 0; k < K; k += kStep) {
      if (k + ahead * kStep < K)
        for (int64_t j = 0; j < nc; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(kTiled ? a + (k + ahead * kStep) * kC + j * kStep
                                                            : a + j * K + k + 2 * kStep),
                       _MM_HINT_T0);
      const uint32_t* b = xb + k / 2 * kCols;
      if constexpr (kTiled)
        _tile_loadd(0, a + k * kC, 2 * kStep);
      else
        _tile_loadd(0, a + k, 2 * K);
      _tile_loadd(1, b, 4 * kCols);
      _tile_dpbf16ps(4, 0, 1);
      if (groups > 1) {
        _tile_loadd(2, b + P, 4 * kCols);
        _tile_dpbf16ps(5, 0, 2);
      }
      if (groups > 2) {
        _tile_loadd(3, b + 2 * P, 4 * kCols);
        _tile_dpbf16ps(6, 0, 3);
      }
      if (groups > 3) {
        _tile_loadd(1, b + 3 * P, 4 * kCols);
        _tile_dpbf16ps(7, 0, 1);
      }
    }
    _tile_stored(4, o, 4 * kCols);
    KDA_TILE_FENCE();
    write_out(o, 0, std::min(kCols, rows), n0, nc, y, ldy);
    if (groups > 1) {
      _tile_stored(5, o, 4 * kCols);
      KDA_TILE_FENCE();
      write_out(o, kCols, std::min(kCols, rows - kCols), n0, nc, y, ldy);
    }
    if (groups > 2) {
      _tile_stored(6, o, 4 * kCols);
      KDA_TILE_FENCE();
      write_out(o, 2 * kCols, std::min(kCols, rows - 2 * kCols), n0, nc, y, ldy);
    }
    if (groups > 3) {
      _tile_stored(7, o, 4 * kCols);
      KDA_TILE_FENCE();
      write_out(o, 3 * kCols, rows - 3 * kCols, n0, nc, y, ldy);
    }
    KDA_TILE_FENCE();  // the next block's C stores overwrite what write_out read
  }
}

#pragma GCC pop_options

// x [rows, K] as B tiles: per group of 16 rows K / 2 x 16 words, word [p][c] holding inputs 2p and 2p + 1
// of the group's row c; the tile of inputs [k, k + 32) is the 16 words' rows from word k / 2 * 16. With
// more than one group every tile is 16 columns wide, so the last group's columns past `rows` are zeros;
// with one, the tiles are `rows` wide and the words past them are never read.
void arrange(const bf16_t* x, int64_t rows, int64_t ldx, int64_t K, int64_t groups, uint32_t* xb) {
  const int64_t P = K / 2 * kCols;
  for (int64_t m = 0; m < rows; ++m) {
    uint32_t* d = xb + (m / kCols) * P + m % kCols;
    const bf16_t* r = x + m * ldx;
    for (int64_t p = 0; p < K / 2; ++p)
      d[p * kCols] = static_cast<uint32_t>(r[2 * p]) | static_cast<uint32_t>(r[2 * p + 1]) << 16;
  }
  if (groups > 1)
    for (int64_t m = rows; m < groups * kCols; ++m) {
      uint32_t* d = xb + (m / kCols) * P + m % kCols;
      for (int64_t p = 0; p < K / 2; ++p) d[p * kCols] = 0;
    }
}

// Threads split the channel blocks evenly (static), each running `body` once on its range.
template <class Body>
void split_blocks(int64_t nblocks, int64_t weights, Body body) {
  if (weights < kParallelMin || nblocks < 2) {
    body(0, nblocks);
    return;
  }
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    body(nblocks * t / nt, nblocks * (t + 1) / nt);
  }
}

}  // namespace

namespace {

template <bool kTiled>
void run(const char* what, const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
         float* y, int64_t ldy) {
  if (!cpu_has_amx_bf16()) throw std::logic_error(std::string(what) + ": no AMX-BF16 on this CPU");
  check_bf16_gemm_args(what, x, M, ldx, w, K, N, y, ldy);
  if (!bf16_amx_takes(K))
    throw std::invalid_argument(std::string(what) + ": the input size " + std::to_string(K) +
                                " is not a multiple of 32");
  // The calling thread's scratch, grown once, before the region (a bad_alloc inside it would terminate).
  thread_local std::vector<uint32_t> xb;
  const int64_t nblocks = (N + kC - 1) / kC;
  for (int64_t m0 = 0; m0 < M; m0 += kGroups * kCols) {
    const int64_t rows = std::min(kGroups * kCols, M - m0), groups = (rows + kCols - 1) / kCols;
    const int64_t cols = groups == 1 ? rows : kCols;
    xb.resize(static_cast<size_t>(groups * K / 2 * kCols));
    arrange(x + m0 * ldx, rows, ldx, K, groups, xb.data());
    const uint32_t* xp = xb.data();
    float* yp = y + m0 * ldy;
    split_blocks(nblocks, K * N, [&](int64_t nb0, int64_t nb1) {
      blocks<kTiled>(xp, rows, groups, cols, w, K, N, nb0, nb1, yp, ldy);
    });
  }
}

}  // namespace

void gemm_bf16_amx(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N, float* y,
                   int64_t ldy) {
  run<false>("gemm_bf16_amx", x, M, ldx, w, K, N, y, ldy);
}

void gemm_bf16_amx_tiled(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
                         float* y, int64_t ldy) {
  run<true>("gemm_bf16_amx_tiled", x, M, ldx, w, K, N, y, ldy);
}

#else  // no AMX in this build

void gemm_bf16_amx(const bf16_t*, int64_t, int64_t, const bf16_t*, int64_t, int64_t, float*, int64_t) {
  throw std::logic_error("gemm_bf16_amx: not in this build");
}
void gemm_bf16_amx_tiled(const bf16_t*, int64_t, int64_t, const bf16_t*, int64_t, int64_t, float*, int64_t) {
  throw std::logic_error("gemm_bf16_amx_tiled: not in this build");
}

#endif

template <class T>
void tile_rows(const T* rows, int64_t n0, int64_t n1, int64_t K, bf16_t* tiled) {
  if (n0 < 0 || n1 < n0 || !bf16_amx_takes(K))
    throw std::invalid_argument("bf16_amx_tile_rows: rows [" + std::to_string(n0) + ", " +
                                std::to_string(n1) + ") of " + std::to_string(K) + " inputs");
  for (int64_t n = n0; n < n1; ++n) {
    const T* r = rows + (n - n0) * K;
    for (int64_t k = 0; k < K; k += 32) {
      bf16_t* d = tiled + bf16_amx_tiled_index(n, k, K);
      if constexpr (std::is_same_v<T, float>)
        f32_to_bf16_array(r + k, d, 32);
      else
        std::copy(r + k, r + k + 32, d);
    }
  }
}

void bf16_amx_tile_rows(const float* rows, int64_t n0, int64_t n1, int64_t K, bf16_t* tiled) {
  tile_rows(rows, n0, n1, K, tiled);
}
void bf16_amx_tile_rows(const bf16_t* rows, int64_t n0, int64_t n1, int64_t K, bf16_t* tiled) {
  tile_rows(rows, n0, n1, K, tiled);
}

}  // namespace kda::kernels::gemm
