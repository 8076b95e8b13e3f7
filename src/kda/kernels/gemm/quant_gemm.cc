// The quantized GEMM kernels, compiled once per ISA (kda/common/isa_target.h). AVX-512: intrinsics,
// the weights widened and converted in registers. Portable and AVX2: a block of output channels is
// dequantized into an L1-sized buffer and every row of x is dotted against it (the compiler
// vectorises the dot products for the ISA of the copy).
#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(KDA_ISA_AVX512)
// GCC 12's AVX-512 conversion intrinsics pass an undefined source operand for their unused mask lanes
// (_mm512_undefined_*), which -Wuninitialized reports as a use of an uninitialized value; it is not one.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

#include "kda/common/isa_target.h"
#include "kda/kernels/gemm/quant_gemm_isa.h"

KDA_ISA_PUSH
namespace kda::kernels::gemm::KDA_ISA_NS {
namespace {

// Output channels per block: the weights of a block stay in L1 while every row of x passes over them,
// so each packed byte comes from memory once per call.
constexpr int64_t kNB = 4;
// Below this many weights a call runs on one thread (the fork costs more than the work).
constexpr int64_t kParallelMin = int64_t{1} << 15;
// From memory (a model's weights do not fit in the caches between steps) each channel's row is a
// stream read 16 bytes at a time; a prefetch this far ahead, once per cache line, keeps the lines in
// flight that the hardware prefetchers alone did not.
constexpr int64_t kPrefetchAhead = 1024;

#if defined(KDA_ISA_AVX512)

// Rows [m0, m0 + MB) x channels [n0, n0 + NB) of an int8 GEMM: MB * NB accumulators of 16 lanes.
template <int MB, int NB>
void int8_block(const float* x, int64_t ldx, const Int8Weights& w, int64_t m0, int64_t n0, float* y,
                int64_t ldy) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t in = w.in;
  for (int64_t k = 0; k < in; k += 16) {
    const __mmask16 mk = in - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (in - k)) - 1);
    if ((k & 63) == 0)
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w.q + (n0 + j) * in + k) + kPrefetchAhead, _MM_HINT_T0);
    __m512 wf[NB];
    for (int j = 0; j < NB; ++j) {
      const __m128i b = _mm_maskz_loadu_epi8(mk, w.q + (n0 + j) * in + k);
      wf[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    }
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mk, x + (m0 + i) * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wf[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      y[(m0 + i) * ldy + n0 + j] = _mm512_reduce_add_ps(acc[i][j]) * w.scale[n0 + j];
}

// The same for int4: per group of 32, one 16-byte load per channel widened to 16 lanes; the low
// nibbles are inputs 0..15 of the group, the high ones 16..31; w = nibble * s - 8 s in one FMA.
template <int MB, int NB>
void int4_block(const float* x, int64_t ldx, const Int4Weights& w, int64_t m0, int64_t n0, float* y,
                int64_t ldy) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t in = w.in, G = in / kInt4Group, row_bytes = in / 2;
  const __m512i lo_mask = _mm512_set1_epi32(0xF);
  for (int64_t g = 0; g < G; ++g) {
    if ((g & 3) == 0)
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w.q + (n0 + j) * row_bytes + g * 16) + kPrefetchAhead,
                     _MM_HINT_T0);
    __m512 wlo[NB], whi[NB];
    for (int j = 0; j < NB; ++j) {
      const __m512i b = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + (n0 + j) * row_bytes + g * 16)));
      const __m512 s = _mm512_set1_ps(w.scale[(n0 + j) * G + g]);
      const __m512 bias = _mm512_mul_ps(s, _mm512_set1_ps(-8.0f));
      wlo[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, lo_mask)), s, bias);
      whi[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s, bias);
    }
    for (int i = 0; i < MB; ++i) {
      const float* xr = x + (m0 + i) * ldx + g * kInt4Group;
      const __m512 xlo = _mm512_loadu_ps(xr), xhi = _mm512_loadu_ps(xr + 16);
      for (int j = 0; j < NB; ++j) {
        acc[i][j] = _mm512_fmadd_ps(xlo, wlo[j], acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(xhi, whi[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[(m0 + i) * ldy + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// Every row of x against channels [n0, n0 + NB), four rows at a time.
template <int NB, class W, class Block>
void channel_block(const float* x, int64_t M, int64_t ldx, const W& w, int64_t n0, float* y, int64_t ldy,
                   Block) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) Block::template run<4, NB>(x, ldx, w, m, n0, y, ldy);
  switch (M - m) {
    case 3:
      Block::template run<3, NB>(x, ldx, w, m, n0, y, ldy);
      break;
    case 2:
      Block::template run<2, NB>(x, ldx, w, m, n0, y, ldy);
      break;
    case 1:
      Block::template run<1, NB>(x, ldx, w, m, n0, y, ldy);
      break;
    default:
      break;
  }
}

struct Int8Block {
  template <int MB, int NB>
  static void run(const float* x, int64_t ldx, const Int8Weights& w, int64_t m0, int64_t n0, float* y,
                  int64_t ldy) {
    int8_block<MB, NB>(x, ldx, w, m0, n0, y, ldy);
  }
};
struct Int4Block {
  template <int MB, int NB>
  static void run(const float* x, int64_t ldx, const Int4Weights& w, int64_t m0, int64_t n0, float* y,
                  int64_t ldy) {
    int4_block<MB, NB>(x, ldx, w, m0, n0, y, ldy);
  }
};

template <class W, class Block>
void gemm_blocks(const float* x, int64_t M, int64_t ldx, const W& w, float* y, int64_t ldy, Block b) {
  const int64_t full = w.out / kNB;
#pragma omp parallel for schedule(static) if (w.in * w.out >= kParallelMin)
  for (int64_t nb = 0; nb < full; ++nb) channel_block<kNB>(x, M, ldx, w, nb * kNB, y, ldy, b);
  for (int64_t n = full * kNB; n < w.out; ++n) channel_block<1>(x, M, ldx, w, n, y, ldy, b);
}

#else  // portable, AVX2

// One channel of the weights dequantized into wf[0..in).
void dequant_row(const Int8Weights& w, int64_t n, float* wf) {
  const int8_t* q = w.q + n * w.in;
  const float s = w.scale[n];
#pragma omp simd
  for (int64_t k = 0; k < w.in; ++k) wf[k] = static_cast<float>(q[k]) * s;
}

void dequant_row(const Int4Weights& w, int64_t n, float* wf) {
  const int64_t G = w.in / kInt4Group;
  const uint8_t* q = w.q + n * (w.in / 2);
  for (int64_t g = 0; g < G; ++g) {
    const float s = w.scale[n * G + g], bias = -8.0f * s;
    float* o = wf + g * kInt4Group;
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      o[j] = static_cast<float>(q[g * 16 + j] & 0xF) * s + bias;
      o[j + 16] = static_cast<float>(q[g * 16 + j] >> 4) * s + bias;
    }
  }
}

template <class W>
void gemm_blocks(const float* x, int64_t M, int64_t ldx, const W& w, float* y, int64_t ldy) {
  const int64_t nblocks = (w.out + kNB - 1) / kNB, in = w.in;
#pragma omp parallel if (w.in * w.out >= kParallelMin)
  {
    std::vector<float> wf(static_cast<size_t>(kNB * in));  // only bad_alloc could throw: terminate is fine
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < nblocks; ++nb) {
      const int64_t n0 = nb * kNB, nn = std::min(kNB, w.out - n0);
      for (int64_t j = 0; j < nn; ++j) dequant_row(w, n0 + j, wf.data() + j * in);
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * ldx;
        for (int64_t j = 0; j < nn; ++j) {
          const float* wr = wf.data() + j * in;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t k = 0; k < in; ++k) s += xr[k] * wr[k];
          y[m * ldy + n0 + j] = s;
        }
      }
    }
  }
}

#endif

}  // namespace

#if defined(KDA_ISA_AVX512)
void gemm_int8(const float* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y, int64_t ldy) {
  gemm_blocks(x, M, ldx, w, y, ldy, Int8Block{});
}
void gemm_int4(const float* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy) {
  gemm_blocks(x, M, ldx, w, y, ldy, Int4Block{});
}
#else
void gemm_int8(const float* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y, int64_t ldy) {
  gemm_blocks(x, M, ldx, w, y, ldy);
}
void gemm_int4(const float* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy) {
  gemm_blocks(x, M, ldx, w, y, ldy);
}
#endif

}  // namespace kda::kernels::gemm::KDA_ISA_NS
KDA_ISA_POP
