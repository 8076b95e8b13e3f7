#include "kda/kernels/gemm/quant_dpbf16.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kda/common/aligned_scratch.h"
#include "kda/common/isa.h"
#include "kda/kernels/gemm/dpbf16_lane.h"

#if defined(KDA_WITH_AVX512) && defined(__GNUC__) && defined(__x86_64__)
#define KDA_QUANT_DPBF16_BUILD 1
#include "kda/kernels/kda/avx512.h"  // <immintrin.h>, its GCC 12 false warnings silenced
#endif

namespace kda::kernels::gemm {

namespace {

template <class W>
void check_args(const char* what, const bf16_t* x, int64_t M, int64_t ldx, const W& w, const float* y,
                int64_t ldy) {
  const std::string f(what);
  if (w.in < 32 || w.in % 32 != 0 || w.out < 1 || M < 0)
    throw std::invalid_argument(f + ": bad sizes M " + std::to_string(M) + ", in " + std::to_string(w.in) +
                                " (a positive multiple of 32), out " + std::to_string(w.out));
  if (ldx < w.in || ldy < w.out) throw std::invalid_argument(f + ": a row stride below its row's size");
  if (M > 0 && (x == nullptr || y == nullptr || w.q == nullptr || w.scale == nullptr))
    throw std::invalid_argument(f + ": null data");
}

// Input k (0..31) of a group's 16 packed bytes (quant_gemm.h): byte k's low nibble, or byte k - 16's high
// one.
inline int nibble(const uint8_t* group, int k) { return k < 16 ? group[k] & 0xF : group[k - 16] >> 4; }

}  // namespace

void check_int4_dpbf16_args(const char* what, const bf16_t* x, int64_t M, int64_t ldx, const Int4Weights& w,
                            const float* y, int64_t ldy) {
  check_args(what, x, M, ldx, w, y, ldy);
}

void check_int8_dpbf16_args(const char* what, const bf16_t* x, int64_t M, int64_t ldx, const Int8Weights& w,
                            const float* y, int64_t ldy) {
  check_args(what, x, M, ldx, w, y, ldy);
}

void gemm_int8_dpbf16_reference(const bf16_t* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y,
                                int64_t ldy) {
  check_args("gemm_int8_dpbf16_reference", x, M, ldx, w, y, ldy);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < w.out; ++n) {
      const int8_t* q = w.q + n * w.in;
      const bf16_t* xr = x + m * ldx;
      float s = 0.0f;
      for (int64_t k = 0; k < w.in; k += 2)
        s = dpbf16_pair(s, static_cast<float>(q[k]), static_cast<float>(q[k + 1]), bf16_to_f32(xr[k]),
                        bf16_to_f32(xr[k + 1]));
      y[m * ldy + n] = s * w.scale[n];
    }
}

void gemm_int4_dpbf16_reference(const bf16_t* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y,
                                int64_t ldy) {
  check_args("gemm_int4_dpbf16_reference", x, M, ldx, w, y, ldy);
  const int64_t G = w.in / kInt4Group;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < w.out; ++n) {
      float total = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* b = w.q + n * (w.in / 2) + g * 16;
        const bf16_t* xg = x + m * ldx + g * kInt4Group;
        float s = 0.0f;
        for (int p = 0; p < 16; ++p)
          s = dpbf16_pair(s, static_cast<float>(nibble(b, 2 * p) - 8),
                          static_cast<float>(nibble(b, 2 * p + 1) - 8), bf16_to_f32(xg[2 * p]),
                          bf16_to_f32(xg[2 * p + 1]));
        total = std::fma(s, w.scale[n * G + g], total);
      }
      y[m * ldy + n] = total;
    }
}

#if defined(KDA_QUANT_DPBF16_BUILD)

bool cpu_has_quant_dpbf16() { return cpu_has_bf16_gemm(); }

namespace {

constexpr int64_t kBlockN = 32;     // output channels per panel: two vectors of 16
constexpr int kMB = 6;              // rows per group: 6 x 2 group sums + 6 x 2 totals, 2 weights, 2 scales
constexpr int64_t kRowChunk = 192;  // rows per pass over the panels (their x stays in L2 / L3)
// Below this many multiply-adds a call runs on one thread (the fork costs more than the work).
constexpr int64_t kParallelMin = int64_t{1} << 20;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma")

// A 16 x 16 matrix of 32-bit values transposed in registers: r[i] lane j <- r[j] lane i.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// The bf16 bits of the 16 int4 values (nibble - 8), twice over: a word permute reads a word's low 5 bits.
inline __m512i int4_table() {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) table[i] = f32_to_bf16(static_cast<float>((i & 15) - 8));
  return _mm512_load_si512(table);
}

// Channels [n0, n0 + 32) of W as the panel the rows read: pw [in / 2 pairs][32 channels][2] bf16 (the
// scheme's integers; pair p of channel c at (p * 32 + c) * 2), ps the scales (int4: [groups][32]; int8:
// [32]); channels past out are zero. Per 32 inputs and 16 channels:
//  - int4: the 16 channels' 16 bytes transposed as dwords (dword j of every channel in one vector: its
//    bytes 4j..4j+3 hold the low nibbles of pairs 2j, 2j+1 and the high nibbles of pairs 2j+8, 2j+9), then
//    word permutes on a table of the 16 values' bf16 bits (indexed by a word's low 5 bits: the table
//    repeats) and blends give the pairs of every channel. This is the cheap form of the widening: a call
//    of a few rows spends most of its time on it.
//  - int8: each channel's 32 bytes widened to fp32 and converted, exactly, then the 16 x 16 pairs
//    transposed so that a vector holds one pair of every channel.
// Pair p of channel c lands in lane c of vector p in both.
inline void int4_pairs(const Int4Weights& w, int64_t n0, int64_t g, __m512i table, __m512i pr[16]) {
  alignas(16) static const uint8_t kZero[16] = {0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88,
                                                0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88};  // value 0
  auto group = [&](int c) {
    const int64_t n = n0 + c;
    const uint8_t* b = n < w.out ? w.q + n * (w.in / 2) + g * 16 : kZero;
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  };
  __m512i r[4];
  for (int i = 0; i < 4; ++i) {  // r[i]'s 128-bit lane L: channel 4 L + i
    r[i] = _mm512_castsi128_si512(group(i));
    r[i] = _mm512_inserti32x4(r[i], group(4 + i), 1);
    r[i] = _mm512_inserti32x4(r[i], group(8 + i), 2);
    r[i] = _mm512_inserti32x4(r[i], group(12 + i), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
  const __m512i z[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                        _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};  // lane c: channel c
  // A word's permute reads its low byte's nibble: z gives the nibbles of bytes 0 and 2 of each dword,
  // z >> 8 those of bytes 1 and 3; blends put each pair's two in its dword.
  for (int j = 0; j < 4; ++j)
    for (int half = 0; half < 2; ++half) {  // low nibbles (pairs 2j, 2j + 1), then high (2j + 8, 2j + 9)
      const __m512i v = half == 0 ? z[j] : _mm512_srli_epi32(z[j], 4);
      const __m512i a = _mm512_permutexvar_epi16(v, table);                        // bytes 0, 2
      const __m512i b = _mm512_permutexvar_epi16(_mm512_srli_epi32(v, 8), table);  // bytes 1, 3
      pr[2 * j + 8 * half] = _mm512_mask_blend_epi16(0xAAAAAAAA, a, _mm512_slli_epi32(b, 16));
      pr[2 * j + 8 * half + 1] = _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(a, 16), b);
    }
}
// The scales of channels [n0, n0 + 16) by group: ps[g * stride + c] (channels past out: 0), the [16][G]
// block moved in 16 x 16 transposes (a scalar gather here held short calls back).
inline void int4_scales(const Int4Weights& w, int64_t n0, float* ps, int64_t stride) {
  const int64_t G = w.in / 32;
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const int64_t ng = std::min<int64_t>(16, G - g0);
    const __mmask16 k = ng == 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << ng) - 1);
    __m512i r[16];
    for (int c = 0; c < 16; ++c) {
      const int64_t n = n0 + c;
      r[c] = n < w.out ? _mm512_maskz_loadu_epi32(k, w.scale + n * G + g0) : _mm512_setzero_si512();
    }
    transpose16(r);
    for (int64_t j = 0; j < ng; ++j) _mm512_store_si512(ps + (g0 + j) * stride, r[j]);
  }
}
inline __m512i int8_values(const Int8Weights& w, int64_t n, int64_t g) {
  const __m512i q =
      _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + n * w.in + g * 32)));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q, 1)));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // inputs 0..31 in order
}

template <class W>
void build_panel(const W& w, int64_t n0, bf16_t* pw, float* ps) {
  constexpr bool int4 = std::is_same_v<W, Int4Weights>;
  const int64_t G = w.in / 32;
  const __m512i values = int4_table();
  for (int h = 0; h < 2; ++h)
    for (int64_t g = 0; g < G; ++g) {
      __m512i r[16];
      if constexpr (int4) {
        int4_pairs(w, n0 + 16 * h, g, values, r);
      } else {
        for (int c = 0; c < 16; ++c) {
          const int64_t n = n0 + 16 * h + c;
          r[c] = n < w.out ? int8_values(w, n, g) : _mm512_setzero_si512();
        }
        transpose16(r);
      }
      for (int p = 0; p < 16; ++p) _mm512_store_si512(pw + ((g * 16 + p) * kBlockN + 16 * h) * 2, r[p]);
    }
  if constexpr (int4) {
    for (int h = 0; h < 2; ++h) int4_scales(w, n0 + 16 * h, ps + 16 * h, kBlockN);
  } else {
    for (int64_t c = 0; c < kBlockN; ++c) ps[c] = n0 + c < w.out ? w.scale[n0 + c] : 0.0f;
  }
}

inline __m512 pair_of(const bf16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return _mm512_castsi512_ps(_mm512_set1_epi32(v));
}

// The 16 pairs of group g (inputs 32 g .. 32 g + 31) of rows [m0, m0 + MB) into acc.
template <int MB>
inline void group_pairs(const bf16_t* xr, int64_t ldx, const bf16_t* pw, int64_t g, __m512 acc[MB][2]) {
  const bf16_t* pg = pw + g * 16 * kBlockN * 2;
  const bf16_t* xg = xr + g * 32;
  for (int p = 0; p < 16; ++p) {
    const __m512bh w0 =
        reinterpret_cast<__m512bh>(_mm512_load_ps(reinterpret_cast<const float*>(pg + p * 64)));
    const __m512bh w1 =
        reinterpret_cast<__m512bh>(_mm512_load_ps(reinterpret_cast<const float*>(pg + p * 64 + 32)));
    for (int i = 0; i < MB; ++i) {
      const __m512bh b = reinterpret_cast<__m512bh>(pair_of(xg + i * ldx + 2 * p));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, b);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, b);
    }
  }
}

// Rows [m0, m0 + MB) against the panel's 32 channels (y columns [n0, n0 + 32), cut at out).
template <bool kInt4, int MB>
inline void rows(const bf16_t* x, int64_t ldx, int64_t m0, const bf16_t* pw, const float* ps, int64_t G,
                 float* y, int64_t ldy, int64_t n0, int64_t out) {
  __m512 tot[MB][2];
  for (int i = 0; i < MB; ++i) tot[i][0] = tot[i][1] = _mm512_setzero_ps();
  const bf16_t* xr = x + m0 * ldx;
  if constexpr (kInt4) {
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[MB][2];
      for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
      group_pairs<MB>(xr, ldx, pw, g, acc);
      const __m512 s0 = _mm512_load_ps(ps + g * kBlockN), s1 = _mm512_load_ps(ps + g * kBlockN + 16);
      for (int i = 0; i < MB; ++i) {
        tot[i][0] = _mm512_fmadd_ps(acc[i][0], s0, tot[i][0]);
        tot[i][1] = _mm512_fmadd_ps(acc[i][1], s1, tot[i][1]);
      }
    }
  } else {
    for (int64_t g = 0; g < G; ++g) group_pairs<MB>(xr, ldx, pw, g, tot);
    const __m512 s0 = _mm512_load_ps(ps), s1 = _mm512_load_ps(ps + 16);
    for (int i = 0; i < MB; ++i) {
      tot[i][0] = _mm512_mul_ps(tot[i][0], s0);
      tot[i][1] = _mm512_mul_ps(tot[i][1], s1);
    }
  }
  for (int j = 0; j < 2; ++j) {
    const int64_t left = out - (n0 + 16 * j);
    if (left <= 0) break;
    const __mmask16 k = left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    for (int i = 0; i < MB; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * ldy + n0 + 16 * j, k, tot[i][j]);
  }
}

// rows<kInt4, mb> for the mb < kMB rows left after the full groups (none where mb is 0).
template <bool kInt4, int MB = kMB - 1>
inline void tail_rows(int mb, const bf16_t* x, int64_t ldx, int64_t m0, const bf16_t* pw, const float* ps,
                      int64_t G, float* y, int64_t ldy, int64_t n0, int64_t out) {
  if constexpr (MB > 0) {
    if (mb == MB) return rows<kInt4, MB>(x, ldx, m0, pw, ps, G, y, ldy, n0, out);
    tail_rows<kInt4, MB - 1>(mb, x, ldx, m0, pw, ps, G, y, ldy, n0, out);
  }
}

// Blocks [b0, b1) of 32 channels against rows [r0, r1): each block's panel built once, then every group of
// rows.
template <class W>
void blocks(const bf16_t* x, int64_t r0, int64_t r1, int64_t ldx, const W& w, float* y, int64_t ldy,
            int64_t b0, int64_t b1, bf16_t* pw, float* ps) {
  constexpr bool int4 = std::is_same_v<W, Int4Weights>;
  const int64_t G = w.in / 32;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * kBlockN;
    build_panel(w, n0, pw, ps);
    int64_t m = r0;
    for (; m + kMB <= r1; m += kMB) rows<int4, kMB>(x, ldx, m, pw, ps, G, y, ldy, n0, w.out);
    tail_rows<int4>(static_cast<int>(r1 - m), x, ldx, m, pw, ps, G, y, ldy, n0, w.out);
  }
}
__attribute__((flatten)) void blocks_int8(const bf16_t* x, int64_t r0, int64_t r1, int64_t ldx,
                                          const Int8Weights& w, float* y, int64_t ldy, int64_t b0, int64_t b1,
                                          bf16_t* pw, float* ps) {
  blocks(x, r0, r1, ldx, w, y, ldy, b0, b1, pw, ps);
}
__attribute__((flatten)) void blocks_int4(const bf16_t* x, int64_t r0, int64_t r1, int64_t ldx,
                                          const Int4Weights& w, float* y, int64_t ldy, int64_t b0, int64_t b1,
                                          bf16_t* pw, float* ps) {
  blocks(x, r0, r1, ldx, w, y, ldy, b0, b1, pw, ps);
}

// Calls of at most kStreamRows rows (decode batches) take no panel: per 16 channels, each group's pairs
// are widened (int4_pairs) and met at once by every row, the rows' totals held in registers, so the
// widening is paid once per call and nothing goes through L2 twice. The sums are the panel's, in its
// order: the bits are the same.
constexpr int kStreamRows = 16;
constexpr int kStreamSub = 8;        // rows whose group sums are in registers at once
constexpr int64_t kStreamAhead = 8;  // groups a channel's software prefetch runs ahead

// N rows' group sums over one group's 16 pairs (pr), scaled into their totals.
template <int N>
inline void stream_rows(const bf16_t* xg, int64_t ldx, const __m512i pr[16], __m512 s, __m512* tot) {
  __m512 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
  for (int p = 0; p < 16; ++p) {
    const __m512bh wp = reinterpret_cast<__m512bh>(pr[p]);
    for (int i = 0; i < N; ++i)
      acc[i] = _mm512_dpbf16_ps(acc[i], wp, reinterpret_cast<__m512bh>(pair_of(xg + i * ldx + 2 * p)));
  }
  for (int i = 0; i < N; ++i) tot[i] = _mm512_fmadd_ps(acc[i], s, tot[i]);
}

// Rows [0, MB) against blocks [b0, b1) of 16 channels; ps: G * 16 floats of scratch.
template <int MB>
__attribute__((flatten)) void int4_stream(const bf16_t* x, int64_t ldx, const Int4Weights& w, float* y,
                                          int64_t ldy, int64_t b0, int64_t b1, float* ps) {
  const int64_t G = w.in / 32;
  const __m512i values = int4_table();
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * 16;
    int4_scales(w, n0, ps, 16);
    __m512 tot[MB];
    for (int i = 0; i < MB; ++i) tot[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      // Software prefetch, as 16 channels' rows read side by side run ahead of the hardware prefetcher:
      // every 4 groups each channel's line kStreamAhead groups on (the next block's rows near the end), and
      // one line a group of the next block's scales.
      if (g % 4 == 0) {
        const int64_t ga = g + kStreamAhead, na = ga < G ? n0 : n0 + 16, gn = ga < G ? ga : ga - G;
        for (int c = 0; c < 16 && na + c < w.out && gn < G; ++c)
          _mm_prefetch(reinterpret_cast<const char*>(w.q + (na + c) * (w.in / 2) + gn * 16), _MM_HINT_T0);
      }
      if (n0 + 16 < w.out)
        _mm_prefetch(reinterpret_cast<const char*>(w.scale + (n0 + 16) * G) + g * 64, _MM_HINT_T0);
      __m512i pr[16];
      int4_pairs(w, n0, g, values, pr);
      const __m512 sg = _mm512_load_ps(ps + g * 16);
      const bf16_t* xg = x + g * 32;
      if constexpr (MB > kStreamSub) {  // two halves, so that neither waits on its sums' latency
        constexpr int kFirst = (MB + 1) / 2;
        stream_rows<kFirst>(xg, ldx, pr, sg, tot);
        stream_rows<MB - kFirst>(xg + kFirst * ldx, ldx, pr, sg, tot + kFirst);
      } else {
        stream_rows<MB>(xg, ldx, pr, sg, tot);
      }
    }
    const int64_t left = w.out - n0;
    const __mmask16 k = left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    for (int i = 0; i < MB; ++i) _mm512_mask_storeu_ps(y + i * ldy + n0, k, tot[i]);
  }
}

// int4_stream<m> for 1 <= m <= MB.
template <int MB = kStreamRows>
void int4_stream_rows(int m, const bf16_t* x, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy,
                      int64_t b0, int64_t b1, float* ps) {
  if constexpr (MB > 0) {
    if (m == MB) return int4_stream<MB>(x, ldx, w, y, ldy, b0, b1, ps);
    int4_stream_rows<MB - 1>(m, x, ldx, w, y, ldy, b0, b1, ps);
  }
}

#pragma GCC pop_options

// Threads split the blocks of 32 channels (static); rows go in passes of kRowChunk.
template <class W, class Blocks>
void run(const bf16_t* x, int64_t M, int64_t ldx, const W& w, float* y, int64_t ldy, Blocks blocks_of) {
  if (M == 0) return;
  const int64_t nblocks = (w.out + kBlockN - 1) / kBlockN, G = w.in / 32;
  const bool parallel = M * w.in * w.out >= kParallelMin && nblocks >= 2;
  const int nt = parallel ? omp_get_max_threads() : 1;
  // Every thread's panel, allocated here: nothing inside the parallel region can throw.
  const int64_t panel = w.in * kBlockN + 32, scales = G * kBlockN + 16;  // values, 64-byte multiples
  thread_local std::vector<bf16_t> pws;
  thread_local std::vector<float> pss;
  bf16_t* pw = aligned(pws, nt * panel);
  float* ps = aligned(pss, nt * scales);
  for (int64_t r0 = 0; r0 < M; r0 += kRowChunk) {
    const int64_t r1 = std::min(M, r0 + kRowChunk);
    if (!parallel) {
      blocks_of(x, r0, r1, ldx, w, y, ldy, 0, nblocks, pw, ps);
      continue;
    }
#pragma omp parallel num_threads(nt)
    {
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
      blocks_of(x, r0, r1, ldx, w, y, ldy, nblocks * t / n, nblocks * (t + 1) / n, pw + t * panel,
                ps + t * scales);
    }
  }
}

}  // namespace

void gemm_int8_dpbf16(const bf16_t* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y, int64_t ldy) {
  if (!cpu_has_quant_dpbf16()) throw std::logic_error("gemm_int8_dpbf16: no AVX512_BF16 on this CPU");
  check_args("gemm_int8_dpbf16", x, M, ldx, w, y, ldy);
  run(x, M, ldx, w, y, ldy, blocks_int8);
}

void gemm_int4_dpbf16(const bf16_t* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy) {
  if (!cpu_has_quant_dpbf16()) throw std::logic_error("gemm_int4_dpbf16: no AVX512_BF16 on this CPU");
  check_args("gemm_int4_dpbf16", x, M, ldx, w, y, ldy);
  if (M == 0 || M > kStreamRows) return run(x, M, ldx, w, y, ldy, blocks_int4);
  // Threads split the blocks of 16 channels (static), each with its scales' scratch, allocated here.
  const int64_t nblocks = (w.out + 15) / 16, G = w.in / 32, scales = G * 16;
  const bool parallel = M * w.in * w.out >= kParallelMin && nblocks >= 2;
  const int nt = parallel ? omp_get_max_threads() : 1;
  thread_local std::vector<float> pss;
  float* ps = aligned(pss, nt * scales);
  const int m = static_cast<int>(M);
  if (!parallel) return int4_stream_rows(m, x, ldx, w, y, ldy, 0, nblocks, ps);
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    int4_stream_rows(m, x, ldx, w, y, ldy, nblocks * t / n, nblocks * (t + 1) / n, ps + t * scales);
  }
}

#else  // no AVX-512 in this build

bool cpu_has_quant_dpbf16() { return false; }

void gemm_int8_dpbf16(const bf16_t*, int64_t, int64_t, const Int8Weights&, float*, int64_t) {
  throw std::logic_error("gemm_int8_dpbf16: not in this build");
}
void gemm_int4_dpbf16(const bf16_t*, int64_t, int64_t, const Int4Weights&, float*, int64_t) {
  throw std::logic_error("gemm_int4_dpbf16: not in this build");
}

#endif

}  // namespace kda::kernels::gemm
