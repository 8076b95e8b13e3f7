#include "kda/kernels/gemm/quant_amx.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "kda/common/isa.h"
#include "kda/kernels/gemm/quant_gemm_isa.h"

#if defined(KDA_WITH_AVX512) && defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    defined(__linux__)
#define KDA_AMX_BUILD 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kda/kernels/kda/avx512.h"  // <immintrin.h>, its GCC 12 false warnings silenced
#endif

namespace kda::kernels::gemm {

#if defined(KDA_AMX_BUILD)

bool cpu_has_amx_int8() {
  static const bool v = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!isa_available(Isa::Avx512) || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if ((d & (1u << 24)) == 0 || (d & (1u << 25)) == 0) return false;  // AMX-TILE, AMX-INT8
    // Linux hands the tile data state out per process on request (ARCH_REQ_XCOMP_PERM for
    // XFEATURE_XTILEDATA); oneDNN asks the same, a second grant is a no-op.
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return v;
}

namespace {

// Below this many weights a call runs on one thread (the fork costs more than the work).
constexpr int64_t kParallelMin = int64_t{1} << 15;
constexpr int64_t kRows = 16;  // a tile's rows: channels of A and C, activation rows of B and C

// GCC's tile store and load intrinsics are asm statements that do not tell the compiler they touch
// memory: stores to a buffer a tile loads next, and loads of one a tile stored, stay on their side of this.
#define KDA_TILE_FENCE() asm volatile("" ::: "memory")

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,amx-tile,amx-int8")

// Tiles: 0 the weights (16 channels by a_bytes inputs), 1 and 2 the activations' high and low bytes
// (a_bytes / 4 rows of `rows` rows' 4 bytes), 3 and 4 (and 5 and 6) their int32 sums (16 channels by
// `rows` rows). A block of fewer than 16 rows takes narrower tiles: the columns past them are never read.
inline void configure(int a_bytes, int64_t rows) {
  TileConfig c;
  c.rows[0] = kRows;
  c.colsb[0] = static_cast<uint16_t>(a_bytes);
  for (int t : {1, 2}) {
    c.rows[t] = static_cast<uint8_t>(a_bytes / 4);
    c.colsb[t] = static_cast<uint16_t>(4 * rows);
  }
  for (int t : {3, 4, 5, 6}) {
    c.rows[t] = kRows;
    c.colsb[t] = static_cast<uint16_t>(4 * rows);
  }
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// The tile shape for block b's rows, configured only when it changes (the last block of M % 16 rows).
class Tiles {
 public:
  explicit Tiles(int a_bytes) : a_bytes_(a_bytes) {}
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  void rows(int64_t r) {
    if (r != rows_) configure(a_bytes_, rows_ = r);
  }

 private:
  int a_bytes_;
  int64_t rows_ = 0;
};

// xq [M, in] as B tiles: per block of 16 rows two arrays of in / 4 x 16 words, the high bytes then the
// low ones, word [k / 4][m] holding inputs k..k + 3 of row m (words of rows past M left unwritten: their
// tile columns are not read); the tile of inputs [k, k + 4r) is the 4r rows from word k / 4 * 16. in is
// a multiple of 32.
void split_rows(const int16_t* xq, int64_t M, int64_t in, uint32_t* xb) {
  const int64_t W = in / 4 * kRows;
  const __m256i idx = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
  for (int64_t row = 0; row < M; ++row) {
    uint32_t* h = xb + 2 * (row / kRows) * W + row % kRows;
    uint32_t* l = h + W;
    for (int64_t k = 0; k < in; k += 32) {
      const __m512i v = _mm512_loadu_si512(xq + row * in + k);
      _mm256_i32scatter_epi32(h + k / 4 * kRows, idx, _mm512_cvtepi16_epi8(_mm512_srli_epi16(v, 8)), 4);
      _mm256_i32scatter_epi32(l + k / 4 * kRows, idx, _mm512_cvtepi16_epi8(v), 4);
    }
  }
}

// Block b's int32 sums of the high and low bytes into hs, ls [16 channels][16 rows].
inline void store_sums(int32_t* hs, int32_t* ls) {
  _tile_stored(3, hs, 64);
  _tile_stored(4, ls, 64);
  KDA_TILE_FENCE();
}

// o [16 channels][16 rows] into y's rows [m0, m0 + mr) and columns [n0, n0 + 16).
inline void write_out(const float* o, int64_t m0, int64_t mr, int64_t n0, float* y, int64_t ldy) {
  for (int64_t m = 0; m < mr; ++m)
    for (int64_t n = 0; n < kRows; ++n) y[(m0 + m) * ldy + n0 + n] = o[n * kRows + m];
}

// 8 outputs' exact sums 256 h + l (in int64: the high bytes' sum times 256 may pass int32) in fp32.
inline __m256 exact(__m256i h8, __m256i l8) {
  return _mm512_cvtepi64_ps(
      _mm512_add_epi64(_mm512_slli_epi64(_mm512_cvtepi32_epi64(h8), 8), _mm512_cvtepi32_epi64(l8)));
}

// Channel blocks [nb0, nb1) of int8 weights; xb as split_rows, sx the rows' scales padded to whole blocks.
void int8_blocks(const uint32_t* xb, const float* sx, int64_t M, const Int8Weights& w, int64_t nb0,
                 int64_t nb1, float* y, int64_t ldy) {
  Tiles tiles(64);
  alignas(64) int32_t hs[kRows * kRows] = {}, ls[kRows * kRows] = {};
  alignas(64) float o[kRows * kRows];
  const int64_t in = w.in, W = in / 4 * kRows;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const int64_t n0 = nb * kRows;
    const int8_t* a = w.q + n0 * in;
    for (int64_t b = 0; b * kRows < M; ++b) {
      const uint8_t* bh = reinterpret_cast<const uint8_t*>(xb + 2 * b * W);
      const uint8_t* bl = bh + 4 * W;
      const bool prefetch = b == 0 && nb + 1 < nb1;
      tiles.rows(std::min(kRows, M - b * kRows));
      _tile_zero(3);
      _tile_zero(4);
      for (int64_t k = 0; k < in; k += 64) {
        // The next block's 16 rows are one run of 16 in bytes: 16 of its lines per step, in address
        // order, into L2 (a block's run is most of L1: fetched into it, the run evicted this block's
        // lines before their use), so that the whole run is near while this block runs; and this
        // block's lines two steps ahead from there into L1.
        if (prefetch)
          for (int64_t j = 0; j < kRows; ++j)
            _mm_prefetch(reinterpret_cast<const char*>(a + kRows * in + 16 * k + 64 * j), _MM_HINT_T1);
        if (k + 128 < in)
          for (int64_t j = 0; j < kRows; ++j)
            _mm_prefetch(reinterpret_cast<const char*>(a + j * in + k + 128), _MM_HINT_T0);
        _tile_loadd(0, a + k, in);
        _tile_loadd(1, bh + 16 * k, 64);
        _tile_loadd(2, bl + 16 * k, 64);
        _tile_dpbssd(3, 0, 1);
        _tile_dpbsud(4, 0, 2);
      }
      store_sums(hs, ls);
      const __m512 sxv = _mm512_loadu_ps(sx + b * kRows);
      for (int64_t n = 0; n < kRows; ++n) {
        const __m512i h = _mm512_load_si512(hs + n * kRows), l = _mm512_load_si512(ls + n * kRows);
        const __m512 f = _mm512_insertf32x8(
            _mm512_castps256_ps512(exact(_mm512_castsi512_si256(h), _mm512_castsi512_si256(l))),
            exact(_mm512_extracti64x4_epi64(h, 1), _mm512_extracti64x4_epi64(l, 1)), 1);
        _mm512_store_ps(o + n * kRows, _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(w.scale[n0 + n])), sxv));
      }
      write_out(o, b * kRows, std::min(kRows, M - b * kRows), n0, y, ldy);
    }
  }
}

// A group's products of 32 inputs into the sums pair (H, L): A the unpacked weights (stride 128), bh / bl
// the group's activation tiles. Macros: GCC's tile intrinsics take the tile number as a literal.
#define KDA_GROUP_PRODUCT(H, L, a, bh, bl) \
  do {                                     \
    _tile_zero(H);                         \
    _tile_zero(L);                         \
    _tile_loadd(0, a, 128);                \
    _tile_loadd(1, bh, 64);                \
    _tile_loadd(2, bl, 64);                \
    _tile_dpbssd(H, 0, 1);                 \
    _tile_dpbsud(L, 0, 2);                 \
  } while (0)
#define KDA_STORE_PAIR(H, L, hs, ls) \
  do {                               \
    _tile_stored(H, hs, 64);         \
    _tile_stored(L, ls, 64);         \
    KDA_TILE_FENCE();                \
  } while (0)

// One group's exact sums h 256 + l of 16 channels by 16 rows into acc, times weight scale (ws[n * G]) and
// activation scale (sxv per row).
inline void scale_group(const int32_t* hs, const int32_t* ls, __m512 sxv, const float* ws, int64_t G,
                        __m512* acc) {
  for (int64_t n = 0; n < kRows; ++n) {
    const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hs + n * kRows), 8),
                                       _mm512_load_si512(ls + n * kRows));
    acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(_mm512_set1_ps(ws[n * G]), sxv), acc[n]);
  }
}

// Channel blocks [nb0, nb1) of int4 weights; xb as split_rows, sx the group scales [block][group][16 rows].
// Per chunk of 4 groups (64 packed bytes of a channel) the 16 channels are unpacked to (nibble - 8)
// bytes in input order, 128 per channel; then per group one product of 32 inputs, into alternating
// pairs of sum tiles: a group's sums are stored and scaled while the next group's product runs (one
// after the other, each group waited the whole product's latency).
void int4_blocks(const uint32_t* xb, const float* sx, int64_t M, const Int4Weights& w, int64_t nb0,
                 int64_t nb1, float* y, int64_t ldy) {
  Tiles tiles(32);
  alignas(64) int8_t a[kRows * 128];
  alignas(64) int32_t hs[kRows * kRows] = {}, ls[kRows * kRows] = {};
  alignas(64) float o[kRows * kRows];
  const int64_t in = w.in, W = in / 4 * kRows, G = in / kInt4Group, row_bytes = in / 2;
  const __m512i nib = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  // Low nibbles of a group's 16 bytes are its inputs 0..15, the high ones 16..31.
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11),
                second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const int64_t n0 = nb * kRows;
    const char* next = reinterpret_cast<const char*>(w.q + (n0 + kRows) * row_bytes);
    const char* next_scale = reinterpret_cast<const char*>(w.scale + (n0 + kRows) * G);
    for (int64_t b = 0; b * kRows < M; ++b) {
      const uint8_t* bh = reinterpret_cast<const uint8_t*>(xb + 2 * b * W);
      const uint8_t* bl = bh + 4 * W;
      const bool prefetch = b == 0 && nb + 1 < nb1;
      const float* ws = w.scale + n0 * G;
      const float* sxb = sx + b * G * kRows;
      tiles.rows(std::min(kRows, M - b * kRows));
      __m512 acc[kRows];
      for (auto& v : acc) v = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        if (g % 4 == 0) {
          const int64_t c = g / 4, ng = std::min<int64_t>(4, G - g);
          const __mmask64 mb = ng == 4 ? ~__mmask64(0) : (__mmask64(1) << (16 * ng)) - 1;
          // The next block's 16 rows (16 row_bytes, one run) and scales, in address order over its chunks.
          if (prefetch) {
            for (int64_t j = 0; j < kRows && 1024 * c + 64 * j < kRows * row_bytes; ++j)
              _mm_prefetch(next + 1024 * c + 64 * j, _MM_HINT_T0);
            for (int64_t j = 0; j < 4 && 256 * c + 64 * j < 4 * kRows * G; ++j)
              _mm_prefetch(next_scale + 256 * c + 64 * j, _MM_HINT_T0);
          }
          for (int64_t j = 0; j < kRows; ++j) {
            const __m512i v = _mm512_maskz_loadu_epi8(mb, w.q + (n0 + j) * row_bytes + 64 * c);
            const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(v, nib), eight);
            const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), nib), eight);
            _mm512_store_si512(a + j * 128, _mm512_permutex2var_epi64(lo, first, hi));
            _mm512_store_si512(a + j * 128 + 64, _mm512_permutex2var_epi64(lo, second, hi));
          }
          KDA_TILE_FENCE();
        }
        const int8_t* ag = a + 32 * (g % 4);
        const uint8_t *bhg = bh + 16 * kInt4Group * g, *blg = bl + 16 * kInt4Group * g;
        if (g % 2 == 0) {
          KDA_GROUP_PRODUCT(3, 4, ag, bhg, blg);
          if (g > 0) KDA_STORE_PAIR(5, 6, hs, ls);
        } else {
          KDA_GROUP_PRODUCT(5, 6, ag, bhg, blg);
          KDA_STORE_PAIR(3, 4, hs, ls);
        }
        if (g > 0) scale_group(hs, ls, _mm512_loadu_ps(sxb + (g - 1) * kRows), ws + g - 1, G, acc);
        KDA_TILE_FENCE();  // the next chunk's unpacking overwrites what the tiles above read
      }
      if ((G - 1) % 2 == 0)
        KDA_STORE_PAIR(3, 4, hs, ls);
      else
        KDA_STORE_PAIR(5, 6, hs, ls);
      scale_group(hs, ls, _mm512_loadu_ps(sxb + (G - 1) * kRows), ws + G - 1, G, acc);
      for (int64_t n = 0; n < kRows; ++n) _mm512_store_ps(o + n * kRows, acc[n]);
      write_out(o, b * kRows, std::min(kRows, M - b * kRows), n0, y, ldy);
    }
  }
}

#pragma GCC pop_options

// Threads split the channel blocks evenly (static), each running `body` once on its range.
template <class Body>
void split_blocks(int64_t blocks, int64_t weights, Body body) {
  if (weights < kParallelMin || blocks < 2) {
    body(0, blocks);
    return;
  }
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    body(blocks * t / nt, blocks * (t + 1) / nt);
  }
}

int64_t row_blocks(int64_t M) { return (M + kRows - 1) / kRows; }

}  // namespace

// The low bytes' sums (up to 255 * 127 per input) stay inside int32.
bool amx_takes(const Int8Weights& w) { return w.in % 64 == 0 && w.in <= 65536; }

void gemm_int8_amx(const int16_t* xq, const float* sx, int64_t M, const Int8Weights& w, float* y,
                   int64_t ldy) {
  if (!cpu_has_amx_int8()) throw std::logic_error("gemm_int8_amx: no AMX-INT8 on this CPU");
  if (!amx_takes(w))
    throw std::invalid_argument("gemm_int8_amx: the input size is not a multiple of 64 up to 65536");
  // The calling thread's scratch, grown once (as the entry points' quantized x).
  thread_local std::vector<uint32_t> xb;
  thread_local std::vector<float> sxp;
  const int64_t B = row_blocks(M), blocks = w.out / kRows, n16 = blocks * kRows;
  xb.resize(static_cast<size_t>(2 * B * (w.in / 4) * kRows));
  sxp.assign(static_cast<size_t>(B * kRows), 0.0f);
  std::copy(sx, sx + M, sxp.begin());
  split_rows(xq, M, w.in, xb.data());
  const uint32_t* xp = xb.data();
  const float* sp = sxp.data();
  split_blocks(blocks, w.in * n16,
               [&](int64_t nb0, int64_t nb1) { int8_blocks(xp, sp, M, w, nb0, nb1, y, ldy); });
  if (n16 < w.out)
    avx512::gemm_int8(xq, sx, M, Int8Weights{w.q + n16 * w.in, w.scale + n16, w.in, w.out - n16}, y + n16,
                      ldy, cpu_has_vnni());
}

void gemm_int4_amx(const int16_t* xq, const float* sx, int64_t M, const Int4Weights& w, float* y,
                   int64_t ldy) {
  if (!cpu_has_amx_int8()) throw std::logic_error("gemm_int4_amx: no AMX-INT8 on this CPU");
  thread_local std::vector<uint32_t> xb;
  thread_local std::vector<float> sxg;
  const int64_t B = row_blocks(M), G = w.in / kInt4Group, blocks = w.out / kRows, n16 = blocks * kRows;
  xb.resize(static_cast<size_t>(2 * B * (w.in / 4) * kRows));
  sxg.assign(static_cast<size_t>(B * G * kRows), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) sxg[((m / kRows) * G + g) * kRows + m % kRows] = sx[m * G + g];
  split_rows(xq, M, w.in, xb.data());
  const uint32_t* xp = xb.data();
  const float* sp = sxg.data();
  split_blocks(blocks, w.in * n16,
               [&](int64_t nb0, int64_t nb1) { int4_blocks(xp, sp, M, w, nb0, nb1, y, ldy); });
  if (n16 < w.out)
    avx512::gemm_int4(xq, sx, M, Int4Weights{w.q + n16 * (w.in / 2), w.scale + n16 * G, w.in, w.out - n16},
                      y + n16, ldy, cpu_has_vnni());
}

#else  // no AMX in this build

bool cpu_has_amx_int8() { return false; }
bool amx_takes(const Int8Weights&) { return false; }
void gemm_int8_amx(const int16_t*, const float*, int64_t, const Int8Weights&, float*, int64_t) {
  throw std::logic_error("gemm_int8_amx: not in this build");
}
void gemm_int4_amx(const int16_t*, const float*, int64_t, const Int4Weights&, float*, int64_t) {
  throw std::logic_error("gemm_int4_amx: not in this build");
}

#endif

}  // namespace kda::kernels::gemm
