// The bf16 GEMM kernels, compiled once per ISA (kda/common/isa_target.h). AVX-512: intrinsics, the
// weights widened in registers. Portable and AVX2: a block of output channels is widened into an
// L1-sized buffer and every row of x is dotted against it (the compiler vectorises the dot products for
// the ISA of the copy).
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kda/common/isa_target.h"
#include "kda/kernels/gemm/bf16_gemm_isa.h"
#include "kda/kernels/kda/avx512.h"
#include "kda/kernels/kda/scratch.h"  // <immintrin.h>, its GCC 12 false warnings silenced

KDA_ISA_PUSH
namespace kda::kernels::gemm::KDA_ISA_NS {
namespace {

// Output channels per block (the packing's): the block's weights (4 x in x 2 bytes: 18 KiB at in = 2304)
// stay in L1 while every row of x passes over them, so each weight comes from memory once per call.
constexpr int64_t kNB = kPackChannels;
// Below this many weights a call runs on one thread (the fork costs more than the work).
constexpr int64_t kParallelMin = int64_t{1} << 15;
// Rows per pass over W: a chunk of x (64 x in x 4 bytes: 576 KiB at in = 2304) stays in L2 while the
// channel blocks pass, so a prefill reads W once per 64 rows instead of x once per channel block.
constexpr int64_t kRowChunk = 64;

#if defined(KDA_ISA_AVX512)

// From memory (a model's weights do not fit in the caches between steps) a thread's blocks are one
// sequential stream; a prefetch this far ahead (in weights: 4 KiB), once per cache line, keeps lines
// in flight beside the hardware prefetchers'.
constexpr int64_t kPrefetchAhead = 2048;

// f(0), ..., f(N - 1) with compile-time indices: the accumulator arrays below are then indexed by
// constants when GCC decides what to keep in registers (with loop indices it kept them in memory and
// stored every accumulator at every step, which bound the kernel by stores from a few rows on).
template <int N, class F>
inline void unrolled(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }
  (std::make_integer_sequence<int, N>{});
}

// x rows for the kernel: in each group of 32 inputs the 16 even ones, then the 16 odd ones, zero-padded
// to a multiple of 32. A 64-byte load of 32 bf16 weights then widens with one shift (the even weights:
// each one the low half of a 32-bit lane) and one mask (the odd ones, already the high half), where
// widening 16 at a time took a conversion and a shift per 16: one operation per 16 weights saved on the
// two ports that also run the FMAs.
constexpr int64_t kGroup = kPackGroup;
inline int64_t padded(int64_t in) { return (in + kGroup - 1) / kGroup * kGroup; }

void split_even_odd(const float* x, int64_t in, float* xp) {
  for (int64_t g = 0; g < in; g += kGroup) {
    for (int64_t i = 0; i < kGroup / 2; ++i) {
      xp[g + i] = g + 2 * i < in ? x[g + 2 * i] : 0.0f;
      xp[g + kGroup / 2 + i] = g + 2 * i + 1 < in ? x[g + 2 * i + 1] : 0.0f;
    }
  }
}

// One block's part of a K-chunk: `groups` groups of weights from b against rows [0, MB) of the split x
// (row stride ldp, from the chunk's first input), into channels [n0, n0 + nn) of y: stored for the first
// chunk, added for the next ones (so a row's sums run in the same order at any M). MB * kNB accumulators
// of 16 lanes (MB <= 6 leaves registers for the widened weights and x). The packing's zero padding
// makes every group whole; a last block's padded channels are computed and not stored.
template <int MB>
void block(const float* xp, int64_t ldp, const bf16_t* b, int64_t groups, float* y, int64_t ldy, int64_t n0,
           int64_t nn, bool add) {
  __m512 acc[MB][kNB];
  unrolled<MB>([&](auto i) { unrolled<kNB>([&](auto j) { acc[i][j] = _mm512_setzero_ps(); }); });
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t g = 0; g < groups; ++g, b += kNB * kGroup) {
    unrolled<kNB>([&](auto j) {
      _mm_prefetch(reinterpret_cast<const char*>(b + j * kGroup + kPrefetchAhead), _MM_HINT_T0);
    });
    __m512 we[kNB], wo[kNB];
    unrolled<kNB>([&](auto j) {
      const __m512i v = _mm512_loadu_si512(b + j * kGroup);
      we[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      wo[j] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
    });
    const int64_t k = g * kGroup;
    unrolled<MB>([&](auto i) {
      const __m512 xe = _mm512_loadu_ps(xp + i * ldp + k), xo = _mm512_loadu_ps(xp + i * ldp + k + 16);
      unrolled<kNB>([&](auto j) {
        acc[i][j] = _mm512_fmadd_ps(xe, we[j], acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(xo, wo[j], acc[i][j]);
      });
    });
  }
  unrolled<MB>([&](auto i) {
    unrolled<kNB>([&](auto j) {
      if (j < nn) {
        const float s = _mm512_reduce_add_ps(acc[i][j]);
        float& o = y[i * ldy + n0 + j];
        o = add ? o + s : s;
      }
    });
  });
}

// Every row of the split x against block nb's part of chunk c, six rows at a time (a 5-token verify
// row in one pass).
void channel_block(const float* xp, int64_t M, int64_t ldp, const Bf16Weights& w, const PackShape& ps,
                   int64_t c, int64_t nb, float* y, int64_t ldy) {
  const bf16_t* b = w.w + ps.offset(c, nb);
  const int64_t groups = ps.groups_in(c), n0 = nb * kNB, nn = std::min(kNB, w.out - n0);
  const bool add = c > 0;
  xp += c * ps.chunk_groups * kGroup;
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) block<6>(xp + m * ldp, ldp, b, groups, y + m * ldy, ldy, n0, nn, add);
  const float* xr = xp + m * ldp;
  float* yr = y + m * ldy;
  switch (M - m) {
    case 5:
      return block<5>(xr, ldp, b, groups, yr, ldy, n0, nn, add);
    case 4:
      return block<4>(xr, ldp, b, groups, yr, ldy, n0, nn, add);
    case 3:
      return block<3>(xr, ldp, b, groups, yr, ldy, n0, nn, add);
    case 2:
      return block<2>(xr, ldp, b, groups, yr, ldy, n0, nn, add);
    case 1:
      return block<1>(xr, ldp, b, groups, yr, ldy, n0, nn, add);
    default:
      return;
  }
}

}  // namespace

void gemm_bf16(const float* x, int64_t M, int64_t ldx, const Bf16Weights& w, float* y, int64_t ldy) {
  const PackShape ps(w.in, w.out);
  const int64_t ldp = padded(w.in);
  // One chunk of split x rows, from the calling thread's scratch before the region (steady-state calls
  // allocate nothing; a bad_alloc inside the region would terminate). split_even_odd writes all of it.
  thread_local ScratchBuffer scratch;
  float* const xs = scratch.get(static_cast<size_t>(std::min(M, kRowChunk) * ldp));
#pragma omp parallel if (w.in * w.out >= kParallelMin)
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t mc = std::min(kRowChunk, M - m0);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < mc; ++m) split_even_odd(x + (m0 + m) * ldx, w.in, xs + m * ldp);
    float* yc = y + m0 * ldy;
    // The same static split for every chunk: a thread adds into the channels it stored, so the chunks
    // need no barrier between them; the next row chunk's split waits for every thread.
    for (int64_t c = 0; c < ps.chunks; ++c) {
#pragma omp for schedule(static) nowait
      for (int64_t nb = 0; nb < ps.blocks; ++nb) channel_block(xs, mc, ldp, w, ps, c, nb, yc, ldy);
    }
    if (m0 + kRowChunk < M) {
#pragma omp barrier
    }
  }
}

#else  // portable, AVX2

}  // namespace

void gemm_bf16(const float* x, int64_t M, int64_t ldx, const Bf16Weights& w, float* y, int64_t ldy) {
  const int64_t nblocks = (w.out + kNB - 1) / kNB, in = w.in;
  const bool parallel = w.in * w.out >= kParallelMin;
  // Each thread's widened block, from the calling thread's scratch before the region (steady-state calls
  // allocate nothing; a bad_alloc inside the region would terminate).
  thread_local ScratchBuffer scratch;
  float* const buf = scratch.get(static_cast<size_t>(kNB * in * (parallel ? omp_get_max_threads() : 1)));
#pragma omp parallel if (parallel)
  {
    float* wf = buf + kNB * in * omp_get_thread_num();
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t m1 = std::min(M, m0 + kRowChunk);
#pragma omp for schedule(static)
      for (int64_t nb = 0; nb < nblocks; ++nb) {
        const int64_t n0 = nb * kNB, nn = std::min(kNB, w.out - n0);
        widen_block(w, nb, wf);
        for (int64_t m = m0; m < m1; ++m) {
          const float* xr = x + m * ldx;
          for (int64_t j = 0; j < nn; ++j) {
            const float* wr = wf + j * in;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < in; ++k) s += xr[k] * wr[k];
            y[m * ldy + n0 + j] = s;
          }
        }
      }
    }
  }
}

#endif

}  // namespace kda::kernels::gemm::KDA_ISA_NS
KDA_ISA_POP
