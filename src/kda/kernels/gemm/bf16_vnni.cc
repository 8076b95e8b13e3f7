#include "kda/kernels/gemm/bf16_vnni.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kda/common/isa.h"
#include "kda/kernels/gemm/dpbf16_lane.h"

#if defined(KDA_WITH_AVX512) && defined(__GNUC__) && defined(__x86_64__)
#define KDA_BF16_VNNI_BUILD 1
#include "kda/kernels/kda/avx512.h"  // <immintrin.h>, its GCC 12 false warnings silenced
#endif

namespace kda::kernels::gemm {

namespace {

template <class Y>
void check_args(const char* what, const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K,
                int64_t N, const Y* y, int64_t ldy, int64_t k_chunk) {
  const std::string f(what);
  if (k_chunk < 0 || k_chunk % kVnniBlockK != 0)
    throw std::invalid_argument(f + ": the chunk of inputs " + std::to_string(k_chunk) +
                                " is not a multiple of 16");
  if (K < 1 || N < 1 || M < 0)
    throw std::invalid_argument(f + ": bad sizes M " + std::to_string(M) + ", K " + std::to_string(K) +
                                ", N " + std::to_string(N));
  if (!bf16_vnni_takes(K))
    throw std::invalid_argument(f + ": the input size " + std::to_string(K) + " is not a multiple of 16");
  if (ldx < K || ldy < N) throw std::invalid_argument(f + ": a row stride below its row's size");
  if (M > 0 && (x == nullptr || w == nullptr || y == nullptr)) throw std::invalid_argument(f + ": null data");
}

}  // namespace

void pack_bf16_vnni(const bf16_t* w, int64_t K, int64_t N, bf16_t* packed) {
  if (!bf16_vnni_takes(K) || N < 1) throw std::invalid_argument("pack_bf16_vnni: bad sizes");
  const int64_t blocks = (N + kVnniBlockN - 1) / kVnniBlockN;
  for (int64_t nb = 0; nb < blocks; ++nb)
    for (int64_t p = 0; p < K / 2; ++p)
      for (int64_t c = 0; c < kVnniBlockN; ++c) {
        const int64_t n = nb * kVnniBlockN + c;
        bf16_t* d = packed + nb * kVnniBlockN * K + p * 2 * kVnniBlockN + 2 * c;
        d[0] = n < N ? w[n * K + 2 * p] : bf16_t{0};
        d[1] = n < N ? w[n * K + 2 * p + 1] : bf16_t{0};
      }
}

void gemm_bf16_vnni_reference(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
                              float* y, int64_t ldy, int64_t k_chunk) {
  check_args("gemm_bf16_vnni_reference", x, M, ldx, w, K, N, y, ldy, k_chunk);
  const int64_t chunk = (k_chunk <= 0 || k_chunk >= K ? K : k_chunk) / 2;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const bf16_t* wr = w + n / kVnniBlockN * kVnniBlockN * K + n % kVnniBlockN * 2;
      float acc = 0.0f, total = 0.0f;
      for (int64_t p = 0; p < K / 2; ++p) {
        const bf16_t* wp = wr + p * 2 * kVnniBlockN;
        const bf16_t* xp = x + m * ldx + 2 * p;
        acc =
            dpbf16_pair(acc, bf16_to_f32(wp[0]), bf16_to_f32(wp[1]), bf16_to_f32(xp[0]), bf16_to_f32(xp[1]));
        if ((p + 1) % chunk == 0 || p + 1 == K / 2) {  // a chunk's end: its sum is, or joins, the total
          total = p < chunk ? acc : dpbf16_daz(total + acc);
          acc = 0.0f;
        }
      }
      y[m * ldy + n] = total;
    }
}

#if defined(KDA_BF16_VNNI_BUILD)

bool cpu_has_bf16_vnni() { return cpu_has_bf16_gemm(); }

namespace {

// Below this many weights a call runs on one thread (the fork costs more than the work).
constexpr int64_t kParallelMin = int64_t{1} << 15;
constexpr int kMB = 6;             // rows per group: 6 x 4 accumulators, 4 weight vectors, 1 broadcast
constexpr int64_t kPassRows = 48;  // rows per pass over W (8 groups; their partial sums fit the stack)
constexpr int64_t kStretch = 64;   // input pairs per stretch: a block's 128 inputs, 16 KB, stay in L1
constexpr int64_t kPairRow = 2 * kVnniBlockN;  // values per pair row of a block

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma")

// Where a group's sums go when the row is done: fp32 or bf16 (rounded to nearest even) columns
// [n0, n0 + 16 * NZ) of y, the last one cut at N.
struct Out {
  float* yf;
  bf16_t* yb;
  int64_t ldy, N;
  inline void store(int64_t m, int64_t n, __m512 v) const {
    const int64_t left = N - n;
    const __mmask16 k = left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    if (yf != nullptr)
      _mm512_mask_storeu_ps(yf + m * ldy + n, k, v);
    else
      _mm256_mask_storeu_epi16(yb + m * ldy + n, k, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
};

inline __m512 pair_of(const bf16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return _mm512_castsi512_ps(_mm512_set1_epi32(v));
}

// Where a group's sums stand between calls of group(): part, the chunk's running sums (a stretch ended
// inside a chunk), and total, the finished chunks' sum; [MB][64] fp32 each.
struct Sums {
  float* part;
  float* total;
};
enum : unsigned {
  kResume = 1,      // the chunk's sums start from part (else from zero)
  kEndChunk = 2,    // the stretch ends its chunk: the sums go to total (else back to part)
  kFirstChunk = 4,  // ... and are the total (else added to it)
  kLast = 8,        // ... and the total goes to y
  kFetchL2 = 16,    // the group prefetches the block's lines `ahead` pairs on, into L2
};

// Rows [m0, m0 + MB) against NZ columns of 16 channels of one block (wb: the first column's values of
// pair row 0), input pairs [p0, p1).
template <int MB, int NZ>
inline void group(const bf16_t* x, int64_t ldx, int64_t m0, const bf16_t* wb, int64_t p0, int64_t p1, Sums s,
                  unsigned f, int64_t ahead, const Out& out, int64_t n0) {
  __m512 acc[MB][NZ];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NZ; ++j)
      acc[i][j] = (f & kResume) ? _mm512_load_ps(s.part + i * 64 + 16 * j) : _mm512_setzero_ps();
  const bf16_t* xr = x + m0 * ldx;
  for (int64_t p = p0; p < p1; ++p) {
    const bf16_t* wp = wb + p * kPairRow;
    if (f & kFetchL2)
      for (int j = 0; j < NZ; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(wp + ahead * kPairRow + 32 * j), _MM_HINT_T1);
    __m512 wv[NZ];
    for (int j = 0; j < NZ; ++j) wv[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(wp + 32 * j));
    for (int i = 0; i < MB; ++i) {
      const __m512 b = pair_of(xr + i * ldx + 2 * p);
      for (int j = 0; j < NZ; ++j)
        acc[i][j] =
            _mm512_dpbf16_ps(acc[i][j], reinterpret_cast<__m512bh>(wv[j]), reinterpret_cast<__m512bh>(b));
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NZ; ++j) {
      const int64_t o = i * 64 + 16 * j;
      if (!(f & kEndChunk)) {
        _mm512_store_ps(s.part + o, acc[i][j]);
        continue;
      }
      const __m512 t = (f & kFirstChunk) ? acc[i][j] : _mm512_add_ps(_mm512_load_ps(s.total + o), acc[i][j]);
      if (f & kLast)
        out.store(m0 + i, n0 + 16 * j, t);
      else
        _mm512_store_ps(s.total + o, t);
    }
}

template <int NZ>
inline void group_rows(int mb, const bf16_t* x, int64_t ldx, int64_t m0, const bf16_t* wb, int64_t p0,
                       int64_t p1, Sums s, unsigned f, int64_t ahead, const Out& out, int64_t n0) {
  switch (mb) {
    case 6:
      return group<6, NZ>(x, ldx, m0, wb, p0, p1, s, f, ahead, out, n0);
    case 5:
      return group<5, NZ>(x, ldx, m0, wb, p0, p1, s, f, ahead, out, n0);
    case 4:
      return group<4, NZ>(x, ldx, m0, wb, p0, p1, s, f, ahead, out, n0);
    case 3:
      return group<3, NZ>(x, ldx, m0, wb, p0, p1, s, f, ahead, out, n0);
    case 2:
      return group<2, NZ>(x, ldx, m0, wb, p0, p1, s, f, ahead, out, n0);
    default:
      return group<1, NZ>(x, ldx, m0, wb, p0, p1, s, f, ahead, out, n0);
  }
}

// Rows [r0, r1) (at most kPassRows) against columns [j0, j0 + NZ) of block nb, chunk by chunk of `chunk`
// pairs. With one group a chunk runs with its sums in registers, the block's lines read in address order
// with no prefetch (the hardware's alone read the LM head at one to six rows as fast as the read ceiling,
// where an L1 prefetch 4 KB ahead read it slower: docs/performance.md, "The LM head's one-row pass
// without a prefetch"); with more, stretch by stretch, each group's sums kept in memory between stretches
// (the same additions in the same order either way), and every group fetches the next stretch's lines, so
// that their reads from memory overlap all the groups' work on this stretch. Those go to L2: fetched into L1
// beside the stretch the groups are reading (the two fill a 32 KB L1, Zen 4's), they evicted lines the
// later groups still read, and the kernel fell behind oneDNN's matmul from a few groups on
// (docs/performance.md, "bf16 decode rows: the next stretch into L2").
template <int NZ>
void block_rows(const bf16_t* x, int64_t ldx, int64_t r0, int64_t r1, const bf16_t* w, int64_t K,
                int64_t chunk, int64_t nb, int64_t j0, const Out& out, float* part, float* total) {
  const bf16_t* wb = w + nb * kVnniBlockN * K + 32 * j0;
  const int64_t n0 = nb * kVnniBlockN + 16 * j0, P = K / 2;
  const int64_t rows = r1 - r0;
  for (int64_t c0 = 0; c0 < P; c0 += chunk) {
    const int64_t c1 = std::min(P, c0 + chunk);
    const int64_t stretch = rows <= kMB ? c1 - c0 : kStretch;
    for (int64_t p0 = c0; p0 < c1; p0 += stretch) {
      const int64_t p1 = std::min(c1, p0 + stretch);
      unsigned f = (p0 > c0 ? kResume : 0u) | (p1 == c1 ? kEndChunk : 0u) | (c0 == 0 ? kFirstChunk : 0u) |
                   (c1 == P ? kLast : 0u);
      for (int64_t m = r0; m < r1; m += kMB) {
        const int mb = static_cast<int>(std::min<int64_t>(kMB, r1 - m));
        const Sums s{part + (m - r0) * 64, total + (m - r0) * 64};
        group_rows<NZ>(mb, x, ldx, m, wb, p0, p1, s, f | (rows <= kMB ? 0u : kFetchL2), kStretch, out, n0);
      }
    }
  }
}

// Columns of 16 channels [c0, c1) against every row, a pass over them per kPassRows rows. The groups'
// sums between stretches live here, on the calling thread's stack ([kPassRows][64] fp32 each).
__attribute__((flatten)) void columns(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K,
                                      int64_t chunk, int64_t c0, int64_t c1, const Out& out) {
  alignas(64) float part[kPassRows * 64] = {};
  alignas(64) float total[kPassRows * 64] = {};
  for (int64_t r0 = 0; r0 < M; r0 += kPassRows) {
    const int64_t r1 = std::min(M, r0 + kPassRows);
    for (int64_t c = c0; c < c1;) {
      const int64_t nb = c / 4, j0 = c % 4, nz = std::min<int64_t>(4 - j0, c1 - c);
      switch (nz) {
        case 4:
          block_rows<4>(x, ldx, r0, r1, w, K, chunk, nb, j0, out, part, total);
          break;
        case 3:
          block_rows<3>(x, ldx, r0, r1, w, K, chunk, nb, j0, out, part, total);
          break;
        case 2:
          block_rows<2>(x, ldx, r0, r1, w, K, chunk, nb, j0, out, part, total);
          break;
        default:
          block_rows<1>(x, ldx, r0, r1, w, K, chunk, nb, j0, out, part, total);
          break;
      }
      c += nz;
    }
  }
}

#pragma GCC pop_options

void run(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N, int64_t k_chunk,
         const Out& out) {
  if (M == 0) return;
  const int64_t chunk = (k_chunk <= 0 || k_chunk >= K ? K : k_chunk) / 2;  // in pairs
  const int64_t cols = (N + 15) / 16;
  // Inside a parallel region (a kernel's work item: MLA's flash-style prefill) the calling thread does it
  // all.
  if (K * N < kParallelMin || cols < 2 || omp_in_parallel()) {
    columns(x, M, ldx, w, K, chunk, 0, cols, out);
    return;
  }
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    columns(x, M, ldx, w, K, chunk, cols * t / nt, cols * (t + 1) / nt, out);
  }
}

}  // namespace

void gemm_bf16_vnni(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N, float* y,
                    int64_t ldy, int64_t k_chunk) {
  if (!cpu_has_bf16_vnni()) throw std::logic_error("gemm_bf16_vnni: no AVX512_BF16 on this CPU");
  check_args("gemm_bf16_vnni", x, M, ldx, w, K, N, y, ldy, k_chunk);
  run(x, M, ldx, w, K, N, k_chunk, Out{y, nullptr, ldy, N});
}

void gemm_bf16_vnni(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N, bf16_t* y,
                    int64_t ldy, int64_t k_chunk) {
  if (!cpu_has_bf16_vnni()) throw std::logic_error("gemm_bf16_vnni: no AVX512_BF16 on this CPU");
  check_args("gemm_bf16_vnni", x, M, ldx, w, K, N, y, ldy, k_chunk);
  run(x, M, ldx, w, K, N, k_chunk, Out{nullptr, y, ldy, N});
}

#else  // no AVX-512 in this build

bool cpu_has_bf16_vnni() { return false; }

void gemm_bf16_vnni(const bf16_t*, int64_t, int64_t, const bf16_t*, int64_t, int64_t, float*, int64_t,
                    int64_t) {
  throw std::logic_error("gemm_bf16_vnni: not in this build");
}
void gemm_bf16_vnni(const bf16_t*, int64_t, int64_t, const bf16_t*, int64_t, int64_t, bf16_t*, int64_t,
                    int64_t) {
  throw std::logic_error("gemm_bf16_vnni: not in this build");
}

#endif

}  // namespace kda::kernels::gemm
