// KDA kernels: chunk_kda (prefill, varlen) and fused_recurrent_kda (decode).
//
// The interface follows RFC §4.1 (fla's chunk_kda / fused_recurrent_kda): q, k, v, g, beta, an initial
// state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel and cu_seqlens. Every kernel
// (naive reference and optimized, declared in impl.h) has this one signature, `void(const KdaArgs&)`;
// the entry points at the bottom pick the optimized one for this CPU unless asked otherwise.
//
// States live in a pool: `state` points at [num_state_slots, H, K, V] fp32 and sequence i reads its
// initial state from, and writes its final state into, slot state_indices[i] -- in place, no gather or
// scatter copies. Index -1 marks a padded row: its output is zero and no slot is read or written.
//
// Snapshots (prefix caching): besides the final state, a call can keep the recurrent state after any
// positions of its sequences, written into slots of `snapshot_state` in the same pass that computes the
// output (see KdaSnapshot).
//
// Thread safety: every function here may be called from several threads at once. A call keeps no state
// between calls but per-thread scratch (thread_local) and opens its own OpenMP team on the calling
// thread (omp_get_max_threads() of that thread), so concurrent calls are independent as long as none
// writes memory another one reads or writes: outputs, and the state and snapshot slots of its sequences
// -- disjoint slots of one pool are fine, one slot in two calls at a time is a data race. Inputs (q, k,
// v, g, beta, A_log, ...) may be shared.
#pragma once

#include <cstdint>
#include <string_view>

#include "kda/common/bf16.h"

namespace kda::kernels {

// One interior state to keep: the recurrent state after the first `pos` tokens of sequence `seq` of this
// call (0 <= pos <= T_seq; it includes the sequence's initial state; pos == T_seq is the final state),
// written into slot `slot` of snapshot_state.
struct KdaSnapshot {
  int32_t seq = 0;
  int32_t pos = 0;
  int32_t slot = 0;
};

struct KdaArgs {
  // Packed token-major inputs, T tokens over N sequences:
  //   q, k: [T, H, K]   v: [T, H, V]   g: [T, H, K]   beta: [T, H]
  // g is the log-space forget gate, or (use_gate_in_kernel) the raw gate f that the kernel turns into
  // g = -exp(A_log[h]) * softplus(f + dt_bias[h*K + d]).
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* g = nullptr;
  const float* beta = nullptr;
  int64_t T = 0;
  int H = 0;
  int K = 0;
  int V = 0;
  // Elements between consecutive tokens' rows, so q/k/v can be column slices of one [T, 3P] conv output
  // and g a slice of a wider projection output. 0 means dense: H*K for q, k and g, H*V for v.
  int64_t q_stride = 0;
  int64_t k_stride = 0;
  int64_t v_stride = 0;
  int64_t g_stride = 0;

  // Or q, k and v as bf16 (the bf16 mode's conv outputs, which are bf16 values): set all three instead
  // of q, k, v, same strides (in elements). chunk_kda_opt reads them as they are (half the bytes of
  // fp32); the other kernels work on fp32 copies (see with_f32_inputs).
  const bf16_t* q_bf16 = nullptr;
  const bf16_t* k_bf16 = nullptr;
  const bf16_t* v_bf16 = nullptr;
  // And / or g as bf16, whatever the precision of q, k, v: set g_bf16 instead of g (exactly one of the
  // two), same layout and g_stride. Like q_bf16, k_bf16, v_bf16: read as it is by chunk_kda_opt,
  // widened to fp32 for the other kernels.
  const bf16_t* g_bf16 = nullptr;

  // Sequence boundaries [N+1], int32, cu_seqlens[0] == 0, non-decreasing, cu_seqlens[N] == T.
  // Null means N sequences of T / N tokens each (N == 1: one sequence; decode: N sequences of 1).
  const int32_t* cu_seqlens = nullptr;
  int64_t N = 1;

  float scale = 0.0f;                    // <= 0 means K^-0.5; applied to q only
  bool use_qk_l2norm_in_kernel = false;  // q <- q / sqrt(sum q^2 + 1e-6), k likewise, per head
  bool use_gate_in_kernel = false;
  const float* A_log = nullptr;    // [H], with use_gate_in_kernel
  const float* dt_bias = nullptr;  // [H*K], with use_gate_in_kernel (may be null: no bias)

  // Recurrent state pool [num_state_slots, H, K, V] fp32. Null: every sequence starts from zero and no
  // final state is kept. state_indices [N] (null: sequence i <-> slot i); -1 is a padded row.
  float* state = nullptr;
  const int32_t* state_indices = nullptr;
  int64_t num_state_slots = 0;
  // [N] per sequence, null = all true. False: start from a zero state without reading the slot.
  const uint8_t* has_initial_state = nullptr;
  bool output_final_state = true;  // write the final state back into the sequence's slot

  float* o = nullptr;  // [T, H, V] output

  // Interior states to keep, whether or not output_final_state is set. The state after position pos of a
  // sequence equals (within fp32 rounding) the final state of a run over its first pos tokens with the
  // same initial state; chunk_kda_opt's is that run's bit for bit when the run starts on the same chunk
  // grid (its last chunk is the side chunk the snapshot is computed on). No kernel's outputs or final
  // states change with snapshots. A padded row takes no snapshots; no slot twice; when
  // snapshot_state is `state`, no snapshot slot may be the slot of a sequence of this call.
  const KdaSnapshot* snapshots = nullptr;  // [num_snapshots], any order
  int64_t num_snapshots = 0;
  float* snapshot_state = nullptr;  // [num_snapshot_slots, H, K, V] fp32; may be the same buffer as `state`
  int64_t num_snapshot_slots = 0;

  // Tree drafts (speculative decoding, TARGET_VERIFY): token t's parent, as an index within its own
  // sequence, or -1 for the sequence's initial state; a parent comes before its child. A token's state
  // is its parent's state advanced by it, and its output is read from that state, so every root-to-leaf
  // path computes what that path alone would. Null: a chain (token t's parent is t-1), the plain
  // recurrence. With parents, "the state after position pos" (snapshots, and the final state pos ==
  // T_seq) is the state of token pos-1 -- its path's state. fused_recurrent_kda only (chunk_kda refuses
  // it): the recurrent kernels keep each token's state of a sequence (T_seq x H x K x V fp32 per
  // sequence being worked on), which is what verification of a few drafted tokens needs.
  const int32_t* parents = nullptr;  // [T]

  // Where the slots' states most likely are when the call starts; it steers fused_recurrent_kda_opt's
  // prefetching only (results are the same whatever it says). Auto: in the last-level cache when the
  // call's states total at most 16 MiB, else in memory -- a guess from the call alone. A caller that
  // knows what ran since the last call on these slots (a layer's projections, other layers) says so.
  enum class StateLocality : uint8_t { Auto, Cache, Memory };
  StateLocality state_locality = StateLocality::Auto;
};

// Checks shapes, cu_seqlens, slot indices (in range, or -1, no slot twice), snapshots and flags. Throws
// std::invalid_argument naming what is wrong; nothing is read from or written to the pool before.
void validate_kda_args(const KdaArgs& a);

// Which kernel runs. Naive: the reference. Optimized: the optimized kernel compiled for the fastest ISA
// this CPU runs (best_isa() in kda/common/isa.h). Portable / Avx2 / Avx512: that ISA's copy of the
// optimized kernel, forced (std::invalid_argument when the build or the CPU lacks it). Auto: the
// optimized kernel when it takes these arguments (today every valid call), else the reference.
enum class KernelImpl { Auto, Naive, Optimized, Portable, Avx2, Avx512 };
// "auto" | "naive" | "optimized" | "portable" | "avx2" | "avx512"
KernelImpl parse_kernel_impl(std::string_view s);
const char* to_string(KernelImpl k);

// The kernel a call with `impl` runs on this machine: "avx512", "avx2", "portable" or "naive" (what
// kda bench and kda verify print). Throws std::invalid_argument like the dispatchers for a forced ISA
// that is not available.
const char* kernel_name(KernelImpl impl);

// The dispatcher (RFC §4.2). All validate first.
void chunk_kda(const KdaArgs& a, KernelImpl impl = KernelImpl::Auto);
void fused_recurrent_kda(const KdaArgs& a, KernelImpl impl = KernelImpl::Auto);

}  // namespace kda::kernels
