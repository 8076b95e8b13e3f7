#include "kda/kernels/gemm/row_gemv.h"

#include <algorithm>
#include <bit>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/common/isa.h"
#include "kda/common/isa_target.h"
#include "kda/kernels/gemm/quant_gemm.h"
#include "kda/kernels/gemm/weight_format.h"
#include "kda/kernels/kda/avx512.h"

namespace kda::kernels::gemm {
namespace {

// Columns widened at a time: a chunk of a row (2 KB of fp32) stays in L1 beside y or x.
constexpr int64_t kChunk = 512;

int64_t row_stride_bytes(const RowMatrix& w) {
  switch (w.format) {
    case RowFormat::F32:
      return w.cols * 4;
    case RowFormat::BF16:
      return w.cols * 2;
    case RowFormat::Int8:
      return w.cols;
    case RowFormat::Int4:
      return w.cols / 2;
  }
  return 0;
}

// Row r's first byte.
inline const void* row_at(const RowMatrix& w, int64_t r) {
  return static_cast<const uint8_t*>(w.data) + r * row_stride_bytes(w);
}

// The call's arguments, checked on every call (the message is built only for a bad one).
void check(const RowMatrix& w, int64_t r0, int64_t n, const float* x, const float* y, const char* who) {
  const auto fail = [who](const std::string& what) {
    throw std::invalid_argument(std::string(who) + ": " + what);
  };
  if (w.rows < 0 || w.cols <= 0 || w.data == nullptr) fail("the matrix has no data or no columns");
  if ((w.format == RowFormat::Int8 || w.format == RowFormat::Int4) && w.scale == nullptr)
    fail("int8 / int4 rows need their scales");
  if (w.format == RowFormat::Int4 && w.cols % kInt4Group != 0)
    fail("int4 rows of " + std::to_string(w.cols) + " columns: not a multiple of " +
         std::to_string(kInt4Group));
  if (r0 < 0 || n < 0 || r0 + n > w.rows)
    fail("rows [" + std::to_string(r0) + ", " + std::to_string(r0 + n) + ") outside the matrix's " +
         std::to_string(w.rows));
  if (x == nullptr || y == nullptr) fail("null x or y");
}

// Columns [c0, c0 + n) of row r as fp32 (the format's dequantized values); c0 and n multiples of 32 for
// int4. F32 rows are read in place.
inline const float* widen(const RowMatrix& w, int64_t r, int64_t c0, int64_t n, float* buf) {
  const void* row = row_at(w, r);
  switch (w.format) {
    case RowFormat::F32:
      return static_cast<const float*>(row) + c0;
    case RowFormat::BF16: {
      const bf16_t* b = static_cast<const bf16_t*>(row) + c0;
      for (int64_t c = 0; c < n; ++c) buf[c] = std::bit_cast<float>(static_cast<uint32_t>(b[c]) << 16);
      return buf;
    }
    case RowFormat::Int8: {
      const int8_t* q = static_cast<const int8_t*>(row) + c0;
      const float s = w.scale[r];
      for (int64_t c = 0; c < n; ++c) buf[c] = static_cast<float>(q[c]) * s;
      return buf;
    }
    case RowFormat::Int4: {
      // Group g's 16 bytes hold columns 32g + j (low nibble) and 32g + 16 + j (high).
      const int64_t G = w.cols / kInt4Group;
      for (int64_t g = c0 / kInt4Group; g < (c0 + n) / kInt4Group; ++g) {
        const uint8_t* b = static_cast<const uint8_t*>(row) + g * 16;
        const float s = w.scale[r * G + g];
        float* o = buf + (g * kInt4Group - c0);
        for (int j = 0; j < 16; ++j) {
          o[j] = static_cast<float>((b[j] & 0xF) - 8) * s;
          o[16 + j] = static_cast<float>((b[j] >> 4) - 8) * s;
        }
      }
      return buf;
    }
  }
  return buf;
}

KDA_TARGET_CLONES void xw_rows(const RowMatrix& w, int64_t k0, int64_t K, const float* x, float* y) {
  alignas(64) float buf[kChunk];
  for (int64_t c0 = 0; c0 < w.cols; c0 += kChunk) {
    const int64_t n = std::min(kChunk, w.cols - c0);
    float* yc = y + c0;
    for (int64_t c = 0; c < n; ++c) yc[c] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float* r = widen(w, k0 + k, c0, n, buf);
      const float xk = x[k];
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) yc[c] += xk * r[c];
    }
  }
}

KDA_TARGET_CLONES void wx_rows(const RowMatrix& w, int64_t n0, int64_t N, const float* x, float* y) {
  alignas(64) float buf[kChunk];
  for (int64_t n = 0; n < N; ++n) {
    float s = 0.0f;
    for (int64_t c0 = 0; c0 < w.cols; c0 += kChunk) {
      const int64_t m = std::min(kChunk, w.cols - c0);
      const float* r = widen(w, n0 + n, c0, m, buf);
      const float* xc = x + c0;
      float part = 0.0f;
#pragma omp simd reduction(+ : part)
      for (int64_t c = 0; c < m; ++c) part += r[c] * xc[c];
      s += part;
    }
    y[n] = s;
  }
}

#if defined(KDA_WITH_AVX512) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KDA_ROW_GEMV_AVX512 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma")
// The same sums with each row's values widened into registers, 16 columns a vector: xw a chain of
// multiply-adds per output in row order (int4 rows here at one row of x, every format for a batch); wx a
// chain per output over its row's vectors, then the lanes in a fixed tree (wx_tile). Columns a multiple
// of 16.

// Vectors [v0, v0 + NV) of row r (columns 16 v0 on), widened; int4's come in pairs (a group's low
// nibbles are its first 16 columns, its high ones the next 16), so NV is even for int4.
template <RowFormat F, int NV>
inline void load_row(const RowMatrix& w, int64_t r, int64_t v0, __m512 (&out)[NV]) {
  const void* row = row_at(w, r);
  if constexpr (F == RowFormat::F32) {
    for (int v = 0; v < NV; ++v) out[v] = _mm512_loadu_ps(static_cast<const float*>(row) + 16 * (v0 + v));
  } else if constexpr (F == RowFormat::BF16) {
    for (int v = 0; v < NV; ++v) {
      const __m256i b = _mm256_loadu_si256(static_cast<const __m256i*>(row) + v0 + v);
      out[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    }
  } else if constexpr (F == RowFormat::Int8) {
    const __m512 s = _mm512_set1_ps(w.scale[r]);
    for (int v = 0; v < NV; ++v) {
      const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(row) + v0 + v);
      out[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s);
    }
  } else {
    static_assert(NV % 2 == 0, "int4 rows widen a group (two vectors) at a time");
    const int64_t G = w.cols / kInt4Group;
    const __m512i nib = _mm512_set1_epi32(0xF), eight = _mm512_set1_epi32(8);
    for (int v = 0; v < NV; v += 2) {
      const int64_t g = (v0 + v) / 2;
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(row) + g));
      const __m512 s = _mm512_set1_ps(w.scale[r * G + g]);
      const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(b, nib), eight);
      const __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(b, 4), eight);
      out[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), s);
      out[v + 1] = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), s);
    }
  }
}

// xw over int4 rows, kXwRows rows a pass: each pair of y's vectors (a group's columns) is loaded once per
// pass and meets the rows in row order, their groups widened between. (Strips of y held in registers over
// every row instead read each row a strip's width at a time, a row apart, which read slower still.)
constexpr int kXwRows = 4;

template <int NR>
inline void xw_int4_pass(const RowMatrix& w, int64_t k0, const float* x, bool first, float* y) {
  __m512 xs[NR];
  for (int i = 0; i < NR; ++i) xs[i] = _mm512_set1_ps(x[i]);
  for (int64_t v = 0; v < w.cols / 16; v += 2) {
    __m512 acc[2];
    for (int u = 0; u < 2; ++u) acc[u] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + 16 * (v + u));
    for (int i = 0; i < NR; ++i) {
      __m512 row[2];
      load_row<RowFormat::Int4, 2>(w, k0 + i, v, row);
      for (int u = 0; u < 2; ++u) acc[u] = _mm512_fmadd_ps(xs[i], row[u], acc[u]);
    }
    for (int u = 0; u < 2; ++u) _mm512_storeu_ps(y + 16 * (v + u), acc[u]);
  }
}

void xw_int4_avx512(const RowMatrix& w, int64_t k0, int64_t K, const float* x, float* y) {
  if (K == 0) {
    for (int64_t c = 0; c < w.cols; ++c) y[c] = 0.0f;
    return;
  }
  int64_t k = 0;
  for (; k + kXwRows <= K; k += kXwRows) xw_int4_pass<kXwRows>(w, k0 + k, x + k, k == 0, y);
  for (; k < K; ++k) xw_int4_pass<1>(w, k0 + k, x + k, k == 0, y);
}

// gemm_rows_xw's NR rows (x[i], y[i]) over the NV vectors of columns from vector v: each output the
// chain of multiply-adds in row order from zero that xw_rows and xw_int4_pass run for one row, each row of
// W widened once for the NR rows.
template <RowFormat F, int NR, int NV>
inline void xw_strip(const RowMatrix& w, int64_t k0, int64_t K, int64_t v, const float* const* x,
                     float* const* y) {
  const float* xs[NR];
  for (int i = 0; i < NR; ++i) xs[i] = x[i];
  __m512 acc[NR][NV];
  for (auto& a : acc)
    for (auto& u : a) u = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 row[NV];
    load_row<F, NV>(w, k0 + k, v, row);
    for (int i = 0; i < NR; ++i) {
      const __m512 xi = _mm512_set1_ps(xs[i][k]);
      for (int u = 0; u < NV; ++u) acc[i][u] = _mm512_fmadd_ps(xi, row[u], acc[i][u]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int u = 0; u < NV; ++u) _mm512_storeu_ps(y[i] + 16 * (v + u), acc[i][u]);
}

// The M rows in blocks of 8, then 4, 2, 1 (8 rows by 2 vectors: 16 accumulators).
template <RowFormat F, int NV>
void xw_strips(const RowMatrix& w, int64_t k0, int64_t K, int64_t v, int64_t M, const float* const* x,
               float* const* y) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) xw_strip<F, 8, NV>(w, k0, K, v, x + m, y + m);
  if (M - m >= 4) {
    xw_strip<F, 4, NV>(w, k0, K, v, x + m, y + m);
    m += 4;
  }
  if (M - m >= 2) {
    xw_strip<F, 2, NV>(w, k0, K, v, x + m, y + m);
    m += 2;
  }
  if (M - m == 1) xw_strip<F, 1, NV>(w, k0, K, v, x + m, y + m);
}

// Strips of 32 columns (a cache line of bf16 rows, an int4 group), each over the rows [k0, k0 + K) for
// every row of x before the next strip: the strip's K lines stay in L1 for all of them.
template <RowFormat F>
void xw_batch_avx512(const RowMatrix& w, int64_t k0, int64_t K, int64_t M, const float* const* x,
                     float* const* y) {
  const int64_t nv = w.cols / 16;
  for (int64_t v = 0; v < nv; v += 2) {
    if (v + 2 <= nv)
      xw_strips<F, 2>(w, k0, K, v, M, x, y);
    else if constexpr (F != RowFormat::Int4)
      xw_strips<F, 1>(w, k0, K, v, M, x, y);
  }
}

// wx: each output one chain of multiply-adds over its row's vectors in order, from zero, then its 16 lanes
// added in a fixed tree (lane j and j + 8, then j + 4, j + 2, j + 1), 16 outputs at once (reduce16): the
// same operations for every output whichever tile it sits in, so a row's bits do not depend on M. A tile
// is NW rows of W by NX rows of x, 16 accumulators: each W vector widened once for the NX rows, each x
// vector read once for the NW rows. (One row's 4 accumulators and a reduction per output, widened per row
// of x, ran the batch of 16 at a third of the xw products' rate.)

// The lane sums of a[0..16) by that tree: lane i of the result is a[i]'s sum.
inline __m512 reduce16(const __m512 (&a)[16]) {
  __m512 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k)  // lanes j < 8: a[2k]'s j + (j + 8); lanes 8 + j: a[2k + 1]'s
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // 128-bit lane L: a[4k + L]'s j + (j + 4)
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // 128-bit lane L: a[8k + L]'s two j + (j + 2), then a[8k + 4 + L]'s
    d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * k], c[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], 0xEE));
  // Lane 4L + t: the sum of a[4t + L].
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  const __m512i to_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(to_order, e);
}

// Outputs [n, n + nw) (rows r0 + n on of W, nw <= NW) for the NX rows x[0..NX): accumulator i * NX + j is
// W row i against x row j. Rows past nw repeat the last one (their sums are not written).
template <RowFormat F, int NX>
inline void wx_tile(const RowMatrix& w, int64_t r0, int64_t n, int64_t nw, const float* const* x,
                    float* const* y) {
  constexpr int NW = 16 / NX;
  const int64_t nv = w.cols / 16;
  int64_t r[NW];
  for (int i = 0; i < NW; ++i) r[i] = r0 + n + std::min<int64_t>(i, nw - 1);
  const float* xs[NX];
  for (int j = 0; j < NX; ++j) xs[j] = x[j];
  __m512 acc[16];
  for (auto& v : acc) v = _mm512_setzero_ps();
  // W's rows in groups of G, each group over the whole row before the next: few streams at once, enough
  // chains to keep the multiply-adds busy (one row of x: 2, where 16 rows a step apart read kv_b from
  // memory slower than one row at a time did, and a single chain held int4 to its multiply-adds' latency).
  // The order of the accumulators' steps changes nothing in their sums.
  constexpr int G = NW < 4 ? NW : (NX == 1 ? 2 : 4);
  for (int g = 0; g < NW; g += G) {
    int64_t v = 0;
    for (; v + 2 <= nv; v += 2)  // int4 groups are two vectors; the others take pairs as well
      for (int i = g; i < g + G; ++i) {
        __m512 row[2];
        load_row<F, 2>(w, r[i], v, row);
        for (int u = 0; u < 2; ++u)
          for (int j = 0; j < NX; ++j)
            acc[i * NX + j] = _mm512_fmadd_ps(row[u], _mm512_loadu_ps(xs[j] + 16 * (v + u)), acc[i * NX + j]);
      }
    if constexpr (F != RowFormat::Int4) {
      if (v < nv)
        for (int i = g; i < g + G; ++i) {
          __m512 row[1];
          load_row<F, 1>(w, r[i], v, row);
          for (int j = 0; j < NX; ++j)
            acc[i * NX + j] = _mm512_fmadd_ps(row[0], _mm512_loadu_ps(xs[j] + 16 * v), acc[i * NX + j]);
        }
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(acc));
  for (int64_t i = 0; i < nw; ++i)
    for (int j = 0; j < NX; ++j) y[j][n + i] = sums[i * NX + j];
}

// W's rows 16 at a time (read from memory once; 16 KB of bf16 kv_b rows stay in L1), every block of x's
// rows (8, then 4, 2, 1) against them in tiles of 16 / NX rows.
template <RowFormat F>
void wx_batch_avx512(const RowMatrix& w, int64_t n0, int64_t N, int64_t M, const float* const* x,
                     float* const* y) {
  for (int64_t n = 0; n < N; n += 16) {
    const int64_t nn = std::min<int64_t>(16, N - n);
    int64_t m = 0;
    for (; m + 8 <= M; m += 8)
      for (int64_t i = 0; i < nn; i += 2)
        wx_tile<F, 8>(w, n0, n + i, std::min<int64_t>(2, nn - i), x + m, y + m);
    if (M - m >= 4) {
      for (int64_t i = 0; i < nn; i += 4)
        wx_tile<F, 4>(w, n0, n + i, std::min<int64_t>(4, nn - i), x + m, y + m);
      m += 4;
    }
    if (M - m >= 2) {
      for (int64_t i = 0; i < nn; i += 8)
        wx_tile<F, 2>(w, n0, n + i, std::min<int64_t>(8, nn - i), x + m, y + m);
      m += 2;
    }
    if (M - m == 1) wx_tile<F, 1>(w, n0, n, nn, x + m, y + m);
  }
}

// Whether the batched AVX-512 bodies ran: where avx512_rows runs (or, for xw in fp32, bf16 and int8, where
// xw_rows's multiply-adds are the same fused chain) for one row.
bool avx512_batch(bool xw, const RowMatrix& w, int64_t r0, int64_t n, int64_t M, const float* const* x,
                  float* const* y) {
  if (w.cols % 16 != 0 || best_isa() != Isa::Avx512) return false;
  switch (w.format) {
    case RowFormat::F32:
      xw ? xw_batch_avx512<RowFormat::F32>(w, r0, n, M, x, y)
         : wx_batch_avx512<RowFormat::F32>(w, r0, n, M, x, y);
      break;
    case RowFormat::BF16:
      xw ? xw_batch_avx512<RowFormat::BF16>(w, r0, n, M, x, y)
         : wx_batch_avx512<RowFormat::BF16>(w, r0, n, M, x, y);
      break;
    case RowFormat::Int8:
      xw ? xw_batch_avx512<RowFormat::Int8>(w, r0, n, M, x, y)
         : wx_batch_avx512<RowFormat::Int8>(w, r0, n, M, x, y);
      break;
    case RowFormat::Int4:
      xw ? xw_batch_avx512<RowFormat::Int4>(w, r0, n, M, x, y)
         : wx_batch_avx512<RowFormat::Int4>(w, r0, n, M, x, y);
      break;
  }
  return true;
}

// Whether the AVX-512 bodies ran: wx in every format (so that every format sums in one order), xw for
// int4 rows only, on columns a multiple of 16 on a CPU that has it. fp32, bf16 and int8 rows read faster
// one at a time through the loop of xw_rows, in the same order of multiply-adds (fused, as this copy
// fuses them): docs/performance.md, "MLA decode: kv_b read in place".
bool avx512_rows(bool xw, const RowMatrix& w, int64_t r0, int64_t n, const float* x, float* y) {
  if (w.cols % 16 != 0 || best_isa() != Isa::Avx512) return false;
  if (xw) {
    if (w.format != RowFormat::Int4) return false;
    xw_int4_avx512(w, r0, n, x, y);
    return true;
  }
  return avx512_batch(false, w, r0, n, 1, &x, &y);
}
#pragma GCC pop_options
#endif

// Row r of W in fp32 through weight_format.h's dequantize (the reference's path).
std::vector<float> reference_row(const RowMatrix& w, int64_t r) {
  std::vector<float> out(static_cast<size_t>(w.cols));
  const void* row = row_at(w, r);
  switch (w.format) {
    case RowFormat::F32:
      std::copy_n(static_cast<const float*>(row), w.cols, out.data());
      break;
    case RowFormat::BF16:
      bf16_to_f32_array(static_cast<const bf16_t*>(row), out.data(), static_cast<size_t>(w.cols));
      break;
    case RowFormat::Int8:
      dequantize_rows({Weights::Int8, row, w.scale + r, w.cols, 1}, 0, 1, out.data());
      break;
    case RowFormat::Int4:
      dequantize_rows({Weights::Int4, row, w.scale + r * (w.cols / kInt4Group), w.cols, 1}, 0, 1, out.data());
      break;
  }
  return out;
}

}  // namespace

int64_t row_bytes(const RowMatrix& w, int64_t rows) {
  const int64_t scales = w.format == RowFormat::Int8   ? 1
                         : w.format == RowFormat::Int4 ? w.cols / kInt4Group
                                                       : 0;
  return rows * (row_stride_bytes(w) + scales * static_cast<int64_t>(sizeof(float)));
}

namespace {
// gemv_rows_xw (xw) or gemv_rows_wx over rows [r0, r0 + n).
void gemv_rows(bool xw, const RowMatrix& w, int64_t r0, int64_t n, const float* x, float* y) {
  check(w, r0, n, x, y, xw ? "gemv_rows_xw" : "gemv_rows_wx");
#if defined(KDA_ROW_GEMV_AVX512)
  if (avx512_rows(xw, w, r0, n, x, y)) return;
#endif
  if (xw)
    xw_rows(w, r0, n, x, y);
  else
    wx_rows(w, r0, n, x, y);
}

// gemm_rows_xw (xw) or gemm_rows_wx: every row's arguments checked before any is written.
void gemm_rows(bool xw, const RowMatrix& w, int64_t r0, int64_t n, int64_t M, const float* const* x,
               float* const* y) {
  const char* who = xw ? "gemm_rows_xw" : "gemm_rows_wx";
  if (M < 0)
    throw std::invalid_argument(std::string(who) + ": a negative row count (" + std::to_string(M) + ")");
  if (M > 0 && (x == nullptr || y == nullptr))
    throw std::invalid_argument(std::string(who) + ": " + std::to_string(M) + " rows but no row pointers");
  for (int64_t m = 0; m < M; ++m) check(w, r0, n, x[m], y[m], who);
#if defined(KDA_ROW_GEMV_AVX512)
  if (M > 1 && avx512_batch(xw, w, r0, n, M, x, y)) return;
#endif
  for (int64_t m = 0; m < M; ++m) gemv_rows(xw, w, r0, n, x[m], y[m]);
}
}  // namespace

void gemv_rows_xw(const RowMatrix& w, int64_t k0, int64_t K, const float* x, float* y) {
  gemv_rows(true, w, k0, K, x, y);
}

void gemm_rows_xw(const RowMatrix& w, int64_t k0, int64_t K, int64_t M, const float* const* x,
                  float* const* y) {
  gemm_rows(true, w, k0, K, M, x, y);
}

void gemm_rows_wx(const RowMatrix& w, int64_t n0, int64_t N, int64_t M, const float* const* x,
                  float* const* y) {
  gemm_rows(false, w, n0, N, M, x, y);
}

void gemv_rows_wx(const RowMatrix& w, int64_t n0, int64_t N, const float* x, float* y) {
  gemv_rows(false, w, n0, N, x, y);
}

void gemv_rows_xw_reference(const RowMatrix& w, int64_t k0, int64_t K, const float* x, float* y) {
  check(w, k0, K, x, y, "gemv_rows_xw_reference");
  std::vector<double> acc(static_cast<size_t>(w.cols), 0.0);
  for (int64_t k = 0; k < K; ++k) {
    const std::vector<float> r = reference_row(w, k0 + k);
    for (int64_t c = 0; c < w.cols; ++c) acc[c] += static_cast<double>(x[k]) * r[c];
  }
  for (int64_t c = 0; c < w.cols; ++c) y[c] = static_cast<float>(acc[c]);
}

void gemv_rows_wx_reference(const RowMatrix& w, int64_t n0, int64_t N, const float* x, float* y) {
  check(w, n0, N, x, y, "gemv_rows_wx_reference");
  for (int64_t n = 0; n < N; ++n) {
    const std::vector<float> r = reference_row(w, n0 + n);
    double s = 0.0;
    for (int64_t c = 0; c < w.cols; ++c) s += static_cast<double>(r[c]) * x[c];
    y[n] = static_cast<float>(s);
  }
}

}  // namespace kda::kernels::gemm
