// router_logits per ISA (router_gemm.h). AVX-512: MB rows x NB vectors of 16 experts in registers, per
// input one load of each vector of the block's weights, one broadcast of each row's input, MB * NB FMAs.
// Portable and AVX2: the same chains in a loop the compiler vectorises over the experts (std::fma: a fused
// multiply-add in every copy, so every copy gives the reference's bits).
#include "kda/kernels/gemm/router_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kda/common/isa_target.h"
#include "kda/kernels/gemm/router_gemm_isa.h"
#include "kda/kernels/kda/avx512.h"  // <immintrin.h>, its GCC 12 false warnings silenced

KDA_ISA_PUSH
namespace kda::kernels::gemm::KDA_ISA_NS {
namespace {

// Rows of x per task: a block's weights (at most 590 KB at the model's width) stay in L2 while the chunk's
// rows pass over them.
constexpr int64_t kChunkRows = 96;
// The block's weights are prefetched this many inputs ahead (4 KB at 64 experts a block): without it a
// pass of several rows read its block from memory slower than a pass of one row did (docs/performance.md,
// "The router on its own kernel").
constexpr int64_t kAheadRows = 16;
// Below this many multiply-adds a call runs on one thread (the fork costs more than the work).
constexpr int64_t kParallelMacs = int64_t{1} << 16;

#if defined(KDA_ISA_AVX512)

// Rows [0, MB) of x (row stride D) against the block's vectors [0, NB), the last one `tail` experts wide
// (kMasked: its loads and stores masked, where the block's width is not a multiple of 16): y's rows [0, MB)
// (row stride E) at the block's columns. The full vectors' loop has plain loads only: with a masked load in
// it GCC 12 kept a copy of every accumulator on the stack, a store per multiply-add.
template <int MB, int NB, bool kMasked>
inline void tile(const float* x, int64_t D, const float* wb, int64_t width, float* y, int64_t E, int tail) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const __mmask16 last = kMasked ? static_cast<__mmask16>((1u << tail) - 1) : static_cast<__mmask16>(0xFFFF);
  for (int64_t d = 0; d < D; ++d) {
    const float* wr = wb + d * width;
    if (d + kAheadRows < D) {
      const char* ahead = reinterpret_cast<const char*>(wr + kAheadRows * width);
      for (int j = 0; j < NB; ++j) _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
    }
    __m512 w[NB];
    for (int j = 0; j < NB; ++j)
      w[j] = kMasked && j == NB - 1 ? _mm512_maskz_loadu_ps(last, wr + 16 * j) : _mm512_loadu_ps(wr + 16 * j);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * D + d]);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      if (kMasked && j == NB - 1)
        _mm512_mask_storeu_ps(y + i * E + 16 * j, last, acc[i][j]);
      else
        _mm512_storeu_ps(y + i * E + 16 * j, acc[i][j]);
    }
}

template <int MB, int NB>
inline void tile_any(const float* x, int64_t D, const float* wb, int64_t width, float* y, int64_t E,
                     int tail) {
  if (tail == 16)
    tile<MB, NB, false>(x, D, wb, width, y, E, tail);
  else
    tile<MB, NB, true>(x, D, wb, width, y, E, tail);
}

// Rows [0, MB) of x against the whole block (at most kRouterBlock experts: 4 vectors).
template <int MB>
inline void tile_rows(const float* x, int64_t D, const float* wb, int64_t width, float* y, int64_t E) {
  const int nb = static_cast<int>((width + 15) / 16);
  const int tail = static_cast<int>(width - 16 * (nb - 1));
  switch (nb) {
    case 1:
      return tile_any<MB, 1>(x, D, wb, width, y, E, tail);
    case 2:
      return tile_any<MB, 2>(x, D, wb, width, y, E, tail);
    case 3:
      return tile_any<MB, 3>(x, D, wb, width, y, E, tail);
    default:
      return tile_any<MB, 4>(x, D, wb, width, y, E, tail);
  }
}

// Rows [0, n) of x against one block: six rows at a time (24 accumulators with 4 vectors), then the rest;
// after the first six rows the block comes from L2. (One pass of up to 16 rows, a vector of 16 experts at a
// time, ran a batch of 16 slower than this.)
void block_rows(const float* x, int64_t n, int64_t D, const float* wb, int64_t width, float* y, int64_t E) {
  for (int64_t m = 0; m < n; m += 6) {
    const float* xm = x + m * D;
    float* ym = y + m * E;
    switch (std::min<int64_t>(6, n - m)) {
      case 6:
        tile_rows<6>(xm, D, wb, width, ym, E);
        break;
      case 5:
        tile_rows<5>(xm, D, wb, width, ym, E);
        break;
      case 4:
        tile_rows<4>(xm, D, wb, width, ym, E);
        break;
      case 3:
        tile_rows<3>(xm, D, wb, width, ym, E);
        break;
      case 2:
        tile_rows<2>(xm, D, wb, width, ym, E);
        break;
      default:
        tile_rows<1>(xm, D, wb, width, ym, E);
        break;
    }
  }
}

#else

// Rows [0, n) of x against one block, a row at a time, the block's experts in the vector lanes.
void block_rows(const float* x, int64_t n, int64_t D, const float* wb, int64_t width, float* y, int64_t E) {
  float acc[kRouterBlock];
  for (int64_t m = 0; m < n; ++m) {
    std::fill(acc, acc + width, 0.0f);
    for (int64_t d = 0; d < D; ++d) {
      const float xv = x[m * D + d];
      const float* wr = wb + d * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) acc[j] = std::fma(xv, wr[j], acc[j]);
    }
    std::copy(acc, acc + width, y + m * E);
  }
}

#endif

}  // namespace

void router_logits(const float* x, int64_t T, int64_t D, const float* packed, int64_t E, float* y) {
  const int64_t blocks = (E + kRouterBlock - 1) / kRouterBlock, chunks = (T + kChunkRows - 1) / kChunkRows;
  const int64_t tasks = blocks * chunks;
  // Task k: chunk k / blocks, block k % blocks; a decode step's one chunk gives each thread its blocks,
  // each one run of bytes.
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 1 && T * D * E >= kParallelMacs)
  for (int64_t k = 0; k < tasks; ++k) {
    const int64_t c = k / blocks, b = k % blocks;
    const int64_t m0 = c * kChunkRows, n = std::min(kChunkRows, T - m0);
    const int64_t e0 = b * kRouterBlock, width = std::min(kRouterBlock, E - e0);
    block_rows(x + m0 * D, n, D, packed + e0 * D, width, y + m0 * E + e0, E);
  }
}

}  // namespace kda::kernels::gemm::KDA_ISA_NS
KDA_ISA_POP
