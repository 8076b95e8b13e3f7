// chunk_kda_opt: the chunked WY form (spec "Chunked form", C = 64) organised for speed. This file holds
// the entry point and the scheduling of work; each step of a chunk has its own file (chunk/common.h
// lists them), and the ISA-specific bodies are under arch/.
//
// Work items are (sequence, group of up to 4 heads), handed to OpenMP threads dynamically (one long
// sequence still has H / 4 items, so both cores work on it); the heads of a group advance chunk by chunk
// together, so each token row's pages and cache lines serve all of them. Each thread keeps one aligned
// scratch buffer across calls, so nothing is allocated per chunk. Per chunk of L <= 64 rows of one head,
// in blocks of 16 rows:
//   1. q-hat (scale folded in), k-hat, g (gate fused), exp(g) and beta into contiguous fp32 rows (q, k,
//      v and g are read as they come, fp32 or bf16);                                     chunk/stager.h
//   2. decays. Every decay exp(Gamma_r - Gamma_s), r >= s, is a product of at most three factors, each
//      <= 1 and each built over exactly the rows it spans: a running product of the per-step factors
//      exp(g_i) inside one block (at most 15 of them) and, across blocks, exp of a running sum taken at
//      block boundaries. No positive exponent and no difference of two cumulative sums is ever formed;
//                                                                                         chunk/gate.cc
//   3. Aqk and Akk: blocks below the diagonal as products (q_r * rowdecay) . (k_s * coldecay) with the
//      factors above, diagonal blocks pair by pair (k_s times the running product of exp(g_i));
//                                                                                        chunk/intra.cc
//   4. T = (I + Akk)^-1: the 16 x 16 diagonal blocks by forward substitution, the rest as products;
//   5. R = beta V - (beta K * exp(Gamma)) S, Vn = T R;                                      chunk/wy.cc
//   6. O = (Q * exp(Gamma)) S + Aqk Vn, written straight into o;                        chunk/output.cc
//   7. S <- diag(exp(Gamma_last)) S + (K * exp(Gamma_last - Gamma))^T Vn, in the pool slot when possible.
//                                                                                   chunk/state_pass.cc
// Snapshots (KdaArgs::snapshots) leave the chunk grid (the multiples of 64 from a sequence's start) as it
// is: a snapshot inside a chunk is the final state of a side chunk over the chunk's rows before it, the
// last chunk of a run that ends there (chunk/snapshots.h).
//
// Steps 3-7 are products C = init + A B run by one register-blocked micro-kernel (chunk/gemm.cc).
// While a chunk computes, step 1 of the next (chunk, head) runs a row at a time between its micro-tiles,
// each row prefetched a line at a time during the tiles before, at the pace of their work (see Stager).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>  // _mm_getcsr / _mm_setcsr
#endif

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/chunk/common.h"
#include "kda/kernels/kda/chunk/snapshots.h"
#include "kda/kernels/kda/chunk/stager.h"
#include "kda/kernels/kda/impl.h"
#include "kda/kernels/kda/prepare.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS {
namespace {

using namespace chunk;  // this file drives the chunk's steps

// Row strides of the inputs (elements between consecutive tokens).
struct Strides {
  int64_t q, k, v, g;
};

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
  pf.start({prep::head_prep(a, h, scale),
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
  wy_residual(K, V, L, S, w);

  // Step 1 of the next unit runs during the rest of the chunk (R has read this chunk's v and B; Q, Kh, G,
  // E are dead), spread over the full micro-tiles.
  Stager pf;
  if (next.t0 >= 0) plan_stage(a, st, next.h, next.t0, next.rows, scale, w, pf);

  wy_values(V, L, w, pf);
  chunk_output(K, V, L, S, w, a.o + c0 * ldo + h * V, ldo, pf);
  state_pass(K, V, L, S, w, pf);
  pf.finish();
}

// First chunk of work item `item` (sequence item / groups, heads of group item % groups), or none.
Next first_unit(const KdaArgs& a, int64_t item, int64_t groups, int group) {
  Next n;
  if (item < 0) return n;
  const int64_t i = item / groups;
  const auto [bos, eos] = segment(a, i);
  const int64_t slot = a.state_indices != nullptr ? a.state_indices[i] : i;
  if (slot < 0 || eos <= bos) return n;
  n.t0 = bos;
  n.h = static_cast<int>(item % groups) * group;
  n.rows = static_cast<int>(chunk_end(bos, eos, bos) - bos);
  return n;
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

  // Snapshots: at position 0 the initial states; at a chunk boundary the states there; inside a chunk
  // the final states of a side chunk over its first rows (chunk/snapshots.h).
  const KdaSnapshot *snap = plan.first(i), *const snap_end = plan.last(i);
  take_snapshots(a, snap, snap_end, 0, h0, h1, states);
  for (int64_t c0 = bos; c0 < eos;) {
    const int64_t c1 = chunk_end(bos, eos, c0);
    const int L = static_cast<int>(c1 - c0);
    while (snap != snap_end && bos + snap->pos < c1) {
      const int P = static_cast<int>(bos + snap->pos - c0);  // >= 1: those at c0 were taken
      for (int h = h0; h < h1; ++h) {
        float* S = snapshot_head(a, *snap, h);
        std::memcpy(S, states[h - h0], kv * sizeof(float));
        w.staged_t0 = -1;  // staged rows (if any) were the whole chunk's; the side chunk stages its own
        process_chunk(a, st, h, c0, P, S, Next{}, scale, w);
      }
      w.staged_t0 = -1;  // the side chunk's steps used the staging buffers
      copy_snapshot_to_twins(a, snap, snap_end, h0, h1);
    }
    for (int h = h0; h < h1; ++h) {
      Next next;
      if (h + 1 < h1) {
        next = {c0, h + 1, L};
      } else if (c1 < eos) {
        next = {c1, h0, static_cast<int>(chunk_end(bos, eos, c1) - c1)};
      } else {
        next = first_unit(a, claim.get(), groups, group);
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
// the core's multiplies and FMAs are slow (the whole kernel measured faster with subnormals flushed,
// most on the heads with the strongest gates); a flushed value is below 1.2e-38, far under the fp32
// tolerance of any output. The caller's MXCSR is restored.
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
  // staging: for one 4096-token sequence on 2 threads, groups of 4 measured faster than groups of 2,
  // and faster than items shrinking to single heads at the end of a call, which only won when one of
  // the threads ran at half speed).
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
