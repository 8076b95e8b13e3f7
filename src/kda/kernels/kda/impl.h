// The KDA kernels behind the dispatcher (kda.h): the reference, and the optimized kernels compiled once
// per ISA (isa_target.h), each copy in its ISA's namespace. Private to the library and its tests.
#pragma once

#include <vector>

#include "kda/common/isa.h"
#include "kda/kernels/kda/kda.h"

namespace kda::kernels {

// bf16 inputs widened: `a` itself when its q, k, v and g are fp32, else a copy of `a` whose bf16 ones
// (q, k, v and/or g) are replaced by dense fp32 rows written into `buf`.
KdaArgs with_f32_inputs(const KdaArgs& a, std::vector<float>& buf);

// A call's snapshots grouped by sequence, each sequence's in increasing pos (ties in the caller's
// order). Built by the kernels before their parallel regions; empty (nothing allocated) without
// snapshots. Its special members are defined in dispatch.cc, the accessors read plain pointers: no
// std::vector code is instantiated inside the per-ISA regions, where it would be compiled for that ISA
// and could be the copy the linker keeps for every caller.
class SnapshotPlan {
 public:
  SnapshotPlan();
  SnapshotPlan(SnapshotPlan&& o) noexcept;
  SnapshotPlan& operator=(SnapshotPlan&&) = delete;
  ~SnapshotPlan();

  // Sequence i's snapshots [first(i), last(i)); null, null without snapshots.
  const KdaSnapshot* first(int64_t i) const { return base_ == nullptr ? nullptr : base_ + offsets_[i]; }
  const KdaSnapshot* last(int64_t i) const { return base_ == nullptr ? nullptr : base_ + offsets_[i + 1]; }

 private:
  friend SnapshotPlan plan_snapshots(const KdaArgs& a);
  std::vector<KdaSnapshot> sorted_;
  std::vector<int64_t> start_;  // [N+1] offsets into sorted_, or empty
  const KdaSnapshot* base_ = nullptr;
  const int64_t* offsets_ = nullptr;
};
SnapshotPlan plan_snapshots(const KdaArgs& a);

// Head h's [K, V] state in snapshot s's slot.
inline float* snapshot_head(const KdaArgs& a, const KdaSnapshot& s, int h) {
  return a.snapshot_state + (static_cast<int64_t>(s.slot) * a.H + h) * static_cast<int64_t>(a.K) * a.V;
}

// Reference kernels: plain loops, fp32, written for clarity (fla's naive.py).
void chunk_kda_naive(const KdaArgs& a);
void fused_recurrent_kda_naive(const KdaArgs& a);

// Optimized kernels, same signature and semantics, one copy per ISA; only the copies of the ISAs in
// the build are defined (isa_compiled), and only those the CPU runs may be called (isa_available).
namespace portable {
void chunk_kda_opt(const KdaArgs& a);
void fused_recurrent_kda_opt(const KdaArgs& a);
}  // namespace portable
namespace avx2 {
void chunk_kda_opt(const KdaArgs& a);
void fused_recurrent_kda_opt(const KdaArgs& a);
}  // namespace avx2
namespace avx512 {
void chunk_kda_opt(const KdaArgs& a);
void fused_recurrent_kda_opt(const KdaArgs& a);
}  // namespace avx512

// The copy for `isa` (std::invalid_argument unless available), and the fastest one (best_isa()).
using KernelFn = void (*)(const KdaArgs&);
KernelFn chunk_kda_opt_for(Isa isa);
KernelFn fused_recurrent_kda_opt_for(Isa isa);
void chunk_kda_opt(const KdaArgs& a);
void fused_recurrent_kda_opt(const KdaArgs& a);

}  // namespace kda::kernels
