// fused_recurrent_kda_opt: the per-token recurrence (spec "Forward" step 6), usually one token per
// sequence (decode), where the kernel is bound by moving the 64 KB K x V state of every (sequence, head)
// through the memory hierarchy once per call. Per token:
//   y = S^T (k * exp(g))                          the decay folded into the key, S not written
//   S <- diag(exp(g)) S + k (beta (v - y))^T,  o = S^T (scale q-hat)
// Every column of S evolves on its own (column j only meets v[j], u[j], o[j]), so the state is walked in
// strips of 64 columns (K x 64 fp32 = 32 KB at K = 128; the L1D is 48 KB on Zen 5, 32 KB on Zen 4):
// both passes, for every token of a block, run on a strip while it is (partly, see pass 2) in L1, and
// the state is read from and written to memory once per call.
// While a strip is worked on, the next one (or the next head's first one) is prefetched, when the
// states come from memory (see KdaArgs::state_locality).
//
// Work items are (sequence, head) pairs, split into one contiguous range per OpenMP thread so that each
// thread knows which state it reads next and can prefetch it. The state is updated in its pool slot in
// place; only without a pool, or without output_final_state, does it go through a per-thread buffer.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <vector>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/avx512.h"
#include "kda/kernels/kda/impl.h"
#include "kda/kernels/kda/prepare.h"
#include "kda/kernels/kda/scratch.h"
#include "kda/kernels/kda/vec_math.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS {
namespace {

constexpr int kStrip = 64;    // state columns per strip
constexpr int kTokBlock = 8;  // tokens whose q, k, exp(g) are prepared at once (prefill through here)
// States in the last-level cache are not prefetched: from there the hardware prefetchers keep up, and
// the software prefetches of the next strip only compete with the current strip's misses. States in
// memory are: the prefetch runs a strip ahead of the hardware's (interleaved runs showed it faster for
// states in memory, at batch 1 and 64, and slower for states in L3).
// With StateLocality::Auto, a call whose states total at most this much (half of the 32 MB L3 of a
// Zen 4 / Zen 5 CCD) is taken to find them in the cache.
constexpr int64_t kCacheResidentBytes = int64_t{16} << 20;

thread_local ScratchBuffer tl_prep;   // [kTokBlock][5][Kp]: scale q-hat, k-hat, exp(g), k-hat exp(g), g
thread_local ScratchBuffer tl_state;  // [K, V] private state, when the slot is not updated in place
thread_local ScratchBuffer tl_tree;   // [T_seq, K, V] every token's state of a tree (KdaArgs::parents)

// One token's inputs for the strip kernel, columns relative to the strip start.
struct Tok {
  const float* q;   // [K] scale * q-hat
  const float* k;   // [K] k-hat
  const float* e;   // [K] exp(g)
  const float* ke;  // [K] k-hat * exp(g)
  const float* v;   // [V] row of v
  float* o;         // [V] row of o
  float beta;
};

#if defined(KDA_ISA_AVX512)

inline void prefetch_rows(const float* pf, int64_t ldp, int d, int lines) {
  const char* p = reinterpret_cast<const char*>(pf + d * ldp);
  for (int l = 0; l < lines; ++l) _mm_prefetch(p + 64 * l, _MM_HINT_T0);
}

// One token on columns [0, 16 * NV) of a strip: reads the state from src (row stride lds), writes it to
// dst (row stride ldd; may equal src). With Tail, the last vector holds only the columns in `tail`.
// pf, when set, is the next strip to be read (row stride ldp, `lines` cache lines per row), prefetched
// one row per row here so the loads are spread over the pass.
template <int NV, bool Tail>
inline void strip_token(const float* src, int64_t lds, float* dst, int64_t ldd, int K, const Tok& t, int j0,
                        __mmask16 tail, const float* pf, int64_t ldp, int lines) {
  constexpr int R = 2;
  auto load = [&](const float* p, int n) {
    return (Tail && n == NV - 1) ? _mm512_maskz_loadu_ps(tail, p + 16 * n) : _mm512_loadu_ps(p + 16 * n);
  };
  auto store = [&](float* p, int n, __m512 x) {
    if (Tail && n == NV - 1) {
      _mm512_mask_storeu_ps(p + 16 * n, tail, x);
    } else {
      _mm512_storeu_ps(p + 16 * n, x);
    }
  };
  // R accumulator sets (one per row of a group of R rows) so that R * NV independent FMA chains cover
  // the FMA latency.
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) acc[r][n] = _mm512_setzero_ps();
  int d = 0;
  for (; d + R <= K; d += R) {
    for (int r = 0; r < R; ++r) {
      const float* row = src + (d + r) * lds;
      const __m512 c = _mm512_set1_ps(t.ke[d + r]);
      for (int n = 0; n < NV; ++n) acc[r][n] = _mm512_fmadd_ps(c, load(row, n), acc[r][n]);
      if (pf != nullptr) prefetch_rows(pf, ldp, d + r, lines);
    }
  }
  for (; d < K; ++d) {
    const __m512 c = _mm512_set1_ps(t.ke[d]);
    for (int n = 0; n < NV; ++n) acc[0][n] = _mm512_fmadd_ps(c, load(src + d * lds, n), acc[0][n]);
    if (pf != nullptr) prefetch_rows(pf, ldp, d, lines);
  }
  __m512 u[NV];
  const __m512 b = _mm512_set1_ps(t.beta);
  for (int n = 0; n < NV; ++n) {
    __m512 y = acc[0][n];
    for (int r = 1; r < R; ++r) y = _mm512_add_ps(y, acc[r][n]);
    u[n] = _mm512_mul_ps(b, _mm512_sub_ps(load(t.v + j0, n), y));
  }

  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) acc[r][n] = _mm512_setzero_ps();
  // Pass 2 walks the rows backwards. At V = 128 a strip puts 16 lines (the rows d, d+8, ...) in each
  // L1 set it touches, which has 12 ways (8 on Zen 4): after pass 1 only the last rows are in L1, so
  // pass 2 starts with them (backwards: 3/4 of its loads hit L1 on Zen 5, 1/2 on Zen 4; forwards: few
  // do, LRU evicts each row just before it is needed; backwards measured faster per head in L2).
  auto row_of = [K](int i) { return K - 1 - i; };
  int i = 0;
  for (; i + R <= K; i += R) {
    for (int r = 0; r < R; ++r) {
      const int dd = row_of(i + r);
      const float* row = src + dd * lds;
      float* out = dst + dd * ldd;
      const __m512 e = _mm512_set1_ps(t.e[dd]), k = _mm512_set1_ps(t.k[dd]), q = _mm512_set1_ps(t.q[dd]);
      for (int n = 0; n < NV; ++n) {
        const __m512 x = _mm512_fmadd_ps(e, load(row, n), _mm512_mul_ps(k, u[n]));
        store(out, n, x);
        acc[r][n] = _mm512_fmadd_ps(q, x, acc[r][n]);
      }
    }
  }
  for (; i < K; ++i) {
    const int dd = row_of(i);
    const __m512 e = _mm512_set1_ps(t.e[dd]), k = _mm512_set1_ps(t.k[dd]), q = _mm512_set1_ps(t.q[dd]);
    for (int n = 0; n < NV; ++n) {
      const __m512 x = _mm512_fmadd_ps(e, load(src + dd * lds, n), _mm512_mul_ps(k, u[n]));
      store(dst + dd * ldd, n, x);
      acc[0][n] = _mm512_fmadd_ps(q, x, acc[0][n]);
    }
  }
  for (int n = 0; n < NV; ++n) {
    __m512 y = acc[0][n];
    for (int r = 1; r < R; ++r) y = _mm512_add_ps(y, acc[r][n]);
    store(t.o + j0, n, y);
  }
}

// Columns [j0, j0 + nr) of the state, nr <= kStrip.
inline void strip(const float* src, int64_t lds, float* dst, int64_t ldd, int K, const Tok& t, int j0, int nr,
                  const float* pf, int64_t ldp, int lines) {
  if (nr == kStrip) {
    strip_token<kStrip / 16, false>(src, lds, dst, ldd, K, t, j0, 0xFFFF, pf, ldp, lines);
    return;
  }
  const __mmask16 tail = (nr % 16 == 0) ? 0xFFFF : static_cast<__mmask16>((1u << (nr % 16)) - 1);
  switch ((nr + 15) / 16) {
    case 1:
      strip_token<1, true>(src, lds, dst, ldd, K, t, j0, tail, pf, ldp, lines);
      break;
    case 2:
      strip_token<2, true>(src, lds, dst, ldd, K, t, j0, tail, pf, ldp, lines);
      break;
    case 3:
      strip_token<3, true>(src, lds, dst, ldd, K, t, j0, tail, pf, ldp, lines);
      break;
    default:
      strip_token<4, true>(src, lds, dst, ldd, K, t, j0, tail, pf, ldp, lines);
      break;
  }
}

#else  // Portable fallback (the portable and AVX2 copies): the same strip walk, plain loops.

inline void strip(const float* src, int64_t lds, float* dst, int64_t ldd, int K, const Tok& t, int j0, int nr,
                  const float*, int64_t, int) {
  float acc[kStrip], u[kStrip];
  for (int j = 0; j < nr; ++j) acc[j] = 0.0f;
  for (int d = 0; d < K; ++d) {
    const float* s = src + d * lds;
    const float c = t.ke[d];
#pragma omp simd
    for (int j = 0; j < nr; ++j) acc[j] += c * s[j];
  }
  for (int j = 0; j < nr; ++j) u[j] = t.beta * (t.v[j0 + j] - acc[j]);
  for (int j = 0; j < nr; ++j) acc[j] = 0.0f;
  for (int d = 0; d < K; ++d) {
    const float* s = src + d * lds;
    float* w = dst + d * ldd;
    const float ed = t.e[d], kd = t.k[d], qd = t.q[d];
#pragma omp simd
    for (int j = 0; j < nr; ++j) {
      const float x = ed * s[j] + kd * u[j];
      w[j] = x;
      acc[j] += qd * x;
    }
  }
  for (int j = 0; j < nr; ++j) t.o[j0 + j] = acc[j];
}

#endif

struct Item {
  int64_t bos = 0, eos = 0;
  float* pool = nullptr;  // this head's state in its slot, or null (no pool, or a padded row)
  bool padded = false;
  bool has_init = false;              // the slot is read
  const KdaSnapshot* snap = nullptr;  // the sequence's snapshots [snap, snap_end), by position
  const KdaSnapshot* snap_end = nullptr;
};

Item item_of(const KdaArgs& a, const SnapshotPlan& plan, int64_t i, int h) {
  Item it;
  it.snap = plan.first(i);
  it.snap_end = plan.last(i);
  if (a.cu_seqlens != nullptr) {
    it.bos = a.cu_seqlens[i];
    it.eos = a.cu_seqlens[i + 1];
  } else {
    it.bos = i * (a.T / a.N);
    it.eos = it.bos + a.T / a.N;
  }
  const int64_t slot = a.state_indices != nullptr ? a.state_indices[i] : i;
  it.padded = slot < 0;
  if (!it.padded && a.state != nullptr) {
    it.pool = a.state + (slot * a.H + h) * static_cast<int64_t>(a.K) * a.V;
    it.has_init = a.has_initial_state == nullptr || a.has_initial_state[i] != 0;
  }
  return it;
}

// q-hat (times scale), k-hat, exp(g) and k-hat exp(g) of token t, head h, into p[0..4*Kp); g itself
// (which the recurrence does not use) into p[4*Kp..5*Kp).
void prepare_token(const KdaArgs& a, const prep::HeadPrep& hp, int64_t t, int h, int Kp,
                   float* __restrict p) {
  const int K = a.K;
  const int64_t qs = a.q_stride > 0 ? a.q_stride : static_cast<int64_t>(a.H) * K;
  const int64_t ks = a.k_stride > 0 ? a.k_stride : static_cast<int64_t>(a.H) * K;
  const int64_t gs = a.g_stride > 0 ? a.g_stride : static_cast<int64_t>(a.H) * K;
  float* __restrict k = p + Kp;
  float* __restrict e = p + 2 * Kp;
  float* __restrict ke = p + 3 * Kp;
  prep::prepare_row(hp, a.q + t * qs + h * K, a.k + t * ks + h * K, a.g + t * gs + h * K, p, k, p + 4 * Kp,
                    e);
#pragma omp simd
  for (int d = 0; d < K; ++d) ke[d] = k[d] * e[d];
}

// Head h's state S into the slots of the snapshots [*s, e) at position `pos`; advances *s.
void take_snapshots(const KdaArgs& a, const KdaSnapshot*& s, const KdaSnapshot* e, int64_t pos, int h,
                    const float* S) {
  const size_t kv = static_cast<size_t>(a.K) * a.V;
  for (; s != e && s->pos == pos; ++s) std::memcpy(snapshot_head(a, *s, h), S, kv * sizeof(float));
}

// A tree (KdaArgs::parents) on head h: token j's state, in tl_tree row j, is its parent's row (or the
// initial state) advanced by the token, strip by strip as in the chain; snapshots and the final state
// are copied from the rows once every token is done. Verification trees are a few tokens, so the rows
// stay in L2, and the slot itself is only read.
void process_tree(const KdaArgs& a, int h, float scale, const Item& it) {
  const int K = a.K, V = a.V, H = a.H;
  const size_t kv = static_cast<size_t>(K) * V;
  const int64_t len = it.eos - it.bos;
  float* rows_state = tl_tree.get(static_cast<size_t>(std::max<int64_t>(len, 1)) * kv);
  const float* init = it.pool;
  if (!it.has_init) {
    float* z = tl_state.get(kv);
    std::memset(z, 0, kv * sizeof(float));
    init = z;
  }
  const prep::HeadPrep hp = prep::head_prep(a, h, scale);
  const int Kp = (K + 15) / 16 * 16;
  float* rows = tl_prep.get(static_cast<size_t>(kTokBlock) * 5 * Kp);
  const int64_t vs = a.v_stride > 0 ? a.v_stride : static_cast<int64_t>(H) * V;
  int nt = 0;
  for (int64_t t0 = it.bos; t0 < it.eos; t0 += nt) {
    nt = static_cast<int>(std::min<int64_t>(kTokBlock, it.eos - t0));
    Tok tok[kTokBlock];
    for (int r = 0; r < nt; ++r) {
      const int64_t t = t0 + r;
      float* p = rows + static_cast<size_t>(r) * 5 * Kp;
      prepare_token(a, hp, t, h, Kp, p);
      tok[r] = {
          p, p + Kp, p + 2 * Kp, p + 3 * Kp, a.v + t * vs + h * V, a.o + (t * H + h) * V, a.beta[t * H + h]};
    }
    for (int j0 = 0; j0 < V; j0 += kStrip) {
      const int nr = std::min(kStrip, V - j0);
      for (int r = 0; r < nt; ++r) {
        const int64_t j = t0 + r - it.bos;
        const int32_t par = a.parents[t0 + r];
        const float* src = par < 0 ? init : rows_state + static_cast<size_t>(par) * kv;
        strip(src + j0, V, rows_state + static_cast<size_t>(j) * kv + j0, V, K, tok[r], j0, nr, nullptr, V,
              0);
      }
    }
  }
  // The state after position pos: the initial state at 0, else token pos-1's row.
  const auto after = [&](int64_t pos) {
    return pos == 0 ? init : rows_state + static_cast<size_t>(pos - 1) * kv;
  };
  for (const KdaSnapshot* s = it.snap; s != it.snap_end; ++s)
    std::memcpy(snapshot_head(a, *s, h), after(s->pos), kv * sizeof(float));
  if (it.pool != nullptr && a.output_final_state && after(len) != it.pool)
    std::memcpy(it.pool, after(len), kv * sizeof(float));
}

void process_item(const KdaArgs& a, int h, float scale, const Item& it, const Item* next, bool prefetch) {
  const int K = a.K, V = a.V, H = a.H;
  if (it.padded) {  // zero output, the pool is not touched
    for (int64_t t = it.bos; t < it.eos; ++t) std::memset(a.o + (t * H + h) * V, 0, V * sizeof(float));
    return;
  }
  if (a.parents != nullptr) {
    process_tree(a, h, scale, it);
    return;
  }
  const size_t kv = static_cast<size_t>(K) * V;
  const bool in_place = it.pool != nullptr && a.output_final_state;
  // dst holds the state between tokens; src is where the first token reads it from.
  float* dst = in_place ? it.pool : tl_state.get(kv);
  const float* src = it.has_init ? it.pool : dst;
  if (!it.has_init) std::memset(dst, 0, kv * sizeof(float));
  const KdaSnapshot* snap = it.snap;
  take_snapshots(a, snap, it.snap_end, 0, h, src);
  if (it.eos == it.bos) return;

  const prep::HeadPrep hp = prep::head_prep(a, h, scale);
  const int Kp = (K + 15) / 16 * 16;
  float* rows = tl_prep.get(static_cast<size_t>(kTokBlock) * 5 * Kp);
  const int64_t vs = a.v_stride > 0 ? a.v_stride : static_cast<int64_t>(H) * V;
  // Prefetch only what will come from the pool: the next strip of this slot, then the next head's.
  const bool prefetch_own = prefetch && it.has_init;
  const float* next_pool =
      (prefetch && next != nullptr && next->has_init && next->eos > next->bos) ? next->pool : nullptr;
  int nt = 0;
  for (int64_t t0 = it.bos; t0 < it.eos; t0 += nt) {
    // Token blocks end at snapshot positions too (the state after each token is the same whatever the
    // blocks: they only batch step 1).
    int64_t t1 = std::min<int64_t>(kTokBlock, it.eos - t0) + t0;
    if (snap != it.snap_end && it.bos + snap->pos < t1) t1 = it.bos + snap->pos;
    nt = static_cast<int>(t1 - t0);
    Tok tok[kTokBlock];
    for (int r = 0; r < nt; ++r) {
      const int64_t t = t0 + r;
      float* p = rows + static_cast<size_t>(r) * 5 * Kp;
      prepare_token(a, hp, t, h, Kp, p);
      tok[r] = {
          p, p + Kp, p + 2 * Kp, p + 3 * Kp, a.v + t * vs + h * V, a.o + (t * H + h) * V, a.beta[t * H + h]};
    }
    const bool first_block = t0 == it.bos;
    const bool last_block = t0 + nt == it.eos;
    for (int j0 = 0; j0 < V; j0 += kStrip) {
      const int nr = std::min(kStrip, V - j0);
      const float* pf = nullptr;
      int lines = 0;
      if (j0 + kStrip < V) {
        if (first_block && prefetch_own) {
          pf = it.pool + j0 + kStrip;
          lines = (std::min(kStrip, V - j0 - kStrip) + 15) / 16;
        }
      } else if (last_block && next_pool != nullptr) {
        pf = next_pool;
        lines = (std::min(kStrip, V) + 15) / 16;
      }
      for (int r = 0; r < nt; ++r) {
        const bool from_src = first_block && r == 0;
        strip(from_src ? src + j0 : dst + j0, V, dst + j0, V, K, tok[r], j0, nr, r == 0 ? pf : nullptr, V,
              lines);
      }
    }
    take_snapshots(a, snap, it.snap_end, t1 - it.bos, h, dst);
  }
  if (it.pool != nullptr && a.output_final_state && dst != it.pool)
    std::memcpy(it.pool, dst, kv * sizeof(float));
}

}  // namespace

void fused_recurrent_kda_opt(const KdaArgs& args) {
  // bf16 q, k, v or g (not what the layer hands this kernel: its decode conv output is fp32) read as fp32.
  thread_local std::vector<float> widened;
  const KdaArgs a = with_f32_inputs(args, widened);
  const float scale = a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(a.K));
  const int H = a.H;
  // Static, contiguous ranges: the items cost the same (decode) and each thread knows its next state.
  const int64_t items = a.N * H;
  if (items == 0) return;
  const SnapshotPlan plan = plan_snapshots(a);  // allocated here, outside the parallel region
  using Loc = KdaArgs::StateLocality;
  const bool prefetch = a.state_locality == Loc::Memory ||
                        (a.state_locality == Loc::Auto &&
                         items * a.K * a.V * static_cast<int64_t>(sizeof(float)) > kCacheResidentBytes);
  // The per-thread scratch may fail to grow (a tree keeps T_seq states): no exception leaves the region,
  // the first one is rethrown after it.
  std::exception_ptr error;
#pragma omp parallel if (items > 1)
  {
    try {
      const int64_t nth = omp_get_num_threads(), th = omp_get_thread_num();
      const int64_t lo = items * th / nth, hi = items * (th + 1) / nth;
      if (lo < hi) {
        Item cur = item_of(a, plan, lo / H, static_cast<int>(lo % H));
        for (int64_t x = lo; x < hi; ++x) {
          Item next;
          const bool has_next = x + 1 < hi;
          if (has_next) next = item_of(a, plan, (x + 1) / H, static_cast<int>((x + 1) % H));
          process_item(a, static_cast<int>(x % H), scale, cur, has_next ? &next : nullptr, prefetch);
          cur = next;
        }
      }
    } catch (...) {
#pragma omp critical(kda_fused_recurrent_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace kda::kernels::KDA_ISA_NS
KDA_ISA_POP
