// Argument validation and the kernel dispatcher (RFC §4.2): which kernel, and for the optimized ones
// which ISA's copy, a call runs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kda/kernels/kda/impl.h"

namespace kda::kernels {
namespace {

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("kda: " + what); }

std::string str(int64_t x) { return std::to_string(x); }

}  // namespace

namespace {

// Token count of sequence i (the arguments' sequences already checked).
int64_t seq_len(const KdaArgs& a, int64_t i) {
  if (a.cu_seqlens != nullptr) return static_cast<int64_t>(a.cu_seqlens[i + 1]) - a.cu_seqlens[i];
  return a.T / a.N;
}

// Pool slot of sequence i, or -1 for a padded row.
int64_t slot_of(const KdaArgs& a, int64_t i) { return a.state_indices != nullptr ? a.state_indices[i] : i; }

void validate_snapshots(const KdaArgs& a) {
  if (a.num_snapshots < 0) fail("num_snapshots must be >= 0 (got " + str(a.num_snapshots) + ")");
  if (a.num_snapshots == 0) return;
  if (a.snapshots == nullptr) fail("snapshots is null with num_snapshots=" + str(a.num_snapshots));
  if (a.snapshot_state == nullptr) fail("snapshot_state is null with num_snapshots=" + str(a.num_snapshots));
  if (a.num_snapshot_slots < 0) fail("num_snapshot_slots must be >= 0");
  std::vector<std::pair<int32_t, int64_t>> slots;
  slots.reserve(static_cast<size_t>(a.num_snapshots));
  for (int64_t j = 0; j < a.num_snapshots; ++j) {
    const KdaSnapshot& s = a.snapshots[j];
    const std::string at = "snapshot " + str(j) + ": ";
    if (s.seq < 0 || s.seq >= a.N) fail(at + "seq=" + str(s.seq) + " not in [0, N=" + str(a.N) + ")");
    if (slot_of(a, s.seq) < 0) fail(at + "sequence " + str(s.seq) + " is a padded row (state index -1)");
    const int64_t len = seq_len(a, s.seq);
    if (s.pos < 0 || s.pos > len)
      fail(at + "pos=" + str(s.pos) + " not in [0, " + str(len) + "] (sequence " + str(s.seq) + " has " +
           str(len) + " tokens)");
    if (s.slot < 0 || s.slot >= a.num_snapshot_slots)
      fail(at + "slot=" + str(s.slot) + " not in [0, num_snapshot_slots=" + str(a.num_snapshot_slots) + ")");
    slots.emplace_back(s.slot, j);
  }
  std::sort(slots.begin(), slots.end());
  for (size_t j = 1; j < slots.size(); ++j) {
    if (slots[j].first == slots[j - 1].first) {
      fail("duplicate snapshot slot " + str(slots[j].first) + " used by snapshots " +
           str(slots[j - 1].second) + " and " + str(slots[j].second));
    }
  }
  // In the pool itself: a snapshot slot must not be a slot this call reads or writes.
  if (a.snapshot_state == a.state) {
    for (int64_t i = 0; i < a.N; ++i) {
      const int64_t slot = slot_of(a, i);
      if (slot < 0) continue;
      const auto it = std::lower_bound(slots.begin(), slots.end(), std::pair<int32_t, int64_t>(slot, -1));
      if (it != slots.end() && it->first == slot) {
        fail("snapshot " + str(it->second) + ": slot " + str(slot) + " is the state slot of sequence " +
             str(i) + " (snapshot_state is the state pool)");
      }
    }
  }
}

void validate_core(const KdaArgs& a);

// Tree parents: each token's parent is -1 or an earlier token of its own sequence.
void validate_parents(const KdaArgs& a) {
  if (a.parents == nullptr) return;
  for (int64_t i = 0; i < a.N; ++i) {
    const int64_t bos = a.cu_seqlens != nullptr ? a.cu_seqlens[i] : i * (a.T / a.N);
    const int64_t len = seq_len(a, i);
    for (int64_t j = 0; j < len; ++j) {
      const int32_t p = a.parents[bos + j];
      if (p < -1 || p >= j)
        fail("parents[" + str(bos + j) + "]=" + str(p) + ": token " + str(j) + " of sequence " + str(i) +
             " must name an earlier token of its sequence (0.." + str(j - 1) +
             ") or -1 (the initial state): a parent comes before its child");
    }
  }
}

}  // namespace

void validate_kda_args(const KdaArgs& a) {
  validate_core(a);
  validate_snapshots(a);
  validate_parents(a);
}

SnapshotPlan::SnapshotPlan() = default;
SnapshotPlan::~SnapshotPlan() = default;
// A moved vector keeps its buffer, so the pointers stay valid.
SnapshotPlan::SnapshotPlan(SnapshotPlan&& o) noexcept
    : sorted_(std::move(o.sorted_)), start_(std::move(o.start_)), base_(o.base_), offsets_(o.offsets_) {
  o.base_ = nullptr;
  o.offsets_ = nullptr;
}

SnapshotPlan plan_snapshots(const KdaArgs& a) {
  SnapshotPlan p;
  if (a.num_snapshots <= 0) return p;
  p.sorted_.assign(a.snapshots, a.snapshots + a.num_snapshots);
  std::stable_sort(p.sorted_.begin(), p.sorted_.end(), [](const KdaSnapshot& x, const KdaSnapshot& y) {
    return x.seq != y.seq ? x.seq < y.seq : x.pos < y.pos;
  });
  p.start_.assign(static_cast<size_t>(a.N + 1), 0);
  for (const KdaSnapshot& s : p.sorted_) ++p.start_[static_cast<size_t>(s.seq) + 1];
  for (int64_t i = 0; i < a.N; ++i) p.start_[i + 1] += p.start_[i];
  p.base_ = p.sorted_.data();
  p.offsets_ = p.start_.data();
  return p;
}

namespace {

void validate_core(const KdaArgs& a) {
  if (a.H <= 0 || a.K <= 0 || a.V <= 0) {
    fail("H, K and V must be positive (H=" + str(a.H) + ", K=" + str(a.K) + ", V=" + str(a.V) + ")");
  }
  if (a.T < 0) fail("T must be >= 0 (T=" + str(a.T) + ")");
  if (a.N < 0) fail("N must be >= 0 (N=" + str(a.N) + ")");
  if (!std::isfinite(a.scale)) fail("scale must be finite");

  // q, k, v in one precision: all fp32 or all bf16.
  const bool any_f32 = a.q || a.k || a.v, any_bf16 = a.q_bf16 || a.k_bf16 || a.v_bf16;
  if (any_f32 && any_bf16) fail("q, k, v are given both as fp32 and as bf16: set one of the two");
  // g in either precision, independently of q, k, v.
  if (a.g && a.g_bf16) fail("g is given both as fp32 (g) and as bf16 (g_bf16): set one of the two");
  // Token tensors are only dereferenced when there are tokens.
  if (a.T > 0) {
    const bool bf16 = any_bf16;
    const std::pair<const void*, const char*> required[] = {
        {bf16 ? static_cast<const void*>(a.q_bf16) : a.q, bf16 ? "q_bf16" : "q"},
        {bf16 ? static_cast<const void*>(a.k_bf16) : a.k, bf16 ? "k_bf16" : "k"},
        {bf16 ? static_cast<const void*>(a.v_bf16) : a.v, bf16 ? "v_bf16" : "v"},
        {a.g_bf16 ? static_cast<const void*>(a.g_bf16) : a.g, "g (or g_bf16)"},
        {a.beta, "beta"},
        {a.o, "o"}};
    for (const auto& [p, name] : required) {
      if (p == nullptr) fail(std::string(name) + " is null with T=" + str(a.T) + " > 0");
    }
  }
  if (a.use_gate_in_kernel && a.A_log == nullptr) fail("use_gate_in_kernel requires A_log");

  // Row strides: 0 (dense) or at least a dense row, so that tokens' rows never overlap.
  const int64_t qk_row = static_cast<int64_t>(a.H) * a.K, v_row = static_cast<int64_t>(a.H) * a.V;
  const std::tuple<int64_t, int64_t, const char*> strides[] = {{a.q_stride, qk_row, "q_stride"},
                                                               {a.k_stride, qk_row, "k_stride"},
                                                               {a.v_stride, v_row, "v_stride"},
                                                               {a.g_stride, qk_row, "g_stride"}};
  for (const auto& [stride, row, name] : strides) {
    if (stride != 0 && stride < row) {
      fail(std::string(name) + " must be 0 (dense) or >= " + str(row) + " (got " + str(stride) + ")");
    }
  }

  if (a.cu_seqlens != nullptr) {
    if (a.N < 1) fail("cu_seqlens needs N >= 1 (N=" + str(a.N) + ")");
    const int32_t* cu = a.cu_seqlens;
    if (cu[0] != 0) fail("cu_seqlens[0] must be 0 (got " + str(cu[0]) + ")");
    for (int64_t i = 1; i <= a.N; ++i) {
      if (cu[i] < cu[i - 1]) {
        fail("non-monotonic cu_seqlens at index " + str(i) + ": " + str(cu[i - 1]) + " > " + str(cu[i]));
      }
    }
    if (cu[a.N] != a.T)
      fail("cu_seqlens[N] != T (cu_seqlens[" + str(a.N) + "]=" + str(cu[a.N]) + ", T=" + str(a.T) + ")");
  } else if (a.N == 0) {
    if (a.T != 0) fail("N=0 sequences but T=" + str(a.T) + " tokens");
  } else if (a.T % a.N != 0) {
    fail("T not divisible by N without cu_seqlens (T=" + str(a.T) + ", N=" + str(a.N) + ")");
  }

  // Slot indices. -1 (padded row) is always allowed; without a pool the other indices are never used,
  // so they are not range-checked, but anything below -1 is a caller bug either way.
  if (a.state_indices != nullptr) {
    for (int64_t i = 0; i < a.N; ++i) {
      const int32_t s = a.state_indices[i];
      if (s < -1 || (a.state != nullptr && s >= a.num_state_slots)) {
        fail("state index out of range: state_indices[" + str(i) + "]=" + str(s) + " not in [0, " +
             str(a.num_state_slots) + ") and not -1");
      }
    }
  }
  if (a.state == nullptr) return;
  if (a.num_state_slots < 0) fail("num_state_slots must be >= 0");
  if (a.state_indices == nullptr) {
    if (a.N > a.num_state_slots) {
      fail("state index out of range: N=" + str(a.N) + " sequences map to slots 0..N-1 but the pool has " +
           str(a.num_state_slots) + " slots");
    }
    return;
  }
  // Two sequences on one slot would race on (and double-update) the same state.
  std::vector<std::pair<int32_t, int64_t>> used;
  used.reserve(static_cast<size_t>(a.N));
  for (int64_t i = 0; i < a.N; ++i) {
    if (a.state_indices[i] >= 0) used.emplace_back(a.state_indices[i], i);
  }
  std::sort(used.begin(), used.end());
  for (size_t j = 1; j < used.size(); ++j) {
    if (used[j].first == used[j - 1].first) {
      fail("duplicate state slot " + str(used[j].first) + " used by sequences " + str(used[j - 1].second) +
           " and " + str(used[j].second));
    }
  }
}

}  // namespace

KdaArgs with_f32_inputs(const KdaArgs& a, std::vector<float>& buf) {
  const bool qkv = a.q_bf16 != nullptr, g = a.g_bf16 != nullptr;
  if (!qkv && !g) return a;
  const int64_t qk = static_cast<int64_t>(a.H) * a.K, vr = static_cast<int64_t>(a.H) * a.V;
  buf.resize(static_cast<size_t>(a.T * ((qkv ? 2 * qk + vr : 0) + (g ? qk : 0))));
  float* next = buf.data();
  // Dense fp32 copy of src's [T, row] rows (stride 0: dense), the next part of buf.
  const auto widen = [&](const bf16_t* src, int64_t stride, int64_t row) {
    float* dst = next;
    next += a.T * row;
    const int64_t ld = stride > 0 ? stride : row;
    for (int64_t t = 0; t < a.T; ++t)
      bf16_to_f32_array(src + t * ld, dst + t * row, static_cast<size_t>(row));
    return dst;
  };
  KdaArgs w = a;
  if (qkv) {
    w.q = widen(a.q_bf16, a.q_stride, qk);
    w.k = widen(a.k_bf16, a.k_stride, qk);
    w.v = widen(a.v_bf16, a.v_stride, vr);
    w.q_bf16 = w.k_bf16 = w.v_bf16 = nullptr;
    w.q_stride = w.k_stride = w.v_stride = 0;
  }
  if (g) {
    w.g = widen(a.g_bf16, a.g_stride, qk);
    w.g_bf16 = nullptr;
    w.g_stride = 0;
  }
  return w;
}

KernelImpl parse_kernel_impl(std::string_view s) {
  for (KernelImpl k : {KernelImpl::Auto, KernelImpl::Naive, KernelImpl::Optimized, KernelImpl::Portable,
                       KernelImpl::Avx2, KernelImpl::Avx512}) {
    if (s == to_string(k)) return k;
  }
  throw std::invalid_argument("kda: unknown kernel implementation '" + std::string(s) +
                              "' (expected auto, naive, optimized, portable, avx2 or avx512)");
}

const char* to_string(KernelImpl k) {
  switch (k) {
    case KernelImpl::Auto:
      return "auto";
    case KernelImpl::Naive:
      return "naive";
    case KernelImpl::Optimized:
      return "optimized";
    case KernelImpl::Portable:
      return "portable";
    case KernelImpl::Avx2:
      return "avx2";
    case KernelImpl::Avx512:
      return "avx512";
  }
  return "unknown";
}

namespace {

// The ISA of an optimized-kernel choice: forced, or the fastest available.
Isa isa_of(KernelImpl impl) {
  switch (impl) {
    case KernelImpl::Portable:
      return Isa::Portable;
    case KernelImpl::Avx2:
      return Isa::Avx2;
    case KernelImpl::Avx512:
      return Isa::Avx512;
    default:
      return best_isa();
  }
}

}  // namespace

// Only the copies in the build are referenced, so that a build without one still links.
KernelFn chunk_kda_opt_for(Isa isa) {
  require_isa(isa);
  switch (isa) {
#if defined(KDA_WITH_AVX512)
    case Isa::Avx512:
      return avx512::chunk_kda_opt;
#endif
#if defined(KDA_WITH_AVX2)
    case Isa::Avx2:
      return avx2::chunk_kda_opt;
#endif
    default:
      return portable::chunk_kda_opt;
  }
}

KernelFn fused_recurrent_kda_opt_for(Isa isa) {
  require_isa(isa);
  switch (isa) {
#if defined(KDA_WITH_AVX512)
    case Isa::Avx512:
      return avx512::fused_recurrent_kda_opt;
#endif
#if defined(KDA_WITH_AVX2)
    case Isa::Avx2:
      return avx2::fused_recurrent_kda_opt;
#endif
    default:
      return portable::fused_recurrent_kda_opt;
  }
}

void chunk_kda_opt(const KdaArgs& a) { chunk_kda_opt_for(best_isa())(a); }
void fused_recurrent_kda_opt(const KdaArgs& a) { fused_recurrent_kda_opt_for(best_isa())(a); }

// The optimized kernels take every valid shape (their loops run over any K and V), so Auto picks them
// as Optimized does; the reference stays reachable through KernelImpl::Naive.
const char* kernel_name(KernelImpl impl) {
  if (impl == KernelImpl::Naive) return "naive";
  const Isa isa = isa_of(impl);
  require_isa(isa);
  return to_string(isa);
}

void chunk_kda(const KdaArgs& a, KernelImpl impl) {
  validate_kda_args(a);
  if (a.parents != nullptr)
    fail("chunk_kda takes no tree parents (KdaArgs::parents): tree drafts go through fused_recurrent_kda");
  if (impl == KernelImpl::Naive) {
    chunk_kda_naive(a);
  } else {
    chunk_kda_opt_for(isa_of(impl))(a);
  }
}

void fused_recurrent_kda(const KdaArgs& a, KernelImpl impl) {
  validate_kda_args(a);
  if (impl == KernelImpl::Naive) {
    fused_recurrent_kda_naive(a);
  } else {
    fused_recurrent_kda_opt_for(isa_of(impl))(a);
  }
}

}  // namespace kda::kernels
