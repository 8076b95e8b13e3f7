// chunk_kda_opt's chunk grid and snapshots (KdaArgs::snapshots). The grid is the multiples of 64 from a
// sequence's start and its end, whatever the snapshots: a snapshot at a chunk boundary copies the state
// there; one inside a chunk [c0, c1), at c0 + P, is the final state of a side chunk over rows [c0, c0 + P)
// from the state at c0 -- the last chunk of a run over the sequence's first tokens that ends there, so the
// snapshot is bit for bit that run's final state, and the sequence's own outputs and final state are
// those of a call without snapshots (as the reference kernels' are). The side chunk costs one partial
// chunk per interior snapshot; before, the grid ended a chunk at every snapshot instead, which moved the
// request's own rows by fp32 rounding whenever the scheduler took a snapshot for another request.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/chunk/common.h"
#include "kda/kernels/kda/impl.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

// The end of the chunk that starts at c0, on the grid of the sequence [bos, eos).
inline int64_t chunk_end(int64_t bos, int64_t eos, int64_t c0) {
  return std::min(eos, bos + ((c0 - bos) / kChunk + 1) * kChunk);
}

// Heads [h0, h1) of `states` into the slots of the snapshots [*s, e) at position `pos`; advances *s.
inline void take_snapshots(const KdaArgs& a, const KdaSnapshot*& s, const KdaSnapshot* e, int64_t pos, int h0,
                           int h1, float* const* states) {
  const size_t kv = static_cast<size_t>(a.K) * a.V;
  for (; s != e && s->pos == pos; ++s) {
    for (int h = h0; h < h1; ++h) std::memcpy(snapshot_head(a, *s, h), states[h - h0], kv * sizeof(float));
  }
}

// Snapshot *s's heads [h0, h1), just computed in its slot, into the slots of the snapshots after it at the
// same position; advances *s past them all.
inline void copy_snapshot_to_twins(const KdaArgs& a, const KdaSnapshot*& s, const KdaSnapshot* e, int h0,
                                   int h1) {
  const size_t kv = static_cast<size_t>(a.K) * a.V;
  const KdaSnapshot& first = *s;
  for (++s; s != e && s->pos == first.pos; ++s) {
    for (int h = h0; h < h1; ++h)
      std::memcpy(snapshot_head(a, *s, h), snapshot_head(a, first, h), kv * sizeof(float));
  }
}

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
