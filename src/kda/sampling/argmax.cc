#include "kda/sampling/argmax.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kda/common/isa.h"

#if defined(KDA_WITH_AVX512)
#include <immintrin.h>
#endif

namespace kda::sampling {

int32_t argmax_allowed_reference(const float* row, int64_t V, const uint8_t* allowed, bool* nan) {
  int64_t best = -1;
  bool any_nan = false;
  for (int64_t v = 0; v < V; ++v) {
    if (allowed && !allowed[v]) continue;
    any_nan = any_nan || std::isnan(row[v]);
    if (best < 0 || row[v] > row[best]) best = v;
  }
  if (nan) *nan = any_nan;
  return static_cast<int32_t>(best);
}

namespace {

// Both bodies below take the row in blocks of kBlock ids after the first allowed one (`first`, not a
// NaN): each block's largest allowed value in one pass (a NaN or a disallowed id never raises it), and
// only a block whose largest beats the best so far is scanned again for the first id holding it. So the
// row is read once, and the scans are rare (a running maximum rises a few dozen times along a row). The
// blocks go in id order and a block must beat the best strictly, so the lowest id wins a tie, as in the
// reference's scan. Beside the maxima, whether an allowed NaN went by (*nan).
constexpr int64_t kBlock = 256;

// The first id of [b0, b1) that is allowed and holds m (one exists: m came from that block).
int64_t first_holding(const float* row, int64_t b0, int64_t b1, const uint8_t* allowed, float m) {
  for (int64_t v = b0; v < b1; ++v)
    if ((!allowed || allowed[v]) && row[v] == m) return v;
  return b0;
}

int64_t blocks_portable(const float* row, int64_t first, int64_t V, const uint8_t* allowed, bool* nan) {
  int64_t best = first;
  float best_v = row[first];
  bool any_nan = false;
  for (int64_t b0 = first + 1; b0 < V; b0 += kBlock) {
    const int64_t b1 = std::min(V, b0 + kBlock);
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t v = b0; v < b1; ++v) {
      if (allowed && !allowed[v]) continue;
      const float x = row[v];
      any_nan = any_nan || x != x;
      m = x > m ? x : m;  // a NaN x leaves m
    }
    if (!(m > best_v)) continue;
    best = first_holding(row, b0, b1, allowed, m);
    best_v = m;
  }
  *nan = any_nan;
  return best;
}

#if defined(KDA_WITH_AVX512)
// 16 ids a vector: the allowed lanes' maximum (vmaxps returns its second operand, the running maximum,
// where the row's value is a NaN) and their unordered compares; the row's tail under a lane mask.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) int64_t blocks_avx512(const float* row,
                                                                                    int64_t first, int64_t V,
                                                                                    const uint8_t* allowed,
                                                                                    bool* nan) {
  const __m512 low = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m128i ones = _mm_set1_epi8(-1);
  int64_t best = first;
  float best_v = row[first];
  __mmask16 unordered = 0;
  for (int64_t b0 = first + 1; b0 < V; b0 += kBlock) {
    const int64_t b1 = std::min(V, b0 + kBlock);
    __m512 m = low;
    for (int64_t v = b0; v < b1; v += 16) {
      const __mmask16 in = b1 - v >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (b1 - v)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(in, row + v);
      const __mmask16 ok =
          allowed ? _mm_mask_test_epi8_mask(in, _mm_maskz_loadu_epi8(in, allowed + v), ones) : in;
      unordered |= _mm512_mask_cmp_ps_mask(ok, x, x, _CMP_UNORD_Q);
      m = _mm512_mask_max_ps(m, ok, x, m);
    }
    alignas(64) float lanes[16];  // (GCC 12 warns inside _mm512_reduce_max_ps)
    _mm512_store_ps(lanes, m);
    float mv = lanes[0];
    for (const float l : lanes) mv = l > mv ? l : mv;
    if (!(mv > best_v)) continue;
    best = first_holding(row, b0, b1, allowed, mv);
    best_v = mv;
  }
  *nan = unordered != 0;
  return best;
}
#endif

}  // namespace

int32_t argmax_allowed(const float* row, int64_t V, const uint8_t* allowed, bool* nan) {
  int64_t first = 0;
  if (allowed)
    while (first < V && !allowed[first]) ++first;
  if (nan) *nan = false;
  if (first >= V) return -1;
  if (std::isnan(row[first])) {
    if (nan) *nan = true;
    return static_cast<int32_t>(first);
  }
  bool any_nan = false;
  int64_t best = 0;
#if defined(KDA_WITH_AVX512)
  if (best_isa() == Isa::Avx512)  // KDA_ISA may cap it
    best = blocks_avx512(row, first, V, allowed, &any_nan);
  else
#endif
    best = blocks_portable(row, first, V, allowed, &any_nan);
  if (nan) *nan = any_nan;
  return static_cast<int32_t>(best);
}

void argmax_allowed_rows(const float* const* rows, int64_t M, int64_t V, const uint8_t* allowed, int32_t* ids,
                         uint8_t* nan) {
  // argmax_allowed throws nothing, so nothing can leave the region.
#pragma omp parallel for schedule(static) if (M > 1 && M * V >= (int64_t{1} << 16))
  for (int64_t m = 0; m < M; ++m) {
    bool row_nan = false;
    ids[m] = argmax_allowed(rows[m], V, allowed, &row_nan);
    if (nan) nan[m] = row_nan ? 1 : 0;
  }
}

}  // namespace kda::sampling
