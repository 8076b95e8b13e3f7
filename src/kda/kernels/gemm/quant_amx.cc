#include "kda/kernels/gemm/quant_amx.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "kda/common/isa.h"
#include "kda/kernels/gemm/amx_tiles.h"
#include "kda/kernels/gemm/quant_dpbf16.h"
#include "kda/kernels/gemm/quant_gemm_isa.h"

#if defined(KDA_AMX_BUILD)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kda::kernels::gemm {

bf16_t int4_widened(float w) {
  return f32_to_bf16(std::fabs(w) < std::numeric_limits<float>::min() ? std::copysign(0.0f, w) : w);
}

void gemm_int4_widened_reference(const bf16_t* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y,
                                 int64_t ldy) {
  check_int4_dpbf16_args("gemm_int4_widened_reference", x, M, ldx, w, y, ldy);
  std::vector<float> wn(static_cast<size_t>(w.in));
  for (int64_t n = 0; n < w.out; ++n) {
    dequantize_int4_rows(w, n, n + 1, wn.data());
    for (float& v : wn) v = bf16_to_f32(int4_widened(v));
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.0f;
      for (int64_t k = 0; k < w.in; ++k) s += bf16_to_f32(x[m * ldx + k]) * wn[k];
      y[m * ldy + n] = s;
    }
  }
}

#if defined(KDA_AMX_BUILD)

namespace {

// CPUID leaf 7's registers (sub-leaf `sub`), zero where the CPU has no such leaf.
struct Leaf7 {
  unsigned a = 0, b = 0, c = 0, d = 0;
};
Leaf7 leaf7(unsigned sub) {
  Leaf7 r;
  if (!__get_cpuid_count(7, sub, &r.a, &r.b, &r.c, &r.d)) r = Leaf7{};
  return r;
}

// AVX-512 and AMX-TILE, and the tile data this process may use: Linux hands that state out per process
// on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); oneDNN asks the same, a second grant is a no-op.
bool tiles_granted() {
  static const bool v = [] {
    if (!isa_available(Isa::Avx512) || (leaf7(0).d & (1u << 24)) == 0) return false;  // AMX-TILE
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return v;
}

}  // namespace

bool cpu_has_amx_int8() {
  static const bool v = tiles_granted() && (leaf7(0).d & (1u << 25)) != 0;  // AMX-INT8
  return v;
}

bool cpu_has_amx_bf16() {
  // AMX-BF16, and AVX512_BF16 for the activations' conversion.
  static const bool v = tiles_granted() && (leaf7(0).d & (1u << 22)) != 0 && (leaf7(1).a & (1u << 5)) != 0;
  return v;
}

namespace {

// Below this many weights a call runs on one thread (the fork costs more than the work).
constexpr int64_t kParallelMin = int64_t{1} << 15;
constexpr int64_t kRows = 16;  // a tile's rows: channels of A and C, activation rows of B and C

using amx::TileConfig;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,amx-tile,amx-int8,amx-bf16")

// int8 tiles: 0 and 1 the weights of two channel blocks (16 channels by 64 inputs), 2 and 3 the
// activations' high and low bytes (16 rows of `rows` rows' 4 bytes), 4 and 5 the first block's int32 sums
// of them, 6 and 7 the second's (16 channels by `rows` rows). A block of fewer than 16 rows takes narrower
// tiles: the columns past them are never read.
inline void configure_int8(int64_t rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = kRows;
    c.colsb[t] = static_cast<uint16_t>(t < 2 ? 64 : 4 * rows);
  }
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// The tile shape for block b's rows, configured only when it changes (the last block of M % 16 rows).
template <void (*Configure)(int64_t rows)>
class Tiles {
 public:
  Tiles() = default;
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  void rows(int64_t r) {
    if (r != rows_) Configure(rows_ = r);
  }

 private:
  int64_t rows_ = 0;
};

// 16 vectors of 16 dwords transposed: r[i] lane j becomes r[j] lane i.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], s[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // s[i + e] lane L: rows i..i + 3 of column 4 L + e
    s[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    s[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    s[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    s[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4;
       ++e) {  // the 4 x 4 transpose of 128-bit lanes of s[e], s[4 + e], s[8 + e], s[12 + e]
    const __m512i u0 = _mm512_shuffle_i32x4(s[e], s[4 + e], 0x44),
                  u1 = _mm512_shuffle_i32x4(s[e], s[4 + e], 0xEE),
                  u2 = _mm512_shuffle_i32x4(s[8 + e], s[12 + e], 0x44),
                  u3 = _mm512_shuffle_i32x4(s[8 + e], s[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }
}

// xq [M, in] as B tiles: per block of 16 rows two arrays of in / 4 x 16 words, the high bytes then the
// low ones, word [k / 4][m] holding inputs k..k + 3 of row m (words of rows past M zero); the tile of
// inputs [k, k + 4r) is the 4r rows from word k / 4 * 16. in is a multiple of 32. Here the share t of nt
// of the (row block, 64 inputs) pieces: per piece the 16 rows' bytes as 16 vectors, transposed.
void split_rows(const int16_t* xq, int64_t M, int64_t in, int t, int nt, uint32_t* xb) {
  const int64_t W = in / 4 * kRows, K = (in + 63) / 64, pieces = (M + kRows - 1) / kRows * K;
  for (int64_t i = pieces * t / nt; i < pieces * (t + 1) / nt; ++i) {
    const int64_t b = i / K, k = i % K * 64, kw = std::min<int64_t>(64, in - k);
    __m512i h[kRows], l[kRows];
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t row = b * kRows + r;
      if (row >= M) {
        h[r] = l[r] = _mm512_setzero_si512();
        continue;
      }
      const __m512i v0 = _mm512_loadu_si512(xq + row * in + k);
      const __m512i v1 = kw == 64 ? _mm512_loadu_si512(xq + row * in + k + 32) : _mm512_setzero_si512();
      h[r] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(v0, 8))),
                                _mm512_cvtepi16_epi8(_mm512_srai_epi16(v1, 8)), 1);
      l[r] =
          _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(v0)), _mm512_cvtepi16_epi8(v1), 1);
    }
    transpose16(h);
    transpose16(l);
    uint32_t* hb = xb + 2 * b * W + k / 4 * kRows;
    for (int64_t p = 0; p < kw / 4; ++p) {
      _mm512_storeu_si512(hb + p * kRows, h[p]);
      _mm512_storeu_si512(hb + W + p * kRows, l[p]);
    }
  }
}

// acc [16 channels] (lanes: rows) into y's rows [m0, m0 + mr) and columns [n0, n0 + 16): transposed in
// registers, one vector store per row (a scalar store per output slowed the int8 passes most where rows
// are short and a pass has few steps: docs/performance.md, "int8 AMX passes: the sums out in vectors").
inline void write_rows(__m512* acc, int64_t m0, int64_t mr, int64_t n0, float* y, int64_t ldy) {
  __m512i r[kRows];
  for (int64_t n = 0; n < kRows; ++n) r[n] = _mm512_castps_si512(acc[n]);
  transpose16(r);
  for (int64_t m = 0; m < mr; ++m) _mm512_storeu_ps(y + (m0 + m) * ldy + n0, _mm512_castsi512_ps(r[m]));
}

// 8 outputs' exact sums 256 h + l (in int64: the high bytes' sum times 256 may pass int32) in fp32.
inline __m256 exact(__m256i h8, __m256i l8) {
  return _mm512_cvtepi64_ps(
      _mm512_add_epi64(_mm512_slli_epi64(_mm512_cvtepi32_epi64(h8), 8), _mm512_cvtepi32_epi64(l8)));
}

// The int32 sums of block j (0 or 1) of a pass, tiles 4 + 2 j and 5 + 2 j, times the channel scales and
// the rows' (sxv) into y's rows [m0, m0 + mr) and columns [n0, n0 + 16).
inline void scale_out(int j, const float* scale, __m512 sxv, int64_t m0, int64_t mr, int64_t n0, float* y,
                      int64_t ldy) {
  alignas(64) int32_t hs[kRows * kRows], ls[kRows * kRows];
  if (j == 0) {
    _tile_stored(4, hs, 64);
    _tile_stored(5, ls, 64);
  } else {
    _tile_stored(6, hs, 64);
    _tile_stored(7, ls, 64);
  }
  KDA_TILE_FENCE();
  __m512 o[kRows];
  for (int64_t n = 0; n < kRows; ++n) {
    const __m512i h = _mm512_load_si512(hs + n * kRows), l = _mm512_load_si512(ls + n * kRows);
    const __m512 f = _mm512_insertf32x8(
        _mm512_castps256_ps512(exact(_mm512_castsi512_si256(h), _mm512_castsi512_si256(l))),
        exact(_mm512_extracti64x4_epi64(h, 1), _mm512_extracti64x4_epi64(l, 1)), 1);
    o[n] = _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(scale[n])), sxv);
  }
  write_rows(o, m0, mr, n0, y, ldy);
  KDA_TILE_FENCE();  // the next pass's sums overwrite what was stored above
}

// NB (1 or 2) channel blocks from n0 against every row block: per 64 inputs the activation tiles loaded
// once for both blocks (halving their reads from L2, where the rows' tiles live), each block's weights
// (16 channel rows a row apart) and its two products. Two steps ahead, each block's 16 lines and the
// activation tiles' lines are prefetched into L1. The weights' reads from memory are left to the hardware
// prefetchers, which follow the 32 channels' runs (a software prefetch of the next blocks into L2, 16
// lines a step, held the read lower), except for rows of at most kL2AheadMaxIn bytes, runs too short for
// those prefetchers to get going, where the next blocks' one run goes into L2 in address order over the
// first row block's steps (docs/performance.md, "int8 decode rows on AMX, two blocks a pass").
constexpr int64_t kL2AheadMaxIn = 1024;
template <int NB>
void int8_pass(const uint32_t* xb, const float* sx, int64_t M, const Int8Weights& w, int64_t n0,
               Tiles<configure_int8>& tiles, float* y, int64_t ldy) {
  const int64_t in = w.in, W = in / 4 * kRows;
  const int8_t* a = w.q + n0 * in;
  const char* next = reinterpret_cast<const char*>(a + NB * kRows * in);
  const bool next_l2 = in <= kL2AheadMaxIn && n0 + 2 * NB * kRows <= w.out;
  for (int64_t b = 0; b * kRows < M; ++b) {
    const uint8_t* bh = reinterpret_cast<const uint8_t*>(xb + 2 * b * W);
    const uint8_t* bl = bh + 4 * W;
    const int64_t R = std::min(kRows, M - b * kRows);
    tiles.rows(R);
    _tile_zero(4);
    _tile_zero(5);
    if (NB == 2) {
      _tile_zero(6);
      _tile_zero(7);
    }
    for (int64_t k = 0; k < in; k += 64) {
      if (k + 128 < in)
        for (int64_t j = 0; j < kRows; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(bh + 16 * (k + 128) + 64 * j), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(bl + 16 * (k + 128) + 64 * j), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(a + j * in + k + 128), _MM_HINT_T0);
          if (NB == 2)
            _mm_prefetch(reinterpret_cast<const char*>(a + (kRows + j) * in + k + 128), _MM_HINT_T0);
        }
      if (next_l2 && b == 0)
        for (int64_t j = 0; j < NB * kRows; ++j) _mm_prefetch(next + NB * 16 * k + 64 * j, _MM_HINT_T1);
      _tile_loadd(2, bh + 16 * k, 64);
      _tile_loadd(3, bl + 16 * k, 64);
      _tile_loadd(0, a + k, in);
      _tile_dpbssd(4, 0, 2);
      _tile_dpbsud(5, 0, 3);
      if (NB == 2) {
        _tile_loadd(1, a + kRows * in + k, in);
        _tile_dpbssd(6, 1, 2);
        _tile_dpbsud(7, 1, 3);
      }
    }
    const __m512 sxv = _mm512_loadu_ps(sx + b * kRows);
    for (int j = 0; j < NB; ++j)
      scale_out(j, w.scale + n0 + j * kRows, sxv, b * kRows, R, n0 + j * kRows, y, ldy);
  }
}

// Channel blocks [nb0, nb1) of int8 weights, two at a time (the last alone where their count is odd); xb
// as split_rows, sx the rows' scales padded to whole blocks.
void int8_blocks(const uint32_t* xb, const float* sx, int64_t M, const Int8Weights& w, int64_t nb0,
                 int64_t nb1, float* y, int64_t ldy) {
  Tiles<configure_int8> tiles;
  int64_t nb = nb0;
  for (; nb + 1 < nb1; nb += 2) int8_pass<2>(xb, sx, M, w, nb * kRows, tiles, y, ldy);
  if (nb < nb1) int8_pass<1>(xb, sx, M, w, nb * kRows, tiles, y, ldy);
}

// int4 blocks of at most 8 rows run on bf16 tiles, both parts of x in one activation tile side by side
// (columns 0..7 the rows' high parts, 8..15 their low ones): one product per group, the parts' sums
// added in fp32 (exact) on the way out. Blocks of more rows run on int8 tiles (two products per group,
// half the activation bytes bf16 tiles would load): the same exact group sums either way.
constexpr int64_t kPairedRows = 8;

// int4 tiles. Paired (rows <= 8): 0 and 1 the weights of even and odd groups (16 channels by a group's
// 32 inputs in bf16), 2 and 4 their activation tiles (16 input pairs by 16 columns), 6 and 7 their sums
// (16 channels by 16 columns, fp32): a group loads and multiplies while the group before it is stored.
// Otherwise: 0 a group's weights as (nibble - 8) bytes (16 channels by 32), 1 and 2 the activations'
// high and low bytes (8 rows of `rows` rows' 4 bytes), 3 and 4 (and 5 and 6) their int32 sums.
inline void configure_int4(int64_t rows) {
  TileConfig c;
  if (rows <= kPairedRows) {
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = kRows;
      c.colsb[t] = 64;
    }
  } else {
    c.rows[0] = kRows;
    c.colsb[0] = 32;
    for (int t = 1; t < 7; ++t) {
      c.rows[t] = static_cast<uint8_t>(t < 3 ? 8 : kRows);
      c.colsb[t] = static_cast<uint16_t>(4 * rows);
    }
  }
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// 32 int16 integers of at most 8 significant bits in bf16 (exact).
inline __m512i bf16_of_ints(__m512i v) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}

// The inputs of a group in the order the tiles take them: word j of a channel's tile row holds input
// input_at(j) (any order gives the same exact sums; this one lets one shift per word unpack the nibbles).
// The group's 16 bytes sit in every 128-bit lane L = j / 8; word w = j % 8 of them holds bytes 2 w and
// 2 w + 1, whose nibbles from bit 4 L on are inputs 2 w (low nibble of the low byte), 16 + 2 w (its high
// nibble), 2 w + 1 and 17 + 2 w.
inline int64_t input_at(int64_t j) {
  const int64_t w = j % 8, L = j / 8;
  return 2 * w + L / 2 + 16 * (L % 2);
}

// The bf16 activation tiles of R <= 8 rows xq [R, in]: per group one tile of 16 input pairs by 16
// columns, dword [p][m] holding inputs input_at(2p) and input_at(2p + 1) of row m as two bf16, 256 h of
// x = 256 h + l (h signed) in columns m < 8 and l (in [0, 255]) in columns 8 + m (both exact in bf16;
// columns past R zero). Group g at dword g 256. Here groups [g0, g1).
void split_rows_bf16(const int16_t* xq, int64_t R, int64_t in, int64_t g0, int64_t g1, uint32_t* xb) {
  const __m512i parts = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi16(static_cast<int16_t>(0xFF00)),
                                                _mm512_set1_epi16(0x00FF));
  alignas(64) int16_t order[kInt4Group];
  for (int64_t j = 0; j < kInt4Group; ++j) order[j] = static_cast<int16_t>(input_at(j));
  const __m512i to_order = _mm512_load_si512(order);
  for (int64_t g = g0; g < g1; ++g) {
    __m512i r[kRows];
    for (int64_t i = 0; i < kRows; ++i) {  // the rows twice
      const int64_t m = i % kPairedRows;
      r[i] = m < R ? _mm512_permutexvar_epi16(to_order, _mm512_loadu_si512(xq + m * in + g * kInt4Group))
                   : _mm512_setzero_si512();
    }
    transpose16(r);
    for (int64_t p = 0; p < kRows; ++p)
      _mm512_storeu_si512(xb + g * kRows * kRows + p * kRows, bf16_of_ints(_mm512_and_si512(r[p], parts)));
  }
}

// Group g of the 16 channels from q0 (rows of row_bytes) as bf16 (nibble - 8) in input_at order, into a
// [16][32]: the group's 16 bytes in every 128-bit lane, each word shifted right by 4 L (`shifts`), whose
// low 5 bits index `table` (its 32 entries repeat every 16: the bit above the nibble is the next one's).
inline void unpack_group(const uint8_t* q0, int64_t row_bytes, int64_t g, uint16_t* a, __m512i shifts,
                         __m512i table) {
  for (int64_t n = 0; n < kRows; ++n) {
    const __m512i v = _mm512_broadcast_i32x4(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q0 + n * row_bytes + 16 * g)));
    _mm512_store_si512(a + 32 * n, _mm512_permutexvar_epi16(_mm512_srlv_epi16(v, shifts), table));
  }
}

// unpack_group's constants: `table` the bf16 values of (nibble - 8) at the 32 indices vpermw takes (they
// repeat every 16), `shifts` each word's right shift (4 L in 128-bit lane L).
struct UnpackConsts {
  __m512i table, shifts;
};
inline UnpackConsts unpack_consts() {
  alignas(64) uint16_t entries[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(i % 16 - 8);
    uint32_t u = 0;
    std::memcpy(&u, &v, sizeof(u));
    entries[i] = static_cast<uint16_t>(u >> 16);  // exact: a small integer
  }
  alignas(64) uint16_t shift_of[32];
  for (int j = 0; j < 32; ++j) shift_of[j] = static_cast<uint16_t>(4 * (j / 8));
  return {_mm512_load_si512(entries), _mm512_load_si512(shift_of)};
}

// One paired group's product: A tile AT from a, the activation tile BT from bt, the sums into CT. Macros:
// GCC's tile intrinsics take the tile number as a literal.
#define KDA_PAIRED_PRODUCT(AT, BT, CT, a, bt) \
  do {                                        \
    _tile_loadd(AT, a, 64);                   \
    _tile_loadd(BT, bt, 64);                  \
    _tile_zero(CT);                           \
    _tile_dpbf16ps(CT, AT, BT);               \
  } while (0)

// Group g's sums (tile 6 or 7) into c [16 channels][16 columns].
inline void store_group(int64_t g, float* c) {
  if (g % 2 == 0)
    _tile_stored(6, c, 64);
  else
    _tile_stored(7, c, 64);
  KDA_TILE_FENCE();
}

// A paired group's sums c [16 channels][8 rows' high parts, their low ones] into acc [16 channels] (lanes:
// rows 0..7), times weight scale (ws[n * G]) and activation scale (sxv per row): per output one FMA of the
// exact sum by the product of the scales, as on int8 tiles. In 256-bit vectors: on these CPUs they take
// three ports where 512-bit ones take two, and the halves of a row of c need no shuffle.
inline void scale_paired(const float* c, __m256 sxv, const float* ws, int64_t G, __m256* acc) {
  for (int64_t n = 0; n < kRows; ++n) {
    const __m256 sum = _mm256_add_ps(_mm256_load_ps(c + n * kRows), _mm256_load_ps(c + n * kRows + 8));
    acc[n] = _mm256_fmadd_ps(sum, _mm256_mul_ps(_mm256_set1_ps(ws[n * G]), sxv), acc[n]);
  }
}

// A group's products of 32 inputs on int8 tiles into the sums pair (H, L): A the unpacked weights
// (stride 128), bh / bl the group's activation tiles.
#define KDA_INT8_GROUP_PRODUCT(H, L, a, bh, bl) \
  do {                                          \
    _tile_zero(H);                              \
    _tile_zero(L);                              \
    _tile_loadd(0, a, 128);                     \
    _tile_loadd(1, bh, 64);                     \
    _tile_loadd(2, bl, 64);                     \
    _tile_dpbssd(H, 0, 1);                      \
    _tile_dpbsud(L, 0, 2);                      \
  } while (0)
#define KDA_STORE_PAIR(H, L, hs, ls) \
  do {                               \
    _tile_stored(H, hs, 64);         \
    _tile_stored(L, ls, 64);         \
    KDA_TILE_FENCE();                \
  } while (0)

// One group's exact sums 256 h + l of 16 channels by 16 rows (int8 tiles) into acc, times weight scale
// (ws[n * G]) and activation scale (sxv per row).
inline void scale_sums(const int32_t* hs, const int32_t* ls, __m512 sxv, const float* ws, int64_t G,
                       __m512* acc) {
  for (int64_t n = 0; n < kRows; ++n) {
    const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hs + n * kRows), 8),
                                       _mm512_load_si512(ls + n * kRows));
    acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(_mm512_set1_ps(ws[n * G]), sxv), acc[n]);
  }
}

// One channel block's G groups (16 channels from q0, rows of row_bytes) on bf16 tiles against one
// activation tile per group (xt, T dwords apart): per group its product from zero, the weights two groups
// ahead unpacked (a tile load of vector stores that have not yet reached the cache waits), the group
// before it stored and the one before that handed to scale(g, sums, acc) (the vector loads of a tile's store
// that has not yet reached the cache wait for it), while the next block's 16 rows (one run of 256 bytes
// per group) and scales (64 bytes per group) are prefetched in address order where `prefetch`. Always
// inlined, and acc passed to scale rather than captured by it: so the callers' accumulators stay in
// registers (as a captured array they went to the stack, which slowed the kernels).
template <class Acc, class Scale>
__attribute__((always_inline)) inline void bf16_groups(const uint8_t* q0, int64_t row_bytes, int64_t G,
                                                       const uint32_t* xt, int64_t T, const char* next,
                                                       const char* next_scale, bool prefetch, UnpackConsts k,
                                                       Scale scale, Acc* acc) {
  alignas(64) uint16_t a[3][kRows * kInt4Group];
  alignas(64) float c[2][kRows * kRows];
  unpack_group(q0, row_bytes, 0, a[0], k.shifts, k.table);
  if (G > 1) unpack_group(q0, row_bytes, 1, a[1], k.shifts, k.table);
  const uint32_t* xg = xt;
  for (int64_t g = 0; g < G; ++g, xg += T) {
    if (prefetch) {
      for (int64_t j = 0; j < 4; ++j) _mm_prefetch(next + 256 * g + 64 * j, _MM_HINT_T0);
      _mm_prefetch(next_scale + 64 * g, _MM_HINT_T0);
    }
    KDA_TILE_FENCE();
    if (g % 2 == 0)
      KDA_PAIRED_PRODUCT(0, 2, 6, a[g % 3], xg);
    else
      KDA_PAIRED_PRODUCT(1, 4, 7, a[g % 3], xg);
    KDA_TILE_FENCE();  // the unpacking below overwrites what the group before this one loaded
    if (g + 2 < G) unpack_group(q0, row_bytes, g + 2, a[(g + 2) % 3], k.shifts, k.table);
    if (g > 0) store_group(g - 1, c[(g - 1) % 2]);
    if (g > 1) scale(g - 2, c[g % 2], acc);
    KDA_TILE_FENCE();
  }
  if (G > 1) scale(G - 2, c[G % 2], acc);
  store_group(G - 1, c[(G - 1) % 2]);
  scale(G - 1, c[(G - 1) % 2], acc);
}

// Channel blocks [nb0, nb1) of int4 weights. Row blocks of more than 8 rows on int8 tiles (xb8 as
// split_rows): per chunk of 4 groups the 16 channels unpacked to (nibble - 8) bytes, per group one
// product pair into alternating pairs of sum tiles, a group's sums stored and scaled while the next
// group's products run. The last block, where it has at most 8 rows, on bf16 tiles (xbf as
// split_rows_bf16): per group its product, the weights two groups ahead unpacked, the group before it
// stored and the one before that scaled. sx: the group scales [block][group][16 rows].
void int4_blocks(const uint32_t* xb8, const uint32_t* xbf, const float* sx, int64_t M, const Int4Weights& w,
                 int64_t nb0, int64_t nb1, float* y, int64_t ldy) {
  Tiles<configure_int4> tiles;
  alignas(64) int8_t a8[kRows * 128];
  alignas(64) int32_t hs[kRows * kRows] = {}, ls[kRows * kRows] = {};
  const UnpackConsts consts = unpack_consts();
  const __m512i nib = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  // Low nibbles of a group's 16 bytes are its inputs 0..15, the high ones 16..31.
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11),
                second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  const int64_t in = w.in, G = in / kInt4Group, row_bytes = in / 2, W = in / 4 * kRows;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const int64_t n0 = nb * kRows;
    const uint8_t* q0 = w.q + n0 * row_bytes;
    const float* ws = w.scale + n0 * G;
    // The next block's 16 rows (16 row_bytes, one run) and scales, in address order over its groups.
    const char* next = reinterpret_cast<const char*>(q0 + kRows * row_bytes);
    const char* next_scale = reinterpret_cast<const char*>(ws + kRows * G);
    for (int64_t b = 0; b * kRows < M; ++b) {
      const int64_t R = std::min(kRows, M - b * kRows);
      const bool prefetch = b == 0 && nb + 1 < nb1;
      const float* sxb = sx + b * G * kRows;
      tiles.rows(R);
      __m512 acc[kRows];
      for (auto& v : acc) v = _mm512_setzero_ps();
      if (R > kPairedRows) {
        const uint8_t* bh = reinterpret_cast<const uint8_t*>(xb8 + 2 * b * W);
        const uint8_t* bl = bh + 4 * W;
        for (int64_t g = 0; g < G; ++g) {
          if (g % 4 == 0) {
            const int64_t ch = g / 4, ng = std::min<int64_t>(4, G - g);
            const __mmask64 mb = ng == 4 ? ~__mmask64(0) : (__mmask64(1) << (16 * ng)) - 1;
            if (prefetch) {
              for (int64_t j = 0; j < kRows && 1024 * ch + 64 * j < kRows * row_bytes; ++j)
                _mm_prefetch(next + 1024 * ch + 64 * j, _MM_HINT_T0);
              for (int64_t j = 0; j < 4 && 256 * ch + 64 * j < 4 * kRows * G; ++j)
                _mm_prefetch(next_scale + 256 * ch + 64 * j, _MM_HINT_T0);
            }
            for (int64_t j = 0; j < kRows; ++j) {
              const __m512i v = _mm512_maskz_loadu_epi8(mb, q0 + j * row_bytes + 64 * ch);
              const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(v, nib), eight);
              const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), nib), eight);
              _mm512_store_si512(a8 + j * 128, _mm512_permutex2var_epi64(lo, first, hi));
              _mm512_store_si512(a8 + j * 128 + 64, _mm512_permutex2var_epi64(lo, second, hi));
            }
            KDA_TILE_FENCE();
          }
          const int8_t* ag = a8 + 32 * (g % 4);
          const uint8_t *bhg = bh + 16 * kInt4Group * g, *blg = bl + 16 * kInt4Group * g;
          if (g % 2 == 0) {
            KDA_INT8_GROUP_PRODUCT(3, 4, ag, bhg, blg);
            if (g > 0) KDA_STORE_PAIR(5, 6, hs, ls);
          } else {
            KDA_INT8_GROUP_PRODUCT(5, 6, ag, bhg, blg);
            KDA_STORE_PAIR(3, 4, hs, ls);
          }
          if (g > 0) scale_sums(hs, ls, _mm512_loadu_ps(sxb + (g - 1) * kRows), ws + g - 1, G, acc);
          KDA_TILE_FENCE();  // the next chunk's unpacking overwrites what the tiles above read
        }
        if ((G - 1) % 2 == 0)
          KDA_STORE_PAIR(3, 4, hs, ls);
        else
          KDA_STORE_PAIR(5, 6, hs, ls);
        scale_sums(hs, ls, _mm512_loadu_ps(sxb + (G - 1) * kRows), ws + G - 1, G, acc);
      } else {
        __m256 acc8[kRows];
        for (auto& v : acc8) v = _mm256_setzero_ps();
        bf16_groups(
            q0, row_bytes, G, xbf, kRows * kRows, next, next_scale, prefetch, consts,
            [sxb, ws, G](int64_t g, const float* sums, __m256* a8) {
              scale_paired(sums, _mm256_loadu_ps(sxb + g * kRows), ws + g, G, a8);
            },
            acc8);
        // The rows past 8 are not written.
        for (int64_t n = 0; n < kRows; ++n) acc[n] = _mm512_castps256_ps512(acc8[n]);
      }
      write_rows(acc, b * kRows, R, n0, y, ldy);
    }
  }
}

// int4 from bf16 activations (gemm_int4_amx_bf16): every tile 16 rows of 64 bytes. Weight tiles are 16
// channels by a group's 32 inputs in input_at order (unpack_group's and widen_group's layout), activation
// tiles 16 input pairs by 16 rows, sum tiles 16 channels by 16 rows (bf16_groups and wide_blocks say
// which is which).
inline void configure_bf16_groups(int64_t) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = kRows;
    c.colsb[t] = 64;
  }
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// Rows [m0, m0 + 16) of x (bf16, rows past M zero), group g, as a B tile into xb (16 input pairs by 16
// rows, dword [p][m] holding inputs input_at(2p) and input_at(2p + 1) of row m0 + m).
inline void x_tile(const bf16_t* x, int64_t ldx, int64_t M, int64_t m0, int64_t g, __m512i to_order,
                   uint32_t* xb) {
  __m512i r[kRows];
  for (int64_t i = 0; i < kRows; ++i)
    r[i] = m0 + i < M
               ? _mm512_permutexvar_epi16(to_order, _mm512_loadu_si512(x + (m0 + i) * ldx + g * kInt4Group))
               : _mm512_setzero_si512();
  transpose16(r);
  for (int64_t p = 0; p < kRows; ++p) _mm512_store_si512(xb + p * kRows, r[p]);
}

// Tiles [i0, i1) of x_tile's for the row blocks from m0 (tile i: row block i / G, group i % G) into xt,
// the inputs in input_at order (int4's weight tiles) or, `natural`, in their own (int8's).
void x_tiles(const bf16_t* x, int64_t ldx, int64_t M, int64_t m0, int64_t G, int64_t i0, int64_t i1,
             uint32_t* xt, bool natural = false) {
  alignas(64) int16_t order[kInt4Group];
  for (int64_t j = 0; j < kInt4Group; ++j) order[j] = static_cast<int16_t>(natural ? j : input_at(j));
  const __m512i to_order = _mm512_load_si512(order);
  for (int64_t i = i0; i < i1; ++i)
    x_tile(x, ldx, M, m0 + i / G * kRows, i % G, to_order, xt + i * kRows * kRows);
}

// A group's sums c [16 channels][16 rows] into acc [16 channels] (lanes: rows), each times its channel's
// scale (ws[n * G]): y = fma(s_g, scale, y), the dpbf16 scheme's step.
inline void scale_group(const float* c, const float* ws, int64_t G, __m512* acc) {
  for (int64_t n = 0; n < kRows; ++n)
    acc[n] = _mm512_fmadd_ps(_mm512_load_ps(c + n * kRows), _mm512_set1_ps(ws[n * G]), acc[n]);
}

// Channel blocks [nb0, nb1) against one row block of M <= 16 rows from m0 (xt: its G tiles of x_tile's):
// a call of at most 16 rows (the decode row counts), where each weight is used once per call and comes
// from memory: the groups streamed through bf16_groups, per group one product from zero, its sums scaled
// on the vector unit.
void int4_bf16_stream(const uint32_t* xt, int64_t m0, int64_t M, const Int4Weights& w, int64_t nb0,
                      int64_t nb1, float* y, int64_t ldy) {
  Tiles<configure_bf16_groups> tiles;
  tiles.rows(kRows);
  const UnpackConsts consts = unpack_consts();
  const int64_t in = w.in, G = in / kInt4Group, row_bytes = in / 2;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const int64_t n0 = nb * kRows;
    const uint8_t* q0 = w.q + n0 * row_bytes;
    const float* ws = w.scale + n0 * G;
    __m512 acc[kRows];
    for (auto& v : acc) v = _mm512_setzero_ps();
    bf16_groups(
        q0, row_bytes, G, xt, kRows * kRows, reinterpret_cast<const char*>(q0 + kRows * row_bytes),
        reinterpret_cast<const char*>(ws + kRows * G), nb + 1 < nb1, consts,
        [ws, G](int64_t g, const float* sums, __m512* a) { scale_group(sums, ws + g, G, a); }, acc);
    write_rows(acc, m0, M, n0, y, ldy);
  }
}

// int4 weights widened to bf16 (gemm_int4_amx_bf16 from 17 rows, int4_widened): per channel and group, the
// 16 values bf16((i - 8) * scale) as a vpermw table (its 32 entries repeat every 16, as unpack_group's),
// looked up by the nibbles. vcvtneps2bf16 rounds to nearest even and flushes values below fp32's normal
// range to zero, as int4_widened does.
inline __m512 widen_levels() {
  alignas(64) float v[16];
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(i - 8);
  return _mm512_load_ps(v);
}

// Group g of channels [0, nc) of the 16 from q0 (rows of row_bytes, scales ws [n * G + g]) widened to bf16
// in input_at order into a [16][32]; the channels past nc zero (nothing past them is read).
inline void widen_group(const uint8_t* q0, int64_t row_bytes, const float* ws, int64_t G, int64_t g,
                        int64_t nc, uint16_t* a, __m512i shifts, __m512 levels) {
  for (int64_t n = 0; n < nc; ++n) {
    const __m512i v = _mm512_broadcast_i32x4(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q0 + n * row_bytes + 16 * g)));
    const __m256i t =
        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(levels, _mm512_set1_ps(ws[n * G + g]))));
    _mm512_store_si512(a + 32 * n,
                       _mm512_permutexvar_epi16(_mm512_srlv_epi16(v, shifts),
                                                _mm512_inserti64x4(_mm512_castsi256_si512(t), t, 1)));
  }
  for (int64_t n = nc; n < kRows; ++n) _mm512_store_si512(a + 32 * n, _mm512_setzero_si512());
}

// Sum tile CT (16 channels by 16 rows) into y's rows [m0, m0 + mr) and columns [n0, n0 + nc), each
// channel's sums times its scale sc[n] where sc is not null (int8).
#define KDA_WIDE_OUT(CT, m0, mr, n0, nc, sc)                                                \
  do {                                                                                      \
    alignas(64) float c_[kRows * kRows];                                                    \
    _tile_stored(CT, c_, 64);                                                               \
    KDA_TILE_FENCE();                                                                       \
    __m512i r_[kRows];                                                                      \
    for (int64_t n_ = 0; n_ < kRows; ++n_) {                                                \
      const __m512 v_ = _mm512_load_ps(c_ + n_ * kRows);                                    \
      r_[n_] = _mm512_castps_si512(                                                         \
          (sc) != nullptr && n_ < (nc) ? _mm512_mul_ps(v_, _mm512_set1_ps((sc)[n_])) : v_); \
    }                                                                                       \
    transpose16(r_);                                                                        \
    const __mmask16 k_ = static_cast<__mmask16>((1u << (nc)) - 1);                          \
    for (int64_t m_ = 0; m_ < (mr); ++m_)                                                   \
      _mm512_mask_storeu_ps(y + ((m0) + m_) * ldy + (n0), k_, _mm512_castsi512_ps(r_[m_])); \
  } while (0)

// Group g of channels [0, nc) of the 16 int8 channels from q0 (rows of `in` bytes) as bf16 (q: exact) in
// their own order into a [16][32]; the channels past nc zero.
inline void widen_group_int8(const int8_t* q0, int64_t in, int64_t g, int64_t nc, uint16_t* a) {
  for (int64_t n = 0; n < nc; ++n) {
    const int8_t* q = q0 + n * in + kInt4Group * g;
    const __m512 lo =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
    _mm512_store_si512(a + 32 * n, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
  for (int64_t n = nc; n < kRows; ++n) _mm512_store_si512(a + 32 * n, _mm512_setzero_si512());
}

// A channel row's packed bytes and a 16-channel block's scales (the prefetches' extents), and the
// channel scales the sums take at the end (int8's; int4's are in its widened weights).
inline int64_t row_bytes_of(const Int4Weights& w) { return w.in / 2; }
inline int64_t row_bytes_of(const Int8Weights& w) { return w.in; }
inline int64_t block_scales(const Int4Weights& w) { return kRows * (w.in / kInt4Group); }
inline int64_t block_scales(const Int8Weights&) { return kRows; }
inline const float* sum_scales(const Int4Weights&, int64_t) { return nullptr; }
inline const float* sum_scales(const Int8Weights& w, int64_t n0) { return w.scale + n0; }

// A pass's channel blocks widened into a panel: block j's group g at tile j G + g (`units` (j, g) pairs in
// order, from unit u0 to u1). int4: bf16((nibble - 8) * scale) in input_at order; int8: q in bf16 (exact)
// in the inputs' order, its channel's scale applied to the sums.
template <class W>
struct WidePanel {
  const W* w;
  int64_t nb, blocks, G;  // first channel block, how many (1 or 2), groups per block
  uint16_t* tiles;
  int64_t channels(int64_t j) const { return std::min(kRows, w->out - (nb + j) * kRows); }
  void widen(int64_t u0, int64_t u1, __m512i shifts, __m512 levels) const {
    const int64_t row_bytes = row_bytes_of(*w);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t j = u / G, g = u % G, n0 = (nb + j) * kRows;
      if constexpr (std::is_same_v<W, Int4Weights>)
        widen_group(w->q + n0 * row_bytes, row_bytes, w->scale + n0 * G, G, g, channels(j),
                    tiles + u * kRows * kInt4Group, shifts, levels);
      else
        widen_group_int8(w->q + n0 * row_bytes, row_bytes, g, channels(j), tiles + u * kRows * kInt4Group);
    }
  }
};

// Channel blocks [nb0, nb1) (the last may hold fewer than 16 channels) against the B row blocks of xp
// (x_tile's tiles, G per row block, row block b's rows m0 + 16 b on), two channel blocks and two row
// blocks a pass: the two blocks' groups widened into a panel (2 G tiles), then per pair of row blocks
// four sums, each over the groups in ascending order in its own tile. The next pass's panel is widened
// (in `panels`' other half) a few groups after each step's products, so the vector unit's work runs while
// the tile unit's products do. Tiles: 0, 1 the channel blocks' weights, 2, 3 the row blocks'
// activations, 4 + 2 j + r the sums of channel block j and row block r.
template <class W>
void wide_blocks(const uint32_t* xp, int64_t B, int64_t m0, int64_t M, const W& w, int64_t nb0, int64_t nb1,
                 uint16_t* panels, float* y, int64_t ldy) {
  Tiles<configure_bf16_groups> tiles;
  tiles.rows(kRows);
  const __m512i shifts = unpack_consts().shifts;
  const __m512 levels = widen_levels();
  const int64_t G = w.in / kInt4Group, T = kRows * kRows, A = kRows * kInt4Group;
  const auto pass_at = [&](int64_t nb, int64_t half) {
    return WidePanel<W>{&w, nb, std::min<int64_t>(2, nb1 - nb), G, panels + half * 2 * G * A};
  };
  WidePanel<W> cur = pass_at(nb0, 0);
  cur.widen(0, cur.blocks * G, shifts, levels);
  for (int64_t nb = nb0, half = 0; nb < nb1; nb += 2, half ^= 1) {
    const bool two = cur.blocks == 2;
    const bool more = nb + 2 < nb1;
    const WidePanel<W> next = pass_at(more ? nb + 2 : nb, half ^ 1);
    // The next panel's units spread over this pass's steps (ceil(B / 2) G of them).
    const int64_t units = more ? next.blocks * G : 0, steps = (B + 1) / 2 * G,
                  per = (units + steps - 1) / steps;
    int64_t done = 0;
    // The pass after the next one, prefetched into L2 in address order over this pass's steps (the next
    // one's bytes are read as it is widened).
    const int64_t after = std::min<int64_t>(2, std::max<int64_t>(0, nb1 - nb - 4)),
                  row_bytes = row_bytes_of(w), nba = after > 0 ? nb + 4 : nb;
    const char* ahead = reinterpret_cast<const char*>(w.q) + nba * kRows * row_bytes;
    const char* ahead_scale = reinterpret_cast<const char*>(w.scale + nba * block_scales(w));
    const int64_t lines = after * kRows * row_bytes / 64, scale_lines = after * block_scales(w) * 4 / 64;
    const int64_t per_lines = (lines + steps - 1) / steps, per_scale = (scale_lines + steps - 1) / steps;
    int64_t step = 0;
    KDA_TILE_FENCE();
    const uint16_t* p0 = cur.tiles;
    const uint16_t* p1 = cur.tiles + G * A;
    const int64_t nc0 = cur.channels(0), nc1 = two ? cur.channels(1) : 0;
    for (int64_t b = 0; b < B; b += 2) {
      const bool rows2 = b + 1 < B;
      const uint32_t* x0 = xp + b * G * T;
      const uint32_t* x1 = x0 + G * T;
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t g = 0; g < G; ++g) {
        _tile_loadd(0, p0 + g * A, 64);
        _tile_loadd(2, x0 + g * T, 64);
        _tile_dpbf16ps(4, 0, 2);
        if (rows2) {
          _tile_loadd(3, x1 + g * T, 64);
          _tile_dpbf16ps(5, 0, 3);
        }
        if (two) {
          _tile_loadd(1, p1 + g * A, 64);
          _tile_dpbf16ps(6, 1, 2);
          if (rows2) _tile_dpbf16ps(7, 1, 3);
        }
        if (after > 0) {
          for (int64_t l = step * per_lines, e = std::min(lines, l + per_lines); l < e; ++l)
            _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
          for (int64_t l = step * per_scale, e = std::min(scale_lines, l + per_scale); l < e; ++l)
            _mm_prefetch(ahead_scale + 64 * l, _MM_HINT_T1);
          ++step;
        }
        if (done < units) {
          const int64_t u1 = std::min(units, done + per);
          next.widen(done, u1, shifts, levels);
          done = u1;
        }
      }
      const int64_t r0 = m0 + b * kRows, r1 = r0 + kRows, n0 = nb * kRows, n1 = n0 + kRows;
      const float* sc0 = sum_scales(w, n0);
      const float* sc1 = two ? sum_scales(w, n1) : nullptr;
      KDA_WIDE_OUT(4, r0, std::min(kRows, M - r0), n0, nc0, sc0);
      if (rows2) KDA_WIDE_OUT(5, r1, std::min(kRows, M - r1), n0, nc0, sc0);
      if (two) {
        KDA_WIDE_OUT(6, r0, std::min(kRows, M - r0), n1, nc1, sc1);
        if (rows2) KDA_WIDE_OUT(7, r1, std::min(kRows, M - r1), n1, nc1, sc1);
      }
    }
    next.widen(done, units, shifts, levels);
    cur = next;
  }
}

#pragma GCC pop_options

// Threads split the channel blocks evenly (static), each running `body` once on its range after every
// thread has run `prepare` on its share (t of nt) of what the blocks read.
template <class Prepare, class Body>
void split_blocks(int64_t blocks, int64_t weights, Prepare prepare, Body body) {
  if (weights < kParallelMin || blocks < 2) {
    prepare(0, 1);
    body(0, blocks);
    return;
  }
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    prepare(t, nt);
#pragma omp barrier
    body(blocks * t / nt, blocks * (t + 1) / nt);
  }
}

int64_t row_blocks(int64_t M) { return (M + kRows - 1) / kRows; }

// The widened calls (gemm_int4_amx_bf16 from kAmxBf16WidenedRows rows, gemm_int8_amx_bf16): every
// channel, the threads' shares whole pairs of channel blocks (wide_blocks' passes). The calling thread's
// scratch, grown once before any parallel region: a chunk's activation tiles (int4's in input_at order,
// int8's in their own), then each thread's two weight panels (2 G tiles each). Each panel pair starts 4 KB +
// 64 bytes past the region before it: on whole multiples of 4 KB (the tiles' sizes) the expert shapes ran
// 5-20% slower (measured on the dpbf16 scheme's panels).
template <class W>
void wide_gemm(const bf16_t* x, int64_t M, int64_t ldx, const W& w, float* y, int64_t ldy) {
  constexpr bool natural = !std::is_same_v<W, Int4Weights>;
  const int64_t G = w.in / kInt4Group, T = kRows * kRows, blocks = (w.out + kRows - 1) / kRows;
  thread_local std::vector<uint32_t> scratch;
  constexpr int64_t kSkew = 1040;  // dwords
  const int64_t xp_size = std::min(row_blocks(M), kAmxBf16ChunkRows / kRows) * G * T + kSkew,
                panel_size = 4 * G * T + kSkew;
  scratch.resize(static_cast<size_t>(xp_size + omp_get_max_threads() * panel_size + 16));
  uint32_t* xt =
      reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  for (int64_t m0 = 0; m0 < M; m0 += kAmxBf16ChunkRows) {
    const int64_t rows = std::min(kAmxBf16ChunkRows, M - m0), B = row_blocks(rows);
    split_blocks(
        (blocks + 1) / 2, w.in * w.out * std::max<int64_t>(1, rows / kRows),
        [&](int t, int nt) { x_tiles(x, ldx, M, m0, G, B * G * t / nt, B * G * (t + 1) / nt, xt, natural); },
        [&](int64_t s0, int64_t s1) {
          uint16_t* panel = reinterpret_cast<uint16_t*>(xt + xp_size + omp_get_thread_num() * panel_size);
          wide_blocks(xt, B, m0, M, w, 2 * s0, std::min(blocks, 2 * s1), panel, y, ldy);
        });
  }
}

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
  uint32_t* xp = xb.data();
  const float* sp = sxp.data();
  split_blocks(
      blocks, w.in * n16, [&](int t, int nt) { split_rows(xq, M, w.in, t, nt, xp); },
      [&](int64_t nb0, int64_t nb1) { int8_blocks(xp, sp, M, w, nb0, nb1, y, ldy); });
  if (n16 < w.out)
    avx512::gemm_int8(xq, sx, M, Int8Weights{w.q + n16 * w.in, w.scale + n16, w.in, w.out - n16}, y + n16,
                      ldy, cpu_has_vnni());
}

void gemm_int4_amx(const int16_t* xq, const float* sx, int64_t M, const Int4Weights& w, float* y,
                   int64_t ldy) {
  if (!cpu_has_amx_int8() || !cpu_has_amx_bf16())
    throw std::logic_error("gemm_int4_amx: no AMX-INT8 and AMX-BF16 on this CPU");
  thread_local std::vector<uint32_t> xb8, xbf;
  thread_local std::vector<float> sxg;
  const int64_t B = row_blocks(M), G = w.in / kInt4Group, blocks = w.out / kRows, n16 = blocks * kRows;
  // The last block's rows; where at most 8, that block takes bf16 tiles and the others int8 ones.
  const int64_t last = (B - 1) * kRows, tail = M - last;
  const bool paired = tail <= kPairedRows;
  const int64_t M8 = paired ? last : M;
  xb8.resize(static_cast<size_t>(2 * row_blocks(M8) * (w.in / 4) * kRows));
  xbf.resize(static_cast<size_t>(paired ? G * kRows * kRows : 0));
  sxg.assign(static_cast<size_t>(B * G * kRows), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) sxg[((m / kRows) * G + g) * kRows + m % kRows] = sx[m * G + g];
  uint32_t* x8 = xb8.data();
  uint32_t* xf = xbf.data();
  const float* sp = sxg.data();
  split_blocks(
      blocks, w.in * n16,
      [&](int t, int nt) {
        split_rows(xq, M8, w.in, t, nt, x8);
        if (paired) split_rows_bf16(xq + last * w.in, tail, w.in, G * t / nt, G * (t + 1) / nt, xf);
      },
      [&](int64_t nb0, int64_t nb1) { int4_blocks(x8, xf, sp, M, w, nb0, nb1, y, ldy); });
  if (n16 < w.out)
    avx512::gemm_int4(xq, sx, M, Int4Weights{w.q + n16 * (w.in / 2), w.scale + n16 * G, w.in, w.out - n16},
                      y + n16, ldy, cpu_has_vnni());
}

void gemm_int4_amx_bf16(const bf16_t* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y,
                        int64_t ldy) {
  if (!cpu_has_amx_bf16()) throw std::logic_error("gemm_int4_amx_bf16: no AMX-BF16 on this CPU");
  check_int4_dpbf16_args("gemm_int4_amx_bf16", x, M, ldx, w, y, ldy);
  if (M == 0) return;
  // The dpbf16 scheme's calls are one row block.
  static_assert(kAmxBf16WidenedRows == kRows + 1);
  if (M >= kAmxBf16WidenedRows) return wide_gemm(x, M, ldx, w, y, ldy);
  const int64_t G = w.in / kInt4Group, T = kRows * kRows, blocks = w.out / kRows, n16 = blocks * kRows;
  // The calling thread's activation tiles, grown once before any parallel region.
  thread_local std::vector<uint32_t> scratch;
  scratch.resize(static_cast<size_t>(G * T + 16));
  uint32_t* xt =
      reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  if (blocks > 0)
    split_blocks(
        blocks, w.in * n16,
        [&](int t, int nt) { x_tiles(x, ldx, M, 0, G, G * t / nt, G * (t + 1) / nt, xt); },
        [&](int64_t nb0, int64_t nb1) { int4_bf16_stream(xt, 0, M, w, nb0, nb1, y, ldy); });
  if (n16 < w.out)
    gemm_int4_dpbf16(x, M, ldx, Int4Weights{w.q + n16 * (w.in / 2), w.scale + n16 * G, w.in, w.out - n16},
                     y + n16, ldy);
}

void gemm_int8_amx_bf16(const bf16_t* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y,
                        int64_t ldy) {
  if (!cpu_has_amx_bf16()) throw std::logic_error("gemm_int8_amx_bf16: no AMX-BF16 on this CPU");
  check_int8_dpbf16_args("gemm_int8_amx_bf16", x, M, ldx, w, y, ldy);
  if (M > 0) wide_gemm(x, M, ldx, w, y, ldy);
}

#else  // no AMX in this build

bool cpu_has_amx_int8() { return false; }
bool cpu_has_amx_bf16() { return false; }
bool amx_takes(const Int8Weights&) { return false; }
void gemm_int8_amx(const int16_t*, const float*, int64_t, const Int8Weights&, float*, int64_t) {
  throw std::logic_error("gemm_int8_amx: not in this build");
}
void gemm_int4_amx(const int16_t*, const float*, int64_t, const Int4Weights&, float*, int64_t) {
  throw std::logic_error("gemm_int4_amx: not in this build");
}
void gemm_int4_amx_bf16(const bf16_t* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y,
                        int64_t ldy) {
  check_int4_dpbf16_args("gemm_int4_amx_bf16", x, M, ldx, w, y, ldy);
  throw std::logic_error("gemm_int4_amx_bf16: not in this build");
}
void gemm_int8_amx_bf16(const bf16_t* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y,
                        int64_t ldy) {
  check_int8_dpbf16_args("gemm_int8_amx_bf16", x, M, ldx, w, y, ldy);
  throw std::logic_error("gemm_int8_amx_bf16: not in this build");
}

#endif

}  // namespace kda::kernels::gemm
