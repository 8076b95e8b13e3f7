// The quantized GEMM kernels, compiled once per ISA (kda/common/isa_target.h), on activations already
// quantized to int16 (quant_gemm.h: a scale per row for int8 weights, per group of 32 for int4).
// AVX-512: intrinsics, integer dot products on the packed weights (vpmaddwd / vpmaddubsw, or
// AVX512_VNNI's vpdpwssd / vpdpbusd in a region of their own, see below). Portable and AVX2: the same
// integer sums in plain loops (the compiler vectorises them for the ISA of the copy).
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kda/common/isa_target.h"
#include "kda/kernels/gemm/quant_gemm_isa.h"
#include "kda/kernels/kda/avx512.h"  // <immintrin.h>, its GCC 12 false warnings silenced

KDA_ISA_PUSH
namespace kda::kernels::gemm::KDA_ISA_NS {
namespace {

// Below this many weights a call runs on one thread (the fork costs more than the work).
constexpr int64_t kParallelMin = int64_t{1} << 15;

#if defined(KDA_ISA_AVX512)

// Output channels per block: the weights of a block stay in L1 while every row of x passes over them,
// so each packed byte comes from memory once per call; each x vector loaded feeds kNB channels.
constexpr int64_t kNB = 4;
// From memory (a model's weights do not fit in the caches between steps). A block's channels are
// adjacent rows, one contiguous run of bytes; while a block runs, the next one's bytes are prefetched
// in address order, spread evenly over the block's steps, so that they are in the caches when it
// starts (a prefetch a fixed distance ahead within each channel's row lands, for rows of a few cache
// lines, mostly on lines that the block itself or the hardware prefetchers already fetch).

// The integer dot products, as AVX-512BW sequences; DotVnni below has the same sums in vpdpbusd /
// vpdpwssd.
//  dot_s16:  acc + per int32 lane the 2 products a[2l..2l+1] * b[2l..2l+1] (s16).
//  dot_int4: per int32 lane l, ncorr[l] + sum over its 4 bytes of lo * x_lo + hi * x_hi, where the
//            nibbles lo, hi (0..15) meet the int16 activations split into a signed high byte and an
//            unsigned low one (x = 256 h + l): 256 (lo h_lo + hi h_hi) + (l_lo lo + l_hi hi). The int16
//            intermediates of vpmaddubsw cannot saturate here (at most 2 * 2 * 255 * 15).
struct DotBw {
  static inline __m512i dot_s16(__m512i acc, __m512i a, __m512i b) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
  }
  static inline __m512i dot_int4(__m512i ncorr, __m512i lo, __m512i hi, __m512i h_lo, __m512i h_hi,
                                 __m512i l_lo, __m512i l_hi) {
    const __m512i h = _mm512_add_epi16(_mm512_maddubs_epi16(lo, h_lo), _mm512_maddubs_epi16(hi, h_hi));
    const __m512i l = _mm512_add_epi16(_mm512_maddubs_epi16(l_lo, lo), _mm512_maddubs_epi16(l_hi, hi));
    return _mm512_add_epi32(_mm512_add_epi32(ncorr, _mm512_madd_epi16(h, _mm512_set1_epi16(256))),
                            _mm512_madd_epi16(l, _mm512_set1_epi16(1)));
  }
};

// One step of int8_block: inputs [k, k + 32) of rows [m0, m0 + MB) x channels [n0, n0 + NB). kTail: the
// last, partial step, its loads masked to mk (the full steps' plain loads keep GCC's store motion: with a
// masked load in the loop it kept every accumulator's copy on the stack too, a store per product).
template <int MB, int NB, class Dot, bool kTail>
inline void int8_step(const int16_t* xq, int64_t in, const Int8Weights& w, int64_t m0, int64_t n0, int64_t k,
                      __mmask32 mk, __m512i (&acc)[MB][NB]) {
  // NB lines of the next block per 64 inputs, into L2: into L1 they evicted the block's own lines and the
  // rows of x before the rows were done with them (at the model's widths the two blocks and the x of a few
  // rows pass a 32 KB L1, Zen 4's), which slowed every row count this kernel takes (docs/performance.md,
  // "int8 decode rows: the next block into L2").
  if (!kTail && (k & 63) == 0 && n0 + 2 * NB <= w.out)
    for (int j = 0; j < NB; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(w.q + (n0 + NB) * in) + NB * k + 64 * j, _MM_HINT_T1);
  __m512i wv[NB];
  for (int j = 0; j < NB; ++j) {
    const int8_t* q = w.q + (n0 + j) * in + k;
    wv[j] = _mm512_cvtepi8_epi16(kTail ? _mm256_maskz_loadu_epi8(mk, q)
                                       : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  }
  for (int i = 0; i < MB; ++i) {
    const int16_t* x = xq + (m0 + i) * in + k;
    const __m512i xv = kTail ? _mm512_maskz_loadu_epi16(mk, x) : _mm512_loadu_si512(x);
    for (int j = 0; j < NB; ++j) acc[i][j] = Dot::dot_s16(acc[i][j], wv[j], xv);
  }
}

// The exact total of an accumulator's 16 int32 lanes (int64: their sum may pass int32).
inline int64_t lane_total(__m512i a) {
  return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(a)),
                                                  _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a, 1))));
}

// int8 weights, int16 activations. Rows [m0, m0 + MB) x channels [n0, n0 + NB): MB * NB int32
// accumulators of 16 lanes; 32 inputs per step (one 32-byte load per channel, widened to int16).
// activation_qmax() keeps every lane's sum inside int32.
template <int MB, int NB, class Dot>
inline void int8_block(const int16_t* xq, const float* sx, int64_t in, const Int8Weights& w, int64_t m0,
                       int64_t n0, float* y, int64_t ldy) {
  __m512i acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
  const int64_t full = in / 32 * 32;
  for (int64_t k = 0; k < full; k += 32) int8_step<MB, NB, Dot, false>(xq, in, w, m0, n0, k, 0, acc);
  if (full < in)
    int8_step<MB, NB, Dot, true>(xq, in, w, m0, n0, full, __mmask32((uint32_t{1} << (in - full)) - 1), acc);
  // The lanes' exact total (int64: 16 lanes of int32 may pass it), converted once: the portable and the
  // AMX kernels' value bit for bit, so that a row's output does not depend on which kernel its call took.
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      y[(m0 + i) * ldy + n0 + j] = static_cast<float>(lane_total(acc[i][j])) * w.scale[n0 + j] * sx[m0 + i];
}

// int8 weights, one or two rows of x (MB): one output channel at a time, its row of weights read
// straight through (two accumulators per row of x, alternate 32-input steps), with a prefetch into L2
// kStreamAhead bytes on in address order. Each thread then reads one run of memory, where int8_block's kNB
// rows at a time make kNB runs a row apart, which held the hardware prefetchers well below the read
// bandwidth at the model's widths (docs/performance.md, "int8 decode, one channel at a time"). Above
// two rows of x the block's reuse of each x vector over kNB channels pays more than this gains. The
// prefetch runs far enough ahead to cover the reads in flight when the host's memory is fast, and into L2
// (a prefetch into L1 that far ahead read slower than none: "The read ceiling on huge pages").
constexpr int64_t kStreamRows = 2, kStreamAhead = 6144;
template <int MB, class Dot>
inline void int8_stream(const int16_t* xq, const float* sx, int64_t in, const Int8Weights& w, int64_t n,
                        float* y, int64_t ldy) {
  __m512i acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
  const int8_t* r = w.q + n * in;
  const int8_t* end = w.q + w.out * in;
  const auto step = [&](int64_t k, int h, bool tail, __mmask32 mk) {
    const __m512i wv =
        _mm512_cvtepi8_epi16(tail ? _mm256_maskz_loadu_epi8(mk, r + k)
                                  : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + k)));
    for (int i = 0; i < MB; ++i) {
      const int16_t* x = xq + i * in + k;
      acc[i][h] = Dot::dot_s16(acc[i][h], wv, tail ? _mm512_maskz_loadu_epi16(mk, x) : _mm512_loadu_si512(x));
    }
  };
  int64_t k = 0;
  for (; k + 64 <= in; k += 64) {
    if (r + k + kStreamAhead < end)
      _mm_prefetch(reinterpret_cast<const char*>(r + k + kStreamAhead), _MM_HINT_T1);
    step(k, 0, false, 0);
    step(k + 32, 1, false, 0);
  }
  if (k + 32 <= in) {
    step(k, 0, false, 0);
    k += 32;
  }
  if (k < in) step(k, 1, true, __mmask32((uint32_t{1} << (in - k)) - 1));
  for (int i = 0; i < MB; ++i)
    y[i * ldy + n] = static_cast<float>(lane_total(acc[i][0]) + lane_total(acc[i][1])) * w.scale[n] * sx[i];
}

// int4: x rearranged once per call to the packing of the weights. A chunk is 4 groups (64 packed bytes
// of a channel); the low nibbles of its bytes are inputs 0..15 of each group, the high ones 16..31.
// h_* / l_* hold the high (signed) and low (unsigned) bytes of the matching activations, ncorr is -8
// times the sum of the activations that meet each int32 lane (started from it, a lane sums
// (nibble - 8) * x without the nibbles ever being re-centred), and sx the activations' group scales
// spread as the weights' are.
struct alignas(64) XChunk {
  int8_t h_lo[64], h_hi[64];
  uint8_t l_lo[64], l_hi[64];
  int32_t ncorr[16];
  float sx[16];
};

void pack_x_int4(const int16_t* xq, const float* sx, int64_t M, int64_t in, std::vector<XChunk>& xp) {
  const int64_t G = in / kInt4Group, C = (G + 3) / 4;
  xp.assign(static_cast<size_t>(M * C), XChunk{});
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      XChunk& c = xp[m * C + g / 4];
      const int16_t* xr = xq + m * in + g * kInt4Group;
      const int b0 = static_cast<int>(g % 4) * 16;
      for (int j = 0; j < 16; ++j) {
        c.h_lo[b0 + j] = static_cast<int8_t>(xr[j] >> 8);
        c.h_hi[b0 + j] = static_cast<int8_t>(xr[j + 16] >> 8);
        c.l_lo[b0 + j] = static_cast<uint8_t>(xr[j] & 0xFF);
        c.l_hi[b0 + j] = static_cast<uint8_t>(xr[j + 16] & 0xFF);
      }
      for (int l = 0; l < 4; ++l) {
        int32_t s = 0;
        for (int j = 4 * l; j < 4 * l + 4; ++j) s += xr[j] + xr[j + 16];
        c.ncorr[b0 / 4 + l] = -8 * s;
        c.sx[b0 / 4 + l] = sx[m * G + g];
      }
    }
}

// One chunk c of int4_block (ng of its 4 groups in the weights). kTail: the last chunk, partial, its
// loads masked (as int8_step's, masked loads only outside the loop).
template <int MB, int NB, class Dot, bool kTail>
inline void int4_chunk(const XChunk* xp, int64_t C, const Int4Weights& w, int64_t m0, int64_t n0, int64_t c,
                       int64_t ng, int64_t ahead, __m512 (&acc)[MB][NB]) {
  const int64_t G = w.in / kInt4Group, row_bytes = w.in / 2;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __mmask64 mb = kTail ? (__mmask64(1) << (16 * ng)) - 1 : ~__mmask64(0);
  const __mmask8 ms = static_cast<__mmask8>((1u << ng) - 1);
  for (int j = 0; j < NB; ++j) {
    const uint8_t* wp = w.q + (n0 + j) * row_bytes + 64 * c;
    const float* sp = w.scale + (n0 + j) * G + 4 * c;
    // Per chunk NB lines of the block `ahead` blocks on, per 4 its scales, into L2: the next block's
    // alone, into L1, left the reads in flight short of what the host's memory gives in its fast minutes
    // (docs/performance.md, "The read ceiling on huge pages").
    if (!kTail && n0 + (ahead + 1) * NB <= w.out) {
      const int64_t na = n0 + ahead * NB;
      _mm_prefetch(reinterpret_cast<const char*>(w.q + na * row_bytes) + 64 * (NB * c + j), _MM_HINT_T1);
      if ((c & 3) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w.scale + na * G) + 64 * (NB * (c / 4) + j), _MM_HINT_T1);
    }
    const __m512i b = kTail ? _mm512_maskz_loadu_epi8(mb, wp) : _mm512_loadu_si512(wp);
    const __m512i lo = _mm512_and_si512(b, nib), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nib);
    const __m512 s = _mm512_permutexvar_ps(
        spread, _mm512_castps128_ps512(kTail ? _mm_maskz_loadu_ps(ms, sp) : _mm_loadu_ps(sp)));
    for (int i = 0; i < MB; ++i) {
      const XChunk& x = xp[(m0 + i) * C + c];
      const __m512i d =
          Dot::dot_int4(_mm512_load_si512(x.ncorr), lo, hi, _mm512_load_si512(x.h_lo),
                        _mm512_load_si512(x.h_hi), _mm512_load_si512(x.l_lo), _mm512_load_si512(x.l_hi));
      acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, _mm512_load_ps(x.sx)), acc[i][j]);
    }
  }
}

constexpr int64_t kInt4AheadBytes = 8192;

// Rows [m0, m0 + MB) x channels [n0, n0 + NB) of an int4 GEMM. Per chunk and channel: one 64-byte load
// split into low and high nibbles, and the 4 group scales spread over the lanes of their groups; per
// row one int32 dot product (lanes 4g'..4g'+3 belong to group g' of the chunk), converted once and
// scaled (weight scale times activation scale) in one FMA into fp32 accumulators. A chunk past the
// last group reads zeros (masked loads).
template <int MB, int NB, class Dot>
inline void int4_block(const XChunk* xp, int64_t C, const Int4Weights& w, int64_t m0, int64_t n0, float* y,
                       int64_t ldy) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t G = w.in / kInt4Group, full = G / 4;
  // The prefetches run kInt4AheadBytes on at least, two blocks at the least: blocks of short rows (an
  // expert's down projection, 512 bytes a channel) read slower prefetched two blocks on (docs/performance.md,
  // "The int4 one-row kernel's prefetch distance").
  const int64_t block_bytes = NB * (w.in / 2),
                ahead = std::max<int64_t>(2, (kInt4AheadBytes + block_bytes - 1) / block_bytes);
  for (int64_t c = 0; c < full; ++c) int4_chunk<MB, NB, Dot, false>(xp, C, w, m0, n0, c, 4, ahead, acc);
  if (full < C) int4_chunk<MB, NB, Dot, true>(xp, C, w, m0, n0, full, G - 4 * full, ahead, acc);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[(m0 + i) * ldy + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

struct Int8Call {
  const int16_t* xq;
  const float* sx;
  const Int8Weights* w;
  float* y;
  int64_t M, ldy;
};
struct Int4Call {
  const XChunk* xp;
  int64_t C;
  const Int4Weights* w;
  float* y;
  int64_t M, ldy;
};

// Every row of x against channels [n0, n0 + NB), four rows at a time.
#define KDA_QUANT_ROWS(block, ...)                             \
  int64_t m = 0;                                               \
  for (; m + 4 <= a.M; m += 4) block<4, NB, Dot>(__VA_ARGS__); \
  switch (a.M - m) {                                           \
    case 3:                                                    \
      block<3, NB, Dot>(__VA_ARGS__);                          \
      break;                                                   \
    case 2:                                                    \
      block<2, NB, Dot>(__VA_ARGS__);                          \
      break;                                                   \
    case 1:                                                    \
      block<1, NB, Dot>(__VA_ARGS__);                          \
      break;                                                   \
    default:                                                   \
      break;                                                   \
  }

template <int NB, class Dot>
inline void int8_channels(const Int8Call& a, int64_t n0) {
  KDA_QUANT_ROWS(int8_block, a.xq, a.sx, a.w->in, *a.w, m, n0, a.y, a.ldy)
}
template <int NB, class Dot>
inline void int4_channels(const Int4Call& a, int64_t n0) {
  KDA_QUANT_ROWS(int4_block, a.xp, a.C, *a.w, m, n0, a.y, a.ldy)
}
#undef KDA_QUANT_ROWS

// Channels [nb0 * kNB, nb1 * kNB), and with `tail` the last (out % kNB) ones one at a time. One
// flattened function per instruction choice: everything it calls is inlined into it, so the VNNI copy
// below (its own target region, GCC would not inline a VNNI intrinsic into a function compiled without
// VNNI) runs the same templates with its dot products in one instruction each.
#define KDA_QUANT_RANGES(Dot, suffix)                                                             \
  __attribute__((flatten)) void int8_range_##suffix(const Int8Call& a, int64_t nb0, int64_t nb1,  \
                                                    bool tail) {                                  \
    for (int64_t nb = nb0; nb < nb1; ++nb) int8_channels<kNB, Dot>(a, nb * kNB);                  \
    if (tail)                                                                                     \
      for (int64_t n = nb1 * kNB; n < a.w->out; ++n) int8_channels<1, Dot>(a, n);                 \
  }                                                                                               \
  __attribute__((flatten)) void int8_stream_##suffix(const Int8Call& a, int64_t n0, int64_t n1) { \
    for (int64_t n = n0; n < n1; ++n)                                                             \
      if (a.M == 2)                                                                               \
        int8_stream<2, Dot>(a.xq, a.sx, a.w->in, *a.w, n, a.y, a.ldy);                            \
      else                                                                                        \
        int8_stream<1, Dot>(a.xq, a.sx, a.w->in, *a.w, n, a.y, a.ldy);                            \
  }                                                                                               \
  __attribute__((flatten)) void int4_range_##suffix(const Int4Call& a, int64_t nb0, int64_t nb1,  \
                                                    bool tail) {                                  \
    for (int64_t nb = nb0; nb < nb1; ++nb) int4_channels<kNB, Dot>(a, nb * kNB);                  \
    if (tail)                                                                                     \
      for (int64_t n = nb1 * kNB; n < a.w->out; ++n) int4_channels<1, Dot>(a, n);                 \
  }

KDA_QUANT_RANGES(DotBw, bw)

#pragma GCC push_options
#pragma GCC target("avx512vnni")
// vpdpbusd / vpdpwssd in inline asm, the accumulator updated in place: GCC 12 compiles their intrinsics
// with a register copy of the accumulator before each one (they overwrite it), and those copies held a
// block of products well below the instruction's rate (docs/performance.md, "Batch 16").
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}
inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
struct DotVnni {
  static inline __m512i dot_int4(__m512i ncorr, __m512i lo, __m512i hi, __m512i h_lo, __m512i h_hi,
                                 __m512i l_lo, __m512i l_hi) {
    const __m512i h = dpbusd(dpbusd(_mm512_setzero_si512(), lo, h_lo), hi, h_hi);
    const __m512i l = dpbusd(dpbusd(ncorr, l_lo, lo), l_hi, hi);
    return _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
  }
  static inline __m512i dot_s16(__m512i acc, __m512i a, __m512i b) { return dpwssd(acc, a, b); }
};
KDA_QUANT_RANGES(DotVnni, vnni)
#pragma GCC pop_options

#undef KDA_QUANT_RANGES

// Units [0, units) split evenly over the threads (static), f(u0, u1, last) once per thread; one thread
// below kParallelMin weights (the fork costs more than the work).
template <class F>
void split_units(int64_t weights, int64_t units, F f) {
  if (weights < kParallelMin) {
    f(0, units, true);
    return;
  }
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    f(units * t / nt, units * (t + 1) / nt, t == nt - 1);
  }
}

#else  // portable, AVX2

// Channel n of the int8 weights against one quantized row: an exact integer sum (int64: the lanes of the
// AVX-512 copy are bounded, this one sum over all inputs is not).
float int8_dot(const Int8Weights& w, int64_t n, const int16_t* xr, const float* sx) {
  const int8_t* q = w.q + n * w.in;
  int64_t acc = 0;
  for (int64_t k0 = 0; k0 < w.in; k0 += 32) {
    const int64_t k1 = std::min(w.in, k0 + 32);
    int32_t s = 0;  // 32 products of at most 127 * 32767 each
#pragma omp simd reduction(+ : s)
    for (int64_t k = k0; k < k1; ++k) s += static_cast<int32_t>(q[k]) * xr[k];
    acc += s;
  }
  return static_cast<float>(acc) * w.scale[n] * *sx;
}

// Channel n of the int4 weights: per group an exact integer sum of (nibble - 8) * x, converted and
// scaled once (weight scale times the activations' group scale sx[g]), accumulated in fp32.
float int4_dot(const Int4Weights& w, int64_t n, const int16_t* xr, const float* sx) {
  const int64_t G = w.in / kInt4Group;
  const uint8_t* q = w.q + n * (w.in / 2);
  float acc = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = q + g * 16;
    const int16_t* x = xr + g * kInt4Group;
    int32_t s = 0;
#pragma omp simd reduction(+ : s)
    for (int j = 0; j < 16; ++j) s += ((b[j] & 0xF) - 8) * x[j] + ((b[j] >> 4) - 8) * x[j + 16];
    acc += static_cast<float>(s) * (w.scale[n * G + g] * sx[g]);
  }
  return acc;
}

// sx_row: the activation scales per row (1 for int8 weights, in / 32 for int4 ones).
template <class W, class Dot>
void gemm_rows(const int16_t* xq, const float* sx, int64_t sx_row, int64_t M, const W& w, float* y,
               int64_t ldy, Dot dot) {
#pragma omp parallel for schedule(static) if (w.in * w.out >= kParallelMin)
  for (int64_t n = 0; n < w.out; ++n)
    for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = dot(w, n, xq + m * w.in, sx + m * sx_row);
}

#endif

}  // namespace

#if defined(KDA_ISA_AVX512)
void gemm_int8(const int16_t* xq, const float* sx, int64_t M, const Int8Weights& w, float* y, int64_t ldy,
               bool vnni) {
  const Int8Call a{xq, sx, &w, y, M, ldy};
  if (M <= kStreamRows) {  // channel by channel
    const auto stream = vnni ? int8_stream_vnni : int8_stream_bw;
    split_units(w.in * w.out, w.out, [&](int64_t n0, int64_t n1, bool) { stream(a, n0, n1); });
  } else {  // blocks of kNB channels, the last thread also the channels past the last whole block
    const auto range = vnni ? int8_range_vnni : int8_range_bw;
    split_units(w.in * w.out, w.out / kNB,
                [&](int64_t b0, int64_t b1, bool last) { range(a, b0, b1, last); });
  }
}
void gemm_int4(const int16_t* xq, const float* sx, int64_t M, const Int4Weights& w, float* y, int64_t ldy,
               bool vnni) {
  // The packed activations: per-thread scratch, grown once (as the entry points' quantized x,
  // weight_format.cc).
  thread_local std::vector<XChunk> xp;
  const int64_t C = (w.in / kInt4Group + 3) / 4;
  pack_x_int4(xq, sx, M, w.in, xp);
  const Int4Call a{xp.data(), C, &w, y, M, ldy};
  const auto range = vnni ? int4_range_vnni : int4_range_bw;
  split_units(w.in * w.out, w.out / kNB, [&](int64_t b0, int64_t b1, bool last) { range(a, b0, b1, last); });
}
#else
void gemm_int8(const int16_t* xq, const float* sx, int64_t M, const Int8Weights& w, float* y, int64_t ldy,
               bool) {
  gemm_rows(xq, sx, 1, M, w, y, ldy, int8_dot);
}
void gemm_int4(const int16_t* xq, const float* sx, int64_t M, const Int4Weights& w, float* y, int64_t ldy,
               bool) {
  gemm_rows(xq, sx, w.in / kInt4Group, M, w, y, ldy, int4_dot);
}
#endif

}  // namespace kda::kernels::gemm::KDA_ISA_NS
KDA_ISA_POP
