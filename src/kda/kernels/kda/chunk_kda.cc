// chunk_kda_opt: the chunked WY form (spec "Chunked form", C = 64) organised for speed.
//
// Work items are (sequence, group of up to 4 heads), handed to OpenMP threads dynamically (one long
// sequence still has H / 4 items, so both cores work on it); the heads of a group advance chunk by chunk
// together, so each token row's pages and cache lines serve all of them. Each thread keeps one aligned
// scratch buffer across calls, so nothing is allocated per chunk. Per chunk of L <= 64 rows of one head,
// in blocks of 16 rows:
//   1. q-hat (scale folded in), k-hat, g (gate fused), exp(g) and beta into contiguous fp32 rows (q, k,
//      v and g are read as they come, fp32 or bf16);
//   2. decays. Every decay exp(Gamma_r - Gamma_s), r >= s, is a product of at most three factors, each
//      <= 1 and each built over exactly the rows it spans: a running product of the per-step factors
//      exp(g_i) inside one block (at most 15 of them) and, across blocks, exp of a running sum taken at
//      block boundaries. No positive exponent and no difference of two cumulative sums is ever formed;
//   3. Aqk and Akk: blocks below the diagonal as products (q_r * rowdecay) . (k_s * coldecay) with the
//      factors above, diagonal blocks pair by pair (k_s times the running product of exp(g_i));
//   4. T = (I + Akk)^-1: the 16 x 16 diagonal blocks by forward substitution, the rest as products;
//   5. R = beta V - (beta K * exp(Gamma)) S, Vn = T R;
//   6. O = (Q * exp(Gamma)) S + Aqk Vn, written straight into o;
//   7. S <- diag(exp(Gamma_last)) S + (K * exp(Gamma_last - Gamma))^T Vn, in the pool slot when possible.
// Snapshots (KdaArgs::snapshots): a sequence's chunks end at its snapshot positions too, besides the
// multiples of 64 from its start (a short chunk is a chunk of the chunked form like a sequence's last
// one), and the state at such a boundary is copied into the snapshot's slot: no second pass.
//
// Steps 3-7 are products C = init + A B run by one register-blocked micro-kernel: kMR rows x 16 kNV
// columns of accumulators in zmm registers, A broadcast element by element, B rows loaded as vectors.
// A column strip of B (128 x 48 floats of the state, 24 KB) stays in L1 while all row blocks pass it.
// While a chunk computes, step 1 of the next (chunk, head) runs a row at a time between its micro-tiles,
// each row prefetched a line at a time during the tiles before, at the pace of their work (see Stager).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>  // _mm_getcsr / _mm_setcsr
#endif

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/avx512.h"
#include "kda/kernels/kda/impl.h"
#include "kda/kernels/kda/prepare.h"
#include "kda/kernels/kda/scratch.h"
#include "kda/kernels/kda/vec_math.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS {
namespace {

using prep::head_prep;
using prep::HeadPrep;
using prep::prepare_row;
using vecmath::exp_approx;
#if defined(KDA_ISA_AVX512)
using prep::load16;
#endif

constexpr int kChunk = 64;  // C
constexpr int kSub = 16;    // block size of the decay anchoring
constexpr int kBlocks = kChunk / kSub;
constexpr int kMR = 8;        // micro-tile rows
constexpr int kNV = 3;        // micro-tile columns, in 16-float vectors
constexpr int kMaxGroup = 4;  // heads that advance together through a sequence (see process_item)

// One product term A[M, kd] B[kd, N] of a micro-kernel call. A(i, d) is a[i * lda + d], or with `at`
// (A stored transposed) a[d * lda + i]; B row d starts at b + d * ldb. `lower`: A is lower triangular
// with its diagonal, so the rows r0..r0+m-1 of a tile only need the first r0+m columns of A (A must hold
// zeros above the diagonal inside the tile's rows).
struct Seg {
  const float* a;
  int64_t lda;
  bool at;
  const float* b;
  int64_t ldb;
  int kd;
  bool lower;
};

// Initial value of C: rows of src scaled by scale[row] (null scale: by 1), or zero when src is null.
struct Init {
  const float* src = nullptr;
  int64_t ld = 0;
  const float* scale = nullptr;
};

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
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(dst + j, load16(src + j));
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
  // flight at any time (measured: ~2% faster than a burst of the whole row).
  static constexpr int kAhead = 2;
  static constexpr int kMaxLines = 64;

  struct Unit {
    HeadPrep prep;
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
    prepare_row(u_.prep, q, k, g, u_.Q + r * K, u_.Kh + r * K, u_.G + r * K, u_.E + r * K);
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

#if defined(KDA_ISA_AVX512)

// acc[0:MR, 0:NV] += A[r0:r0+MR, 0:kd] B[0:kd, j0:j0+16NV]; the last vector of each B row is masked.
// With PF, every kPfEvery-th step prefetches the next line of pf's list.
template <int MR, int NV, bool AT, bool PF>
inline void kloop(const Seg& s, int kd, int r0, int j0, __mmask16 tail, __m512 (&acc)[MR][NV], PfLines* pf) {
  const float* b = s.b + j0;
  const float* a = AT ? s.a + r0 : s.a + r0 * s.lda;
  int countdown = 1;
  for (int d = 0; d < kd; ++d, b += s.ldb) {
    if constexpr (PF) {
      if (--countdown == 0) {
        countdown = kPfEvery;
        if (pf->n > 0) {
          _mm_prefetch(*pf->p, _MM_HINT_T0);
          ++pf->p;
          --pf->n;
        }
      }
    }
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      bv[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(tail, b + 16 * v) : _mm512_loadu_ps(b + 16 * v);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(AT ? a[d * s.lda + i] : a[i * s.lda + d]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(ai, bv[v], acc[i][v]);
    }
  }
}

template <int MR, int NV, bool PF = false>
inline void tile(const Seg* segs, int nseg, const Init& init, int r0, int j0, __mmask16 tail, float* c,
                 int64_t ldc, PfLines* pf = nullptr) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    if (init.src != nullptr) {
      const __m512 sc = _mm512_set1_ps(init.scale != nullptr ? init.scale[r0 + i] : 1.0f);
      const float* p = init.src + (r0 + i) * init.ld + j0;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __m512 x = v == NV - 1 ? _mm512_maskz_loadu_ps(tail, p + 16 * v) : _mm512_loadu_ps(p + 16 * v);
        acc[i][v] = _mm512_mul_ps(sc, x);
      }
    } else {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
    }
  }
  for (int q = 0; q < nseg; ++q) {
    const Seg& s = segs[q];
    const int kd = s.lower ? std::min(s.kd, r0 + MR) : s.kd;
    if (s.at) {
      kloop<MR, NV, true, PF>(s, kd, r0, j0, tail, acc, pf);
    } else {
      kloop<MR, NV, false, PF>(s, kd, r0, j0, tail, acc, pf);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    float* p = c + (r0 + i) * ldc + j0;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if (v == NV - 1) {
        _mm512_mask_storeu_ps(p + 16 * v, tail, acc[i][v]);
      } else {
        _mm512_storeu_ps(p + 16 * v, acc[i][v]);
      }
    }
  }
}

// All rows of one column strip [j0, j0 + 16 NV), kMR at a time, then the remainder rows.
template <int NV>
void strip_rows(int M, const Seg* segs, int nseg, const Init& init, int j0, __mmask16 tail, float* c,
                int64_t ldc, Stager* pf) {
  int r0 = 0;
  for (; r0 + kMR <= M; r0 += kMR) {
    if (pf != nullptr) {
      tile<kMR, NV, true>(segs, nseg, init, r0, j0, tail, c, ldc, &pf->lines());
      pf->tile_done();
    } else {
      tile<kMR, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
    }
  }
  static_assert(kMR <= 8, "remainder dispatch below covers up to 7 rows");
  switch (M - r0) {
    case 1:
      tile<1, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    case 2:
      tile<2, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    case 3:
      tile<3, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    case 4:
      tile<4, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    case 5:
      tile<5, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    case 6:
      tile<6, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    case 7:
      tile<7, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    default:
      break;
  }
}

// C[M, N] = init + sum over segs of A B (C may alias init.src: every tile reads its own init first).
// This and the steps below are kept out of line: inlined all into one function, GCC 12 compiles the
// chunk 2x slower.
// During each full micro-tile pf (if any) prefetches its next lines, and after it prepares the rows due.
[[gnu::noinline]] void gemm(int M, int N, const Seg* segs, int nseg, const Init& init, float* c, int64_t ldc,
                            Stager* pf = nullptr) {
  static_assert(kNV >= 1 && kNV <= 4, "strip dispatch below covers 1..4 vectors");
  for (int j0 = 0; j0 < N; j0 += 16 * kNV) {
    const int nw = std::min(16 * kNV, N - j0);
    const __mmask16 tail = nw % 16 == 0 ? 0xFFFF : static_cast<__mmask16>((1u << (nw % 16)) - 1);
    switch ((nw + 15) / 16) {
      case 1:
        strip_rows<1>(M, segs, nseg, init, j0, tail, c, ldc, pf);
        break;
      case 2:
        if constexpr (kNV >= 2) strip_rows<2>(M, segs, nseg, init, j0, tail, c, ldc, pf);
        break;
      case 3:
        if constexpr (kNV >= 3) strip_rows<3>(M, segs, nseg, init, j0, tail, c, ldc, pf);
        break;
      default:
        if constexpr (kNV >= 4) strip_rows<4>(M, segs, nseg, init, j0, tail, c, ldc, pf);
        break;
    }
  }
}

#else  // Portable fallback (the portable and AVX2 copies): the same products, plain loops.

[[gnu::noinline]] void gemm(int M, int N, const Seg* segs, int nseg, const Init& init, float* c, int64_t ldc,
                            Stager* pf = nullptr) {
  if (pf != nullptr) pf->finish();
  float acc[kChunk];  // one row, kChunk columns at a time
  for (int i = 0; i < M; ++i) {
    for (int j0 = 0; j0 < N; j0 += kChunk) {
      const int nw = std::min(kChunk, N - j0);
      const float sc = init.scale != nullptr ? init.scale[i] : 1.0f;
      for (int j = 0; j < nw; ++j) acc[j] = init.src != nullptr ? sc * init.src[i * init.ld + j0 + j] : 0.0f;
      for (int q = 0; q < nseg; ++q) {
        const Seg& s = segs[q];
        const int kd = s.lower ? std::min(s.kd, i + 1) : s.kd;
        for (int d = 0; d < kd; ++d) {
          const float x = s.at ? s.a[d * s.lda + i] : s.a[i * s.lda + d];
          const float* b = s.b + d * s.ldb + j0;
#pragma omp simd
          for (int j = 0; j < nw; ++j) acc[j] += x * b[j];
        }
      }
      for (int j = 0; j < nw; ++j) c[i * ldc + j0 + j] = acc[j];
    }
  }
}

#endif

#if defined(KDA_ISA_AVX512)

inline __mmask16 tail_mask(int n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// Lane i of the result is the sum of the 16 lanes of v[i].
inline __m512 reduce16(const __m512 (&v)[16]) {
  __m512 a[8];
  for (int i = 0; i < 8; ++i) {
    a[i] =
        _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 b[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] =
        _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // b[i], 128-bit lane l, element e: a partial sum of v[4i + e]; now sum the four lanes.
  const __m512 c0 =
      _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 =
      _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// dst[d, 0:16] = src[0:16, d] for d < nd (nd <= 16): one 16 x 16 block, src rows lds apart (all 16 rows
// valid; columns beyond nd are not read), dst rows ldd apart.
inline void transpose16(const float* src, int64_t lds, int nd, float* dst, int64_t ldd) {
  const __mmask16 m = tail_mask(nd);
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_ps(m, src + i * lds);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 2; ++j) {
      const __m512d x = _mm512_castps_pd(t[4 * i + j]), y = _mm512_castps_pd(t[4 * i + j + 2]);
      r[4 * i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
      r[4 * i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
    }
  }
  // r[4i + c], 128-bit lane l: column 4l + c of rows 4i..4i+3. Gather lanes across the four row groups.
  for (int c = 0; c < 4; ++c) {
    const __m512 x01lo = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44);  // lanes 0,1 of rows 0-3, 4-7
    const __m512 x01hi = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);  // lanes 2,3
    const __m512 x23lo = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
    const __m512 x23hi = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_f32x4(x01lo, x23lo, 0x88);       // lane 0: column c
    t[4 + c] = _mm512_shuffle_f32x4(x01lo, x23lo, 0xDD);   // lane 1: column 4 + c
    t[8 + c] = _mm512_shuffle_f32x4(x01hi, x23hi, 0x88);   // lane 2: column 8 + c
    t[12 + c] = _mm512_shuffle_f32x4(x01hi, x23hi, 0xDD);  // lane 3: column 12 + c
  }
  for (int d = 0; d < nd; ++d) _mm512_storeu_ps(dst + d * ldd, t[d]);
}

// Pairs (r, s) of one diagonal block, r in [r0, r0 + NR), r >= s: with p = k_s * prod_{s<i<=r} exp(g_i)
// (running product from s; Pst holds it between calls), Aqk[r, s] = q_r . p and, for r > s,
// NAkk[r, s] = -beta_r k_r . p.
template <int NR>
inline void diag_pairs(int K, int s, int r0, const float* Q, const float* Kh, const float* E, const float* B,
                       float* Pst, float* Aqk, float* NAkk) {
  constexpr int C = kChunk;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int d = 0; d < K; d += 16) {
    const __mmask16 m = tail_mask(K - d);
    __m512 p = _mm512_maskz_loadu_ps(m, (r0 == s ? Kh + s * K : Pst) + d);
    for (int i = 0; i < NR; ++i) {
      const int r = r0 + i;
      if (r > s) p = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(m, E + r * K + d));
      acc[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, Q + r * K + d), p, acc[i]);
      acc[8 + i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, Kh + r * K + d), p, acc[8 + i]);
    }
    _mm512_mask_storeu_ps(Pst + d, m, p);
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(acc));
  for (int i = 0; i < NR; ++i) {
    const int r = r0 + i;
    Aqk[r * C + s] = sums[i];
    if (r > s) NAkk[r * C + s] = -B[r] * sums[8 + i];
  }
}

// T_bb = (I - NAkk_bb)^-1 for the four 16 x 16 diagonal blocks of T (row stride C), side by side so that
// four independent substitution chains hide the FMA latency: T[r, :] = e_r + sum_{j<r} NAkk[r, j] T[j, :].
// NAkk must be finite in every block (rows beyond the chunk zero).
inline void invert_diagonal_blocks(const float* NAkk, float* T) {
  constexpr int C = kChunk;
  for (int r = 0; r < kSub; ++r) {
    __m512 t[kBlocks];
    for (int b = 0; b < kBlocks; ++b) {
      t[b] = _mm512_maskz_mov_ps(static_cast<__mmask16>(1u << r), _mm512_set1_ps(1.0f));
    }
    for (int j = 0; j < r; ++j) {
      for (int b = 0; b < kBlocks; ++b) {
        const int o = b * kSub;
        t[b] = _mm512_fmadd_ps(_mm512_set1_ps(NAkk[(o + r) * C + o + j]), _mm512_load_ps(T + (o + j) * C + o),
                               t[b]);
      }
    }
    for (int b = 0; b < kBlocks; ++b) _mm512_store_ps(T + (b * kSub + r) * C + b * kSub, t[b]);
  }
}

#else  // Portable fallback: the same steps, plain loops.

inline void transpose16(const float* src, int64_t lds, int nd, float* dst, int64_t ldd) {
  for (int d = 0; d < nd; ++d) {
    for (int i = 0; i < 16; ++i) dst[d * ldd + i] = src[i * lds + d];
  }
}

template <int NR>
inline void diag_pairs(int K, int s, int r0, const float* Q, const float* Kh, const float* E, const float* B,
                       float* Pst, float* Aqk, float* NAkk) {
  constexpr int C = kChunk;
  if (r0 == s) std::memcpy(Pst, Kh + s * K, K * sizeof(float));
  for (int i = 0; i < NR; ++i) {
    const int r = r0 + i;
    const float* __restrict e = E + r * K;
    const float* __restrict q = Q + r * K;
    const float* __restrict k = Kh + r * K;
    float dq = 0.0f, dk = 0.0f;
    if (r > s) {
      for (int d = 0; d < K; ++d) Pst[d] *= e[d];
    }
    for (int d = 0; d < K; ++d) {
      dq += q[d] * Pst[d];
      dk += k[d] * Pst[d];
    }
    Aqk[r * C + s] = dq;
    if (r > s) NAkk[r * C + s] = -B[r] * dk;
  }
}

inline void invert_diagonal_blocks(const float* NAkk, float* T) {
  constexpr int C = kChunk;
  for (int b = 0; b < kBlocks; ++b) {
    const int o = b * kSub;
    for (int r = 0; r < kSub; ++r) {
      float* row = T + (o + r) * C + o;
      for (int x = 0; x < kSub; ++x) row[x] = x == r ? 1.0f : 0.0f;
      for (int j = 0; j < r; ++j) {
        const float c = NAkk[(o + r) * C + o + j];
        for (int x = 0; x <= j; ++x) row[x] += c * T[(o + j) * C + o + x];
      }
    }
  }
}

#endif

// One diagonal block's pairs: rows [n, n + m).
void diagonal_block(int K, int n, int m, const float* Q, const float* Kh, const float* E, const float* B,
                    float* Pst, float* Aqk, float* NAkk) {
  for (int s = n; s < n + m; ++s) {
    for (int r0 = s; r0 < n + m; r0 += 8) {
      switch (std::min(8, n + m - r0)) {
        case 1:
          diag_pairs<1>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        case 2:
          diag_pairs<2>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        case 3:
          diag_pairs<3>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        case 4:
          diag_pairs<4>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        case 5:
          diag_pairs<5>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        case 6:
          diag_pairs<6>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        case 7:
          diag_pairs<7>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        default:
          diag_pairs<8>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
      }
    }
  }
}

thread_local ScratchBuffer tl_scratch;

// One thread's working arrays, carved from its buffer. Rows are [C, K] unless noted. Arrays that are
// never live at the same time share memory (the scratch stays well inside L2, next to the states).
struct Scratch {
  float* S = nullptr;   // [kMaxGroup, K, V] private states when the pool slots cannot be updated in place
  float* Q = nullptr;   // scale * q-hat
  float* Kh = nullptr;  // k-hat
  float* G = nullptr;   // log-space gate g
  float* E = nullptr;   // exp(g)
  float* Xq = nullptr;  // q_r * exp(Gamma_r - Gamma_n), n the block's first row; then Q * exp(Gamma) (Qf)
  float* Xk = nullptr;  // -beta_r k_r * exp(Gamma_r - Gamma_n); then -beta K * exp(Gamma) (Wn)
  // k_s * exp(Gamma_e - Gamma_s), e the block's last row; then K * exp(Gamma_last - Gamma) (Kr)
  float* Kc = nullptr;
  float* KcT = nullptr;  // [K, C] Kc transposed (step 3)
  float* Bn = nullptr;   // [K, C] KcT times the block-to-block decays of one query block (step 3)
  float* X = nullptr;    // [kSub, C] (step 4)
  float* R = nullptr;    // [C, V] (step 5)
  float* Vn = nullptr;   // [C, V] (steps 5-7)
  float* fa = nullptr;   // [kBlocks, K] exp(Gamma_n), n the first row of each block
  float* ra = nullptr;   // [kBlocks, K] exp(Gamma_last - Gamma_e), e the last row of each block
  // [kBlocks, K] exp(Gamma_n - Gamma_e') for one query block n and the earlier blocks' last rows e'
  float* M = nullptr;
  float* acc = nullptr;   // [K] running sums
  float* P = nullptr;     // [K] running products
  float* last = nullptr;  // [K] exp(Gamma_last)
  float* Aqk = nullptr;   // [C, C]
  float* NAkk = nullptr;  // [C, C] -Akk
  float* T = nullptr;     // [C, C] (I + Akk)^-1
  float* B = nullptr;     // [C] beta
  // The (chunk, head) named by staged_t0 / staged_h has had its step 1 done by the Stager: Q, Kh, G, E
  // and B hold its rows and sv its v (written during steps 5-7 of the chunk before, when they are dead,
  // or at the start of a work item's first chunk).
  float* sv = nullptr;  // [C, V]
  int64_t staged_t0 = -1;
  int staged_h = -1;

  Scratch(int K, int V, int group) {
    const size_t K_ = K, V_ = V, C = kChunk, CK = C * K_, NB = kBlocks;
    const size_t r1 = std::max(K_ * C, C * V_), r2 = std::max({K_ * C, C * V_, kSub * C});
    float* r1p = nullptr;
    float* r2p = nullptr;
    const size_t sizes[] = {group * K_ * V_, CK,      CK, CK, CK, CK,    CK,    CK,    r1, r2,    NB * K_,
                            NB * K_,         NB * K_, K_, K_, K_, C * C, C * C, C * C, C,  C * V_};
    float** ptrs[] = {&S,  &Q, &Kh,  &G, &E,    &Xq,  &Xk,   &Kc, &r1p, &r2p, &fa,
                      &ra, &M, &acc, &P, &last, &Aqk, &NAkk, &T,  &B,   &sv};
    static_assert(std::size(sizes) == std::size(ptrs));
    size_t total = 0;
    for (size_t n : sizes) total += (n + 15) / 16 * 16;  // keep every array 64-byte aligned
    float* p = tl_scratch.get(total);
    for (size_t i = 0; i < std::size(sizes); ++i) {
      *ptrs[i] = p;
      p += (sizes[i] + 15) / 16 * 16;
    }
    KcT = Vn = r1p;
    Bn = X = R = r2p;
  }
};

// Row strides of the inputs (elements between consecutive tokens).
struct Strides {
  int64_t q, k, v, g;
};

// Step 2: in-block decays and the block anchors.
[[gnu::noinline]] void decays(int K, int L, Scratch& w) {
  float* __restrict P = w.P;
  for (int n = 0; n < L; n += kSub) {
    const int e = std::min(n + kSub, L) - 1;
    // Row factors from the block's first row: P = prod_{n<i<=r} exp(g_i).
    for (int r = n; r <= e; ++r) {
      const float* __restrict E = w.E + r * K;
      const float* __restrict Q = w.Q + r * K;
      const float* __restrict Kh = w.Kh + r * K;
      float* __restrict Xq = w.Xq + r * K;
      float* __restrict Xk = w.Xk + r * K;
      const float nb = -w.B[r];
      const bool first = r == n;
#pragma omp simd
      for (int d = 0; d < K; ++d) {
        const float p = first ? 1.0f : P[d] * E[d];
        P[d] = p;
        Xq[d] = Q[d] * p;
        Xk[d] = nb * Kh[d] * p;
      }
    }
    // Column factors to the block's last row: P = prod_{s<i<=e} exp(g_i).
    for (int s = e; s >= n; --s) {
      const float* __restrict E = w.E + (s + 1) * K;  // only read for s < e
      const float* __restrict Kh = w.Kh + s * K;
      float* __restrict Kc = w.Kc + s * K;
      const bool first = s == e;
#pragma omp simd
      for (int d = 0; d < K; ++d) {
        const float p = first ? 1.0f : P[d] * E[d];
        P[d] = p;
        Kc[d] = Kh[d] * p;
      }
    }
  }
  // Anchors, running sums over whole rows: forward from the chunk start to each block's first row (and
  // to the last row), backward from the chunk end to each block's last row (exclusive).
  float* __restrict acc = w.acc;
#pragma omp simd
  for (int d = 0; d < K; ++d) acc[d] = 0.0f;
  for (int r = 0; r < L; ++r) {
    const float* __restrict G = w.G + r * K;
#pragma omp simd
    for (int d = 0; d < K; ++d) acc[d] += G[d];
    if (r % kSub == 0) {
      float* __restrict fa = w.fa + (r / kSub) * K;
#pragma omp simd
      for (int d = 0; d < K; ++d) fa[d] = exp_approx(acc[d]);
    }
  }
#pragma omp simd
  for (int d = 0; d < K; ++d) w.last[d] = exp_approx(acc[d]);
#pragma omp simd
  for (int d = 0; d < K; ++d) acc[d] = 0.0f;
  for (int r = L - 1; r >= 0; --r) {
    if (r == L - 1 || r % kSub == kSub - 1) {
      float* __restrict ra = w.ra + (r / kSub) * K;
#pragma omp simd
      for (int d = 0; d < K; ++d) ra[d] = exp_approx(acc[d]);
    }
    const float* __restrict G = w.G + r * K;
#pragma omp simd
    for (int d = 0; d < K; ++d) acc[d] += G[d];
  }
}

// Step 3: Aqk (lower, with diagonal; scale already in Q) and NAkk = -Akk (strictly lower, times beta_r).
[[gnu::noinline]] void build_attention(int K, int L, Scratch& w) {
  constexpr int C = kChunk;
  // Every entry the later steps read is written below, except two kinds, zeroed here: Aqk above the
  // diagonal inside the diagonal blocks (the lower-triangular product Aqk Vn reads whole micro-tile rows)
  // and, in a short chunk, the NAkk rows beyond it (invert_diagonal_blocks works on all four blocks).
  for (int r = 0; r < L; ++r) {
    const int n = r / kSub * kSub;
    std::memset(w.Aqk + r * C + n, 0, sizeof(float) * kSub);
  }
  if (L < C) std::memset(w.NAkk + L * C, 0, sizeof(float) * (C - L) * C);
  // Key side of the blocks below the diagonal, transposed: every block but the last.
  const int nkey = (L - 1) / kSub * kSub;
  for (int s = 0; s < nkey; s += kSub) {
    for (int d = 0; d < K; d += 16)
      transpose16(w.Kc + s * K + d, K, std::min(16, K - d), w.KcT + d * C + s, C);
  }
  float* __restrict acc = w.acc;
  for (int n = kSub; n < L; n += kSub) {
    const int m = std::min(kSub, L - n);  // rows n..n+m-1
    const int b = n / kSub;
    // Block-to-block decays exp(sum_{e'<i<=n} g_i) for the earlier blocks' last rows e' = n-1, n-17, ...,
    // a running sum from row n down, over exactly the rows it spans.
    {
      const float* __restrict G = w.G + n * K;
#pragma omp simd
      for (int d = 0; d < K; ++d) acc[d] = G[d];
    }
    for (int j = b - 1; j >= 0; --j) {
      if (j < b - 1) {
        for (int r = (j + 1) * kSub; r < (j + 2) * kSub; ++r) {
          const float* __restrict G = w.G + r * K;
#pragma omp simd
          for (int d = 0; d < K; ++d) acc[d] += G[d];
        }
      }
      float* __restrict Mj = w.M + j * K;
#pragma omp simd
      for (int d = 0; d < K; ++d) Mj[d] = exp_approx(acc[d]);
    }
    for (int d = 0; d < K; ++d) {
      const float* __restrict src = w.KcT + d * C;
      float* __restrict dst = w.Bn + d * C;
      for (int j = 0; j < b; ++j) {
        const float f = w.M[j * K + d];
#pragma omp simd
        for (int x = 0; x < kSub; ++x) dst[j * kSub + x] = src[j * kSub + x] * f;
      }
    }
    const Seg sq{w.Xq + n * K, K, false, w.Bn, C, K, false};
    gemm(m, n, &sq, 1, Init{}, w.Aqk + n * C, C);
    const Seg sk{w.Xk + n * K, K, false, w.Bn, C, K, false};
    gemm(m, n, &sk, 1, Init{}, w.NAkk + n * C, C);
  }
  for (int n = 0; n < L; n += kSub) {
    diagonal_block(K, n, std::min(kSub, L - n), w.Q, w.Kh, w.E, w.B, w.P, w.Aqk, w.NAkk);
  }
}

// Turns Xq, Xk, Kc into Qf = Q exp(Gamma), Wn = -beta K exp(Gamma), Kr = K exp(Gamma_last - Gamma).
[[gnu::noinline]] void apply_anchors(int K, int L, Scratch& w) {
  for (int r = 0; r < L; ++r) {
    const float* __restrict fa = w.fa + (r / kSub) * K;
    const float* __restrict ra = w.ra + (r / kSub) * K;
    float* __restrict Xq = w.Xq + r * K;
    float* __restrict Xk = w.Xk + r * K;
    float* __restrict Kc = w.Kc + r * K;
#pragma omp simd
    for (int d = 0; d < K; ++d) {
      Xq[d] *= fa[d];
      Xk[d] *= fa[d];
      Kc[d] *= ra[d];
    }
  }
}

// Step 4: T = (I + Akk)^-1 = (I - NAkk)^-1. Diagonal blocks by substitution; then block row i:
// T[i, :i] = T_ii (NAkk[i, :i] T[:i, :i]). Every row of T is zero beyond its diagonal, which the
// lower-triangular product T R relies on.
[[gnu::noinline]] void invert(int L, Scratch& w) {
  constexpr int C = kChunk;
  // invert_diagonal_blocks writes whole 16-column rows of the diagonal blocks and the products below the
  // blocks left of them; the blocks right of the diagonal are zero (the product X reads T[:n, :n]).
  for (int r = 0; r < C - kSub; ++r) {
    const int e = (r / kSub + 1) * kSub;
    std::memset(w.T + r * C + e, 0, sizeof(float) * (C - e));
  }
  invert_diagonal_blocks(w.NAkk, w.T);
  for (int n = kSub; n < L; n += kSub) {
    const int m = std::min(kSub, L - n);
    const Seg sx{w.NAkk + n * C, C, false, w.T, C, n, false};
    gemm(m, n, &sx, 1, Init{}, w.X, C);
    const Seg st{w.T + n * C + n, C, false, w.X, C, m, true};
    gemm(m, n, &st, 1, Init{}, w.T + n * C, C);
  }
}

// Token range [bos, eos) of sequence i.
std::pair<int64_t, int64_t> segment(const KdaArgs& a, int64_t i) {
  if (a.cu_seqlens != nullptr) return {a.cu_seqlens[i], a.cu_seqlens[i + 1]};
  return {i * (a.T / a.N), (i + 1) * (a.T / a.N)};
}

// Starts step 1 of rows [t0, t0 + rows) of head h on the stager.
void plan_stage(const KdaArgs& a, const Strides& st, int h, int64_t t0, int rows, float scale, Scratch& w,
                Stager& pf) {
  const int K = a.K, V = a.V;
  const bool bf16 = a.q_bf16 != nullptr, g_bf16 = a.g_bf16 != nullptr;
  const int64_t e = bf16 ? 2 : 4, eg = g_bf16 ? 2 : 4;  // bytes per q, k, v element; per g element
  const auto at = [](const void* base, int64_t elems, int64_t bytes) {
    return static_cast<const char*>(base) + elems * bytes;
  };
  pf.start({head_prep(a, h, scale),
            bf16,
            g_bf16,
            at(bf16 ? static_cast<const void*>(a.q_bf16) : a.q, t0 * st.q + h * K, e),
            at(bf16 ? static_cast<const void*>(a.k_bf16) : a.k, t0 * st.k + h * K, e),
            at(bf16 ? static_cast<const void*>(a.v_bf16) : a.v, t0 * st.v + static_cast<int64_t>(h) * V, e),
            at(g_bf16 ? static_cast<const void*>(a.g_bf16) : a.g, t0 * st.g + h * K, eg),
            a.beta + t0 * a.H + h,
            st.q,
            st.k,
            st.g,
            st.v,
            a.H,
            rows,
            V,
            w.Q,
            w.Kh,
            w.G,
            w.E,
            w.sv,
            w.B});
  w.staged_t0 = t0;
  w.staged_h = h;
}

// A chunk's next unit of work on this thread, staged while the chunk computes.
struct Next {
  int64_t t0 = -1;
  int h = 0;
  int rows = 0;
};

// Steps 1-7 for rows [c0, c0 + L) of head h, state S updated in place.
void process_chunk(const KdaArgs& a, const Strides& st, int h, int64_t c0, int L, float* S, const Next& next,
                   float scale, Scratch& w) {
  const int K = a.K, V = a.V;
  constexpr int C = kChunk;
  const int64_t ldo = static_cast<int64_t>(a.H) * V;
  // Step 1: done by the stager during the chunk before, or now (the first chunk of a work item).
  if (w.staged_t0 != c0 || w.staged_h != h) {
    Stager now;
    plan_stage(a, st, h, c0, L, scale, w, now);
    now.finish();
  }
  decays(K, L, w);
  build_attention(K, L, w);
  apply_anchors(K, L, w);
  invert(L, w);

  // Step 5: R = beta V + Wn S, Vn = T R.
  const Seg s_r{w.Xk, K, false, S, V, K, false};
  gemm(L, V, &s_r, 1, Init{w.sv, V, w.B}, w.R, V);

  // Step 1 of the next unit runs during the rest of the chunk (R has read this chunk's v and B; Q, Kh, G,
  // E are dead), spread over the full micro-tiles.
  Stager pf;
  if (next.t0 >= 0) plan_stage(a, st, next.h, next.t0, next.rows, scale, w, pf);

  const Seg s_vn{w.T, C, false, w.R, V, L, true};
  gemm(L, V, &s_vn, 1, Init{}, w.Vn, V, &pf);

  // Step 6: O = Qf S + Aqk Vn.
  const Seg s_o[2] = {{w.Xq, K, false, S, V, K, false}, {w.Aqk, C, false, w.Vn, V, L, true}};
  gemm(L, V, s_o, 2, Init{}, a.o + c0 * ldo + h * V, ldo, &pf);

  // Step 7: S <- diag(exp(Gamma_last)) S + Kr^T Vn (Kr read transposed: A(d, r) = Kr[r, d]).
  const Seg s_s{w.Kc, K, true, w.Vn, V, L, false};
  gemm(K, V, &s_s, 1, Init{S, V, w.last}, S, V, &pf);
  pf.finish();
}

// A sequence's chunk grid: the multiples of C from its start, its end, and its snapshot positions (a
// chunk ends at each, so that the state there is a chunk boundary's). `snap` is the sequence's first
// snapshot with a position beyond c0 (they come sorted by position).
int64_t chunk_end(int64_t bos, int64_t eos, int64_t c0, const KdaSnapshot* snap,
                  const KdaSnapshot* snap_end) {
  int64_t e = std::min(eos, bos + ((c0 - bos) / kChunk + 1) * kChunk);
  if (snap != snap_end && bos + snap->pos < e) e = bos + snap->pos;
  return e;
}

// The first of [s, e) with a position beyond `pos`.
const KdaSnapshot* snapshots_after(const KdaSnapshot* s, const KdaSnapshot* e, int64_t pos) {
  while (s != e && s->pos <= pos) ++s;
  return s;
}

// First chunk of work item `item` (sequence item / groups, heads of group item % groups), or none.
Next first_unit(const KdaArgs& a, const SnapshotPlan& plan, int64_t item, int64_t groups, int group) {
  Next n;
  if (item < 0) return n;
  const int64_t i = item / groups;
  const auto [bos, eos] = segment(a, i);
  const int64_t slot = a.state_indices != nullptr ? a.state_indices[i] : i;
  if (slot < 0 || eos <= bos) return n;
  n.t0 = bos;
  n.h = static_cast<int>(item % groups) * group;
  const KdaSnapshot* last = plan.last(i);
  n.rows = static_cast<int>(chunk_end(bos, eos, bos, snapshots_after(plan.first(i), last, 0), last) - bos);
  return n;
}

// Heads [h0, h1) of `states` into the slots of the snapshots [*s, e) at position `pos`; advances *s.
void take_snapshots(const KdaArgs& a, const KdaSnapshot*& s, const KdaSnapshot* e, int64_t pos, int h0,
                    int h1, float* const* states) {
  const size_t kv = static_cast<size_t>(a.K) * a.V;
  for (; s != e && s->pos == pos; ++s) {
    for (int h = h0; h < h1; ++h) std::memcpy(snapshot_head(a, *s, h), states[h - h0], kv * sizeof(float));
  }
}

// A thread's claim on the item it runs next. Items are handed out in order from one counter; a thread
// claims its next item when it starts the last chunk of its current one (it stages that item's first
// chunk meanwhile), not earlier, so that an item is never held by a busy thread while the other idles.
struct Claim {
  std::atomic<int64_t>* counter;
  int64_t items;
  int64_t next = 0;  // the claimed item, when `claimed` (>= items: none left)
  bool claimed = false;

  int64_t get() {
    if (!claimed) {
      next = counter->fetch_add(1, std::memory_order_relaxed);
      claimed = true;
    }
    return next < items ? next : -1;
  }
};

// One work item: sequence i, heads [h0, h1). The heads advance chunk by chunk together, so that each
// token row's pages and cache lines serve all of them while they are hot. The item this thread runs
// next is claimed at the last chunk of this one, whose first chunk is staged during it.
void process_item(const KdaArgs& a, const SnapshotPlan& plan, const Strides& st, int64_t i, int h0, int h1,
                  Claim& claim, int64_t groups, int group, float scale, Scratch& w) {
  const int K = a.K, V = a.V, H = a.H;
  const auto [bos, eos] = segment(a, i);
  const int64_t slot = a.state_indices != nullptr ? a.state_indices[i] : i;
  const int64_t ldo = static_cast<int64_t>(H) * V;
  if (slot < 0) {  // padded row: zero output, the pool is not touched
    for (int64_t t = bos; t < eos; ++t) std::memset(a.o + t * ldo + h0 * V, 0, (h1 - h0) * V * sizeof(float));
    return;
  }

  // Each head's state lives in its pool slot when the final state is kept there; otherwise in scratch.
  const size_t kv = static_cast<size_t>(K) * V;
  const bool has_init = a.state != nullptr && (a.has_initial_state == nullptr || a.has_initial_state[i] != 0);
  const bool in_place = a.state != nullptr && a.output_final_state;
  float* states[kMaxGroup];
  for (int h = h0; h < h1; ++h) {
    float* pool = a.state != nullptr ? a.state + (slot * H + h) * kv : nullptr;
    float* S = in_place ? pool : w.S + (h - h0) * kv;
    if (!has_init) {
      std::memset(S, 0, kv * sizeof(float));
    } else if (S != pool) {
      std::memcpy(S, pool, kv * sizeof(float));
    }
    states[h - h0] = S;
  }

  // Snapshots: at position 0 the initial states; the others at the ends of the chunks that end there.
  const KdaSnapshot *snap = plan.first(i), *const snap_end = plan.last(i);
  take_snapshots(a, snap, snap_end, 0, h0, h1, states);
  for (int64_t c0 = bos; c0 < eos;) {
    const int64_t c1 = chunk_end(bos, eos, c0, snap, snap_end);
    const int L = static_cast<int>(c1 - c0);
    for (int h = h0; h < h1; ++h) {
      Next next;
      if (h + 1 < h1) {
        next = {c0, h + 1, L};
      } else if (c1 < eos) {
        next = {c1, h0,
                static_cast<int>(
                    chunk_end(bos, eos, c1, snapshots_after(snap, snap_end, c1 - bos), snap_end) - c1)};
      } else {
        next = first_unit(a, plan, claim.get(), groups, group);
      }
      process_chunk(a, st, h, c0, L, states[h - h0], next, scale, w);
    }
    take_snapshots(a, snap, snap_end, c1 - bos, h0, h1, states);
    c0 = c1;
  }

  if (in_place) return;
  for (int h = h0; h < h1 && a.state != nullptr && a.output_final_state; ++h) {
    std::memcpy(a.state + (slot * H + h) * kv, states[h - h0], kv * sizeof(float));
  }
}

// Flush-to-zero and denormals-are-zero for the lifetime of the object, on the calling thread. The decays
// of strong gates underflow through the subnormal range (products of exp(g) of 1e-30 and less), where
// the core's multiplies and FMAs are slow (measured: the whole kernel ~4% faster with subnormals
// flushed, more on the heads with the strongest gates); a flushed value is below 1.2e-38, far under
// the fp32 tolerance of any output. The caller's MXCSR is restored.
class FlushDenormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

}  // namespace

void chunk_kda_opt(const KdaArgs& a) {
  const float scale = a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(a.K));
  const int64_t N = a.N;
  const int H = a.H;
  const int64_t hk = static_cast<int64_t>(H) * a.K, hv = static_cast<int64_t>(H) * a.V;
  const Strides st{a.q_stride > 0 ? a.q_stride : hk, a.k_stride > 0 ? a.k_stride : hk,
                   a.v_stride > 0 ? a.v_stride : hv, a.g_stride > 0 ? a.g_stride : hk};
  // Work items are (sequence, group of heads), handed out dynamically (varlen segments make them very
  // uneven; see Claim). Groups of up to kMaxGroup heads while that leaves several items per thread
  // (smaller groups balance better between threads that run at different speeds, but lose more to
  // staging: for one 4096-token sequence on 2 threads, groups of 4 measured ~15% faster than groups
  // of 2; so did items shrinking to single heads at the end of a call, by ~4%, though they were ~5%
  // faster when one of the threads ran at half speed).
  const int threads = omp_get_max_threads();
  int group = kMaxGroup;
  while (group > 1 && N * ((H + group - 1) / group) < 4 * threads) group /= 2;
  const int64_t groups = (H + group - 1) / group;
  const int64_t items = N * groups;
  const SnapshotPlan plan = plan_snapshots(a);  // allocated here, outside the parallel region
  std::atomic<int64_t> counter{0};
  // Each thread's scratch grows in the region (it is the thread's own, kept across calls) and may fail
  // to (std::bad_alloc): no exception may leave the region, so the first is carried out and rethrown
  // after it. A thread whose scratch failed claims no item; the others take them.
  std::exception_ptr error;
#pragma omp parallel
  {
    try {
      const FlushDenormals ftz;
      Scratch w(a.K, a.V, group);
      int64_t cur = counter.fetch_add(1, std::memory_order_relaxed);
      while (cur < items) {
        Claim claim{&counter, items};
        const int h0 = static_cast<int>(cur % groups) * group;
        process_item(a, plan, st, cur / groups, h0, std::min(H, h0 + group), claim, groups, group, scale, w);
        cur = claim.claimed ? claim.next : counter.fetch_add(1, std::memory_order_relaxed);
      }
    } catch (...) {
#pragma omp critical(kda_chunk_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace kda::kernels::KDA_ISA_NS
KDA_ISA_POP
