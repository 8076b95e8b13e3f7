#include "kda/kernels/gemm/bf16_amx_block.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kda/kernels/gemm/amx_tiles.h"
#include "kda/kernels/gemm/bf16_amx.h"
#include "kda/kernels/gemm/bf16_vnni.h"

namespace kda::kernels::gemm {

namespace {

void check_args(const char* what, const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K,
                int64_t N, const void* y, int64_t ldy) {
  if (K % 32 != 0)
    throw std::invalid_argument(std::string(what) + ": the input size " + std::to_string(K) +
                                " is not a multiple of 32");
  amx::check_bf16_gemm_args(what, x, M, ldx, w, K, N, static_cast<const float*>(y), ldy);
}

// W[n][k] in gemm_bf16_vnni's layout (bf16_vnni.h).
inline bf16_t at(const bf16_t* w, int64_t K, int64_t n, int64_t k) {
  return w[n / kVnniBlockN * kVnniBlockN * K + k / 2 * 2 * kVnniBlockN + n % kVnniBlockN * 2 + k % 2];
}

}  // namespace

bool bf16_amx_block_takes(int64_t K) { return K > 0 && K % 32 == 0 && cpu_has_amx_bf16(); }

void gemm_bf16_amx_block_reference(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K,
                                   int64_t N, float* y, int64_t ldy) {
  check_args("gemm_bf16_amx_block_reference", x, M, ldx, w, K, N, y, ldy);
  std::vector<float> wn(static_cast<size_t>(K));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) wn[k] = bf16_to_f32(at(w, K, n, k));
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += bf16_to_f32(x[m * ldx + k]) * wn[k];
      y[m * ldy + n] = s;
    }
  }
}

#if defined(KDA_AMX_BUILD)

namespace {

constexpr int64_t kT = 16;     // a tile's rows of x (A, C) and channels (B, C)
constexpr int64_t kStep = 32;  // inputs per step: an A tile row's 64 bytes, a B tile's 16 pair rows

using amx::TileConfig;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,amx-tile,amx-bf16")

// Tiles: 0, 1 the sums of the first 16 rows by the two channel tiles, 2, 3 those of the next 16 rows; 4,
// 5 the two row tiles of x; 6, 7 the two channel tiles of W. A tile of no rows or channels (past M or N)
// stays unconfigured and unused.
class Tiles {
 public:
  Tiles() = default;
  ~Tiles() {
    if (configured_) _tile_release();
  }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  // ra, rb: rows of the two row tiles (rb may be 0); ca, cb: channels of the two channel tiles (cb may
  // be 0). Configured only when it changes (the blocks at the edges of M and N).
  void shape(int64_t ra, int64_t rb, int64_t ca, int64_t cb) {
    const int64_t key = ((ra * 32 + rb) * 32 + ca) * 32 + cb;
    if (configured_ && key == key_) return;
    TileConfig c;
    const int64_t rows[2] = {ra, rb}, cols[2] = {ca, cb};
    for (int r = 0; r < 2; ++r) {
      if (rows[r] == 0) continue;
      c.rows[4 + r] = static_cast<uint8_t>(rows[r]);
      c.colsb[4 + r] = 2 * kStep;
      for (int j = 0; j < 2; ++j) {
        if (cols[j] == 0) continue;
        c.rows[2 * r + j] = static_cast<uint8_t>(rows[r]);
        c.colsb[2 * r + j] = static_cast<uint16_t>(4 * cols[j]);
      }
    }
    for (int j = 0; j < 2; ++j) {
      if (cols[j] == 0) continue;
      c.rows[6 + j] = kStep / 2;
      c.colsb[6 + j] = static_cast<uint16_t>(4 * cols[j]);
    }
    asm volatile("ldtilecfg %0" ::"m"(c));
    configured_ = true;
    key_ = key;
  }

 private:
  bool configured_ = false;
  int64_t key_ = 0;
};

void run(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N, float* y,
         int64_t ldy) {
  KDA_TILE_FENCE();  // the caller's stores to x before the tile loads read it
  Tiles tiles;
  constexpr int64_t kPairRow = 2 * kVnniBlockN;  // values in a block's row of input pairs
  for (int64_t m0 = 0; m0 < M; m0 += 2 * kT) {
    const int64_t ra = std::min(kT, M - m0), rb = std::clamp<int64_t>(M - m0 - kT, 0, kT);
    const bf16_t* xa = x + m0 * ldx;
    const bf16_t* xb = xa + kT * ldx;
    for (int64_t n0 = 0; n0 < N; n0 += 2 * kT) {
      const int64_t ca = std::min(kT, N - n0), cb = std::clamp<int64_t>(N - n0 - kT, 0, kT);
      tiles.shape(ra, rb, ca, cb);
      // Channel tiles of 32 channels never straddle a block of 64.
      const bf16_t* wb = w + n0 / kVnniBlockN * kVnniBlockN * K + n0 % kVnniBlockN * 2;
      _tile_zero(0);
      if (cb) _tile_zero(1);
      if (rb) _tile_zero(2);
      if (rb && cb) _tile_zero(3);
      for (int64_t k = 0; k < K; k += kStep) {
        const bf16_t* wk = wb + k / 2 * kPairRow;
        _tile_loadd(4, xa + k, 2 * ldx);
        _tile_loadd(6, wk, 2 * kPairRow);
        _tile_dpbf16ps(0, 4, 6);
        if (cb) {
          _tile_loadd(7, wk + 2 * kT, 2 * kPairRow);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (rb) {
          _tile_loadd(5, xb + k, 2 * ldx);
          _tile_dpbf16ps(2, 5, 6);
          if (cb) _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* ya = y + m0 * ldy + n0;
      _tile_stored(0, ya, 4 * ldy);
      if (cb) _tile_stored(1, ya + kT, 4 * ldy);
      if (rb) _tile_stored(2, ya + kT * ldy, 4 * ldy);
      if (rb && cb) _tile_stored(3, ya + kT * ldy + kT, 4 * ldy);
    }
  }
  KDA_TILE_FENCE();  // y's stores before the caller reads them
}

// The tiles of a group of R <= 16 rows: 0 the rows' 32 inputs, 1 to 3 (and 1 again) a block's four
// 16-channel B tiles, 4 to 7 their sums.
inline void configure_rows(int64_t R) {
  TileConfig c;
  c.rows[0] = static_cast<uint8_t>(R);
  c.colsb[0] = 2 * kStep;
  for (int t : {1, 2, 3}) {
    c.rows[t] = kStep / 2;
    c.colsb[t] = 4 * kT;
  }
  for (int t : {4, 5, 6, 7}) {
    c.rows[t] = static_cast<uint8_t>(R);
    c.colsb[t] = 4 * kT;
  }
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// Rows [0, M) of x against W's 64-channel blocks [b0, b1), block by block, and in each block its groups
// of up to 16 rows in turn: the first group reads the block from memory, the others find it in L2 (a
// block is 128 bytes per input), so that W is read from memory once per call. (Chunks of a block's
// inputs run group by group, each group's C tiles stored and reloaded between chunks so that the later
// groups read the chunk from L1, were slower at 32 and 64 rows: docs/performance.md.) A block past N's
// last whole one goes through `o` (its padding channels are summed, not stored); a bf16 y through `o`
// always.
template <class Y>
void rows_blocks(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N, Y* y,
                 int64_t ldy, int64_t b0, int64_t b1) {
  constexpr bool kF32 = std::is_same_v<Y, float>;
  constexpr int64_t kBlockStep = kStep * kVnniBlockN;  // a block's values per step of 32 inputs (4 KB)
  static_assert(kBlockStep * 2 == 4 * 16 * 64, "a step is four quarters of 16 cache lines");
  alignas(64) float o[kT * kVnniBlockN];
  int64_t configured = 0;  // the rows of the tile shape loaded
  KDA_TILE_FENCE();        // the caller's stores to x before the tile loads read it
  for (int64_t nb = b0; nb < b1; ++nb) {
    const bf16_t* wb = w + nb * kVnniBlockN * K;
    const int64_t n0 = nb * kVnniBlockN, nc = std::min(kVnniBlockN, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += kT) {
      const int64_t R = std::min(kT, M - m0);
      if (R != configured) configure_rows(configured = R);
      const bf16_t* xr = x + m0 * ldx;
      Y* yr = y + m0 * ldy;
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t k = 0; k < K; k += kStep) {
        const bf16_t* bt = wb + k / kStep * kBlockStep;
        // The next step's lines (the same block's, or the next block's first: one run of bytes), a
        // quarter before each B tile's load. All of them at the top of the step, two steps ahead, held
        // one row's read further below the bandwidth (docs/performance.md, "bf16 decode: the
        // prefetches spread over the step").
        const char* ahead = reinterpret_cast<const char*>(bt + kBlockStep);
        auto fetch = [ahead](int q) {
          for (int64_t j = 16 * q; j < 16 * q + 16; ++j) _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
        };
        _tile_loadd(0, xr + k, 2 * ldx);
        fetch(0);
        _tile_loadd(1, bt, 4 * kVnniBlockN);
        _tile_dpbf16ps(4, 0, 1);
        fetch(1);
        _tile_loadd(2, bt + 2 * kT, 4 * kVnniBlockN);
        _tile_dpbf16ps(5, 0, 2);
        fetch(2);
        _tile_loadd(3, bt + 4 * kT, 4 * kVnniBlockN);
        _tile_dpbf16ps(6, 0, 3);
        fetch(3);
        _tile_loadd(1, bt + 6 * kT, 4 * kVnniBlockN);
        _tile_dpbf16ps(7, 0, 1);
      }
      if constexpr (kF32) {
        if (nc == kVnniBlockN) {
          _tile_stored(4, yr + n0, 4 * ldy);
          _tile_stored(5, yr + n0 + kT, 4 * ldy);
          _tile_stored(6, yr + n0 + 2 * kT, 4 * ldy);
          _tile_stored(7, yr + n0 + 3 * kT, 4 * ldy);
          continue;
        }
      }
      _tile_stored(4, o, 4 * kVnniBlockN);
      _tile_stored(5, o + kT, 4 * kVnniBlockN);
      _tile_stored(6, o + 2 * kT, 4 * kVnniBlockN);
      _tile_stored(7, o + 3 * kT, 4 * kVnniBlockN);
      KDA_TILE_FENCE();
      for (int64_t m = 0; m < R; ++m) {
        if constexpr (kF32)
          std::copy(o + m * kVnniBlockN, o + m * kVnniBlockN + nc, yr + m * ldy + n0);
        else
          f32_to_bf16_array(o + m * kVnniBlockN, yr + m * ldy + n0, static_cast<size_t>(nc));
      }
      KDA_TILE_FENCE();  // the next group's stores to o after these reads
    }
  }
  KDA_TILE_FENCE();  // y's stores before the caller reads them
  if (configured > 0) _tile_release();
}

#pragma GCC pop_options

}  // namespace

void gemm_bf16_amx_block(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
                         float* y, int64_t ldy) {
  if (!cpu_has_amx_bf16()) throw std::logic_error("gemm_bf16_amx_block: no AMX-BF16 on this CPU");
  check_args("gemm_bf16_amx_block", x, M, ldx, w, K, N, y, ldy);
  run(x, M, ldx, w, K, N, y, ldy);
}

namespace {

// Below this many weights a call runs on one thread (the fork costs more than the work).
constexpr int64_t kRowsParallelMin = int64_t{1} << 15;

template <class Y>
void rows(const char* what, const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
          Y* y, int64_t ldy) {
  if (!cpu_has_amx_bf16()) throw std::logic_error(std::string(what) + ": no AMX-BF16 on this CPU");
  check_args(what, x, M, ldx, w, K, N, y, ldy);
  const int64_t nblocks = (N + kVnniBlockN - 1) / kVnniBlockN;
  for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
    const int64_t R = std::min(kAmxRows, M - m0);
    const bf16_t* xr = x + m0 * ldx;
    Y* yr = y + m0 * ldy;
    if (K * N < kRowsParallelMin || nblocks < 2) {
      rows_blocks(xr, R, ldx, w, K, N, yr, ldy, 0, nblocks);
      continue;
    }
#pragma omp parallel
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      rows_blocks(xr, R, ldx, w, K, N, yr, ldy, nblocks * t / nt, nblocks * (t + 1) / nt);
    }
  }
}

}  // namespace

void gemm_bf16_amx_rows(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
                        float* y, int64_t ldy) {
  rows("gemm_bf16_amx_rows", x, M, ldx, w, K, N, y, ldy);
}
void gemm_bf16_amx_rows(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
                        bf16_t* y, int64_t ldy) {
  rows("gemm_bf16_amx_rows", x, M, ldx, w, K, N, y, ldy);
}

#else  // no AMX in this build

void gemm_bf16_amx_block(const bf16_t*, int64_t, int64_t, const bf16_t*, int64_t, int64_t, float*, int64_t) {
  throw std::logic_error("gemm_bf16_amx_block: not in this build");
}
void gemm_bf16_amx_rows(const bf16_t*, int64_t, int64_t, const bf16_t*, int64_t, int64_t, float*, int64_t) {
  throw std::logic_error("gemm_bf16_amx_rows: not in this build");
}
void gemm_bf16_amx_rows(const bf16_t*, int64_t, int64_t, const bf16_t*, int64_t, int64_t, bf16_t*, int64_t) {
  throw std::logic_error("gemm_bf16_amx_rows: not in this build");
}

#endif

}  // namespace kda::kernels::gemm
