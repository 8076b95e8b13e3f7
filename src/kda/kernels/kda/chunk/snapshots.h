// chunk_kda_opt's chunk grid and snapshots (KdaArgs::snapshots): a sequence's chunks end at its snapshot
// positions too, besides the multiples of 64 from its start (a short chunk is a chunk of the chunked form
// like a sequence's last one), and the state at such a boundary is copied into the snapshot's slot: no
// second pass.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/chunk/common.h"
#include "kda/kernels/kda/impl.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

// A sequence's chunk grid: the multiples of C from its start, its end, and its snapshot positions (a
// chunk ends at each, so that the state there is a chunk boundary's). `snap` is the sequence's first
// snapshot with a position beyond c0 (they come sorted by position).
inline int64_t chunk_end(int64_t bos, int64_t eos, int64_t c0, const KdaSnapshot* snap,
                         const KdaSnapshot* snap_end) {
  int64_t e = std::min(eos, bos + ((c0 - bos) / kChunk + 1) * kChunk);
  if (snap != snap_end && bos + snap->pos < e) e = bos + snap->pos;
  return e;
}

// The first of [s, e) with a position beyond `pos`.
inline const KdaSnapshot* snapshots_after(const KdaSnapshot* s, const KdaSnapshot* e, int64_t pos) {
  while (s != e && s->pos <= pos) ++s;
  return s;
}

// Heads [h0, h1) of `states` into the slots of the snapshots [*s, e) at position `pos`; advances *s.
inline void take_snapshots(const KdaArgs& a, const KdaSnapshot*& s, const KdaSnapshot* e, int64_t pos, int h0,
                           int h1, float* const* states) {
  const size_t kv = static_cast<size_t>(a.K) * a.V;
  for (; s != e && s->pos == pos; ++s) {
    for (int h = h0; h < h1; ++h) std::memcpy(snapshot_head(a, *s, h), states[h - h0], kv * sizeof(float));
  }
}

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
