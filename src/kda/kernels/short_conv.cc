#include "kda/kernels/short_conv.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kda/common/isa_target.h"
#include "kda/kernels/exp_simd.h"
#include "kda/kernels/short_conv_isa.h"

// One copy per ISA (isa_target.h); short_conv_dispatch.cc picks one per call.
KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS {
namespace {

// Channels per inner block: one block of one token is one pass of the simd loop.
constexpr int64_t kBlock = 256;
// Tokens per work item. An item covers every channel of its tokens (or a share of them when there are
// few items), so each token row is read as one contiguous stream and the W-1 rows before it are still
// in cache; items are small enough that one long sequence spreads over every thread.
constexpr int64_t kTimeChunk = 32;
// Below this many outputs a parallel region costs more than it saves.
constexpr int64_t kMinParallelWork = 1 << 14;

enum class Mode { kExtend, kDecode };

// A stored value, state or input, as fp32. In a simd loop the bf16 one is a zero-extension and a shift
// per 16 lanes, so bf16 rows are read natively rather than through a widened copy.
inline float load_f32(float v) { return v; }
inline float load_f32(bf16_t v) { return bf16_to_f32(v); }
inline void store_state(float v, float* d) { *d = v; }
inline void store_state(float v, bf16_t* d) { *d = f32_to_bf16(v); }

template <class StateT>
void validate(const ShortConvArgs<StateT>& a, Mode mode) {
  const std::string fn = mode == Mode::kExtend ? "short_conv_extend" : "short_conv_decode";
  auto fail = [&](const std::string& msg) { throw std::invalid_argument(fn + ": " + msg); };
  auto s = [](auto v) { return std::to_string(v); };
  if (a.W < 1) fail("W must be >= 1, got " + s(a.W));
  if (a.T < 0 || a.C < 0 || a.N < 0)
    fail("T, C and N must be >= 0, got " + s(a.T) + ", " + s(a.C) + ", " + s(a.N));
  if (a.x_stride < a.C) fail("x_stride (" + s(a.x_stride) + ") must be >= C (" + s(a.C) + ")");
  if (a.y_stride != 0 && a.y_stride < a.C)
    fail("y_stride (" + s(a.y_stride) + ") must be 0 (= C) or >= C (" + s(a.C) + ")");
  if (a.T > 0 && a.C > 0) {
    if (!a.weight) fail("weight must not be null");
    if (a.x && a.x_bf16) fail("x and x_bf16 are both set: set exactly one of the two inputs");
    if (!a.x && !a.x_bf16) fail("x and x_bf16 are both null: set exactly one of the two inputs");
    if (a.y && a.y_bf16) fail("y and y_bf16 are both set: set exactly one of the two outputs");
    if (!a.y && !a.y_bf16) fail("y and y_bf16 are both null: set exactly one of the two outputs");
  }

  if (mode == Mode::kDecode) {
    if (a.T != a.N) fail("decode takes one token per sequence, but T = " + s(a.T) + " and N = " + s(a.N));
  } else if (!a.cu_seqlens) {
    if (a.N != 1) fail("cu_seqlens is null (one sequence of T tokens) but N = " + s(a.N));
  } else {
    const int32_t* cu = a.cu_seqlens;
    if (cu[0] != 0) fail("cu_seqlens[0] must be 0, got " + s(cu[0]));
    for (int64_t i = 0; i < a.N; ++i) {
      if (cu[i + 1] < cu[i]) {
        fail("cu_seqlens must be non-decreasing, but cu_seqlens[" + s(i) + "] = " + s(cu[i]) +
             " > cu_seqlens[" + s(i + 1) + "] = " + s(cu[i + 1]));
      }
    }
    if (cu[a.N] != a.T) fail("cu_seqlens[N] = " + s(cu[a.N]) + " must equal T = " + s(a.T));
  }

  if (a.state) {
    if (!a.indices) {
      if (a.N > a.num_slots) {
        fail("indices is null (sequence i uses slot i) but N = " + s(a.N) +
             " > num_slots = " + s(a.num_slots));
      }
      return;
    }
    // Two sequences on one slot would race on it and leave it to whichever wrote last.
    std::vector<std::pair<int32_t, int64_t>> used;  // (slot, sequence)
    for (int64_t i = 0; i < a.N; ++i) {
      const int32_t idx = a.indices[i];
      if (idx == -1) continue;
      if (idx < 0 || idx >= a.num_slots) {
        fail("indices[" + s(i) + "] = " + s(idx) + " is neither -1 nor a slot in [0, " + s(a.num_slots) +
             ")");
      }
      used.emplace_back(idx, i);
    }
    std::sort(used.begin(), used.end());
    for (size_t k = 1; k < used.size(); ++k) {
      if (used[k].first == used[k - 1].first) {
        fail("slot " + s(used[k].first) + " is named by sequences " + s(used[k - 1].second) + " and " +
             s(used[k].second));
      }
    }
  } else if (a.indices) {
    for (int64_t i = 0; i < a.N; ++i) {
      if (a.indices[i] < -1) fail("indices[" + s(i) + "] = " + s(a.indices[i]) + " is negative but not -1");
    }
  }
}

template <class StateT>
int64_t y_stride(const ShortConvArgs<StateT>& a) {
  return a.y_stride > 0 ? a.y_stride : a.C;
}

inline float maybe_round(float v, bool round) { return round ? round_bf16(v) : v; }

// An output as stored: fp32, rounded to a bf16 value when asked, or the bits of that same rounding
// (always rounded). Shifting round_bf16's 32-bit lanes keeps the simd loops branch-free; it equals
// f32_to_bf16, NaN included.
inline void store_out(float v, bool round, float* d) { *d = maybe_round(v, round); }
inline void store_out(float v, bool /*round*/, bf16_t* d) {
  *d = static_cast<bf16_t>(std::bit_cast<uint32_t>(round_bf16(v)) >> 16);
}

// y[c] = silu(sum_i w[i * C + c] * src[i][c]) for c < n. The taps run in a fixed order with an exact fma
// each (starting from 0), so extend and decode give the same bits. The model's W = 4 has a loop of its
// own with the output rounding fixed at compile time, which the compiler turns into straight simd code.
// Inputs arrive already rounded when the bf16 mode asks for it (see conv_rows). InT and OutT: float or
// bf16_t.
template <bool kRoundOut, class InT, class OutT>
void conv_token4(const InT* const* src, const float* wt, int64_t C, int64_t n, OutT* __restrict y) {
  const InT* __restrict s0 = src[0];
  const InT* __restrict s1 = src[1];
  const InT* __restrict s2 = src[2];
  const InT* __restrict s3 = src[3];
  const float* __restrict w0 = wt;
  const float* __restrict w1 = wt + C;
  const float* __restrict w2 = wt + 2 * C;
  const float* __restrict w3 = wt + 3 * C;
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    float acc = std::fma(w0[c], load_f32(s0[c]), 0.0f);
    acc = std::fma(w1[c], load_f32(s1[c]), acc);
    acc = std::fma(w2[c], load_f32(s2[c]), acc);
    acc = std::fma(w3[c], load_f32(s3[c]), acc);
    store_out(acc / (1.0f + exp_simd(-acc)), kRoundOut, y + c);
  }
}

template <class InT, class OutT>
void conv_token(const InT* const* src, const float* wt, int64_t C, int W, int64_t n, bool round_out,
                OutT* __restrict y) {
  if (W == 4) {
    if constexpr (std::is_same_v<OutT, bf16_t>) {
      return conv_token4<true>(src, wt, C, n, y);  // bf16 outputs are rounded whatever round_out says
    } else {
      if (round_out) return conv_token4<true>(src, wt, C, n, y);
      return conv_token4<false>(src, wt, C, n, y);
    }
  }
  alignas(64) float acc[kBlock];
  for (int64_t c0 = 0; c0 < n; c0 += kBlock) {
    const int64_t m = std::min(kBlock, n - c0);
    std::fill(acc, acc + m, 0.0f);
    for (int i = 0; i < W; ++i) {
      const InT* s = src[i] + c0;
      const float* w = wt + i * C + c0;
#pragma omp simd
      for (int64_t c = 0; c < m; ++c) acc[c] = std::fma(w[c], load_f32(s[c]), acc[c]);
    }
#pragma omp simd
    for (int64_t c = 0; c < m; ++c) store_out(acc[c] / (1.0f + exp_simd(-acc[c])), round_out, y + c0 + c);
  }
}

// W tap pointers, on the stack for W <= 8.
template <class T>
struct Taps {
  explicit Taps(int W) {
    if (W > 8) {
      heap.resize(W);
      p = heap.data();
    }
  }
  Taps(const Taps&) = delete;
  Taps& operator=(const Taps&) = delete;
  const T* fixed[8] = {};
  std::vector<const T*> heap;
  const T** p = fixed;
};

// Outputs of tokens [t0, t1) of the sequence starting at bos, channels [c0, c0 + nc), into `out`
// (a.y or a.y_bf16), from `x` (a.x or a.x_bf16). `wt` is the weight transposed to [W, C]; `st` is the
// sequence's slot (null: zero history), read only when `read_state`; `hist` and `ring` are scratch for
// (W-1) * nc floats (2 (W-1) * nc for bf16 x) and W * nc floats.
template <class StateT, class InT, class OutT>
void conv_rows(const ShortConvArgs<StateT>& a, const InT* x, OutT* out, const float* wt, int64_t bos,
               int64_t t0, int64_t t1, const StateT* st, bool read_state, int64_t c0, int64_t nc, float* hist,
               float* ring) {
  constexpr bool kBf16In = std::is_same_v<InT, bf16_t>;
  const int W = a.W;
  const int64_t H = W - 1;  // history rows
  const InT* xs = x + bos * a.x_stride + c0;
  auto x_row = [&](int64_t p) { return xs + p * a.x_stride; };  // position p >= 0 of the sequence
  if (t0 - bos < H) {  // only the first W-1 tokens of a sequence see the slot
    for (int64_t r = 0; r < H; ++r) {
      float* h = hist + r * nc;
      if (st && read_state) {
        const StateT* src = st + r * a.C + c0;
        // Rounded like every input when asked, so that bf16 x sees the history fp32 x would.
#pragma omp simd
        for (int64_t c = 0; c < nc; ++c) h[c] = maybe_round(load_f32(src[c]), a.round_input_bf16);
      } else {
        std::fill(h, h + nc, 0.0f);
      }
    }
    if constexpr (kBf16In) {
      // The taps of these tokens mix history and segment rows; widening the segment's first rows after
      // the history gives them one type (at most W-1 rows: the rest read x natively).
      for (int64_t p = 0; p < std::min(H, t1 - bos); ++p) {
        const bf16_t* src = x_row(p);
        float* h = hist + (H + p) * nc;
#pragma omp simd
        for (int64_t c = 0; c < nc; ++c) h[c] = load_f32(src[c]);
      }
    }
  }
  // Input row of position p as fp32 (< 0 lies in the history); for bf16 x, only p < W-1.
  auto input = [&](int64_t p) -> const float* {
    if constexpr (!kBf16In) {
      if (p >= 0) return x_row(p);
    }
    return hist + (H + p) * nc;
  };
  if constexpr (!kBf16In) {
    if (a.round_input_bf16) {
      // Rounded inputs: each is rounded once, into a ring of the last W rows, rather than once per tap.
      auto ring_row = [&](int64_t p) { return ring + ((p % W + W) % W) * nc; };
      auto round_into = [](const float* src, float* dst, int64_t n) {
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) dst[c] = round_bf16(src[c]);
      };
      Taps<float> taps(W);
      for (int64_t p = t0 - bos - H; p < t0 - bos; ++p) round_into(input(p), ring_row(p), nc);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t pt = t - bos;
        OutT* y = out + t * y_stride(a) + c0;
        for (int64_t b = 0; b < nc; b += kBlock) {  // a block at a time: the new row is used while in L1
          const int64_t m = std::min(kBlock, nc - b);
          round_into(input(pt) + b, ring_row(pt) + b, m);
          for (int i = 0; i < W; ++i) taps.p[i] = ring_row(pt - H + i) + b;
          conv_token(taps.p, wt + c0 + b, a.C, W, m, a.round_output_bf16, y + b);
        }
      }
      return;
    }
  }
  // Unrounded inputs, or bf16 ones, which rounding leaves as they are.
  Taps<float> head_taps(W);
  Taps<InT> taps(W);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t pt = t - bos;
    OutT* y = out + t * y_stride(a) + c0;
    if (pt < H) {
      for (int i = 0; i < W; ++i) head_taps.p[i] = input(pt - H + i);
      conv_token(head_taps.p, wt + c0, a.C, W, nc, a.round_output_bf16, y);
    } else {
      for (int i = 0; i < W; ++i) taps.p[i] = x_row(pt - H + i);
      conv_token(taps.p, wt + c0, a.C, W, nc, a.round_output_bf16, y);
    }
  }
}

// The slot after a segment of `len` > 0 tokens: its last W-1 raw inputs. Row r is position len + r of
// (old history ++ segment); taking rows in increasing order reads old row len + r > r before it is
// overwritten, so the shift is done in place.
template <class StateT, class InT>
void write_state(const ShortConvArgs<StateT>& a, const InT* x, int64_t bos, int64_t len, StateT* st,
                 bool read_state, int64_t c0, int64_t nc) {
  const int64_t H = a.W - 1;
  for (int64_t r = 0; r < H; ++r) {
    const int64_t q = len + r;
    StateT* dst = st + r * a.C + c0;
    if (q < H) {
      if (read_state) {
        const StateT* src = st + q * a.C + c0;
#pragma omp simd
        for (int64_t c = 0; c < nc; ++c) dst[c] = src[c];
      } else {
        std::fill(dst, dst + nc, StateT{0});  // the zero history the segment saw
      }
    } else {
      const InT* src = x + (bos + q - H) * a.x_stride + c0;
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c)
        store_state(maybe_round(load_f32(src[c]), a.round_input_bf16), dst + c);
    }
  }
}

template <class StateT>
void run(const ShortConvArgs<StateT>& a, Mode mode) {
  validate(a, mode);
  if (a.C == 0 || a.N == 0) return;
  const int64_t H = a.W - 1;
  auto seq_start = [&](int64_t i) -> int64_t {
    if (mode == Mode::kDecode) return i;
    return a.cu_seqlens ? a.cu_seqlens[i] : 0;
  };
  auto seq_end = [&](int64_t i) -> int64_t {
    if (mode == Mode::kDecode) return i + 1;
    return a.cu_seqlens ? a.cu_seqlens[i + 1] : a.T;
  };
  auto slot_of = [&](int64_t i) -> int64_t { return a.indices ? a.indices[i] : i; };
  auto reads_state = [&](int64_t i) { return !a.has_initial_state || a.has_initial_state[i] != 0; };

  struct Range {
    int64_t seq, t0, t1;
  };
  // Scratch kept per calling thread, so steady-state calls do not allocate.
  thread_local std::vector<Range> ranges;
  thread_local std::vector<int64_t> long_seqs;  // over several time chunks: slot written after the barrier
  thread_local std::vector<float> wt;           // [W, C]: tap i of consecutive channels contiguous for simd
  ranges.clear();
  long_seqs.clear();
  for (int64_t i = 0; i < a.N; ++i) {
    const int64_t bos = seq_start(i), eos = seq_end(i);
    for (int64_t t0 = bos; t0 < eos; t0 += kTimeChunk)
      ranges.push_back({i, t0, std::min(eos, t0 + kTimeChunk)});
    if (eos - bos > kTimeChunk) long_seqs.push_back(i);
  }
  // Channel spans: whole rows unless there are too few ranges to keep every thread busy.
  const int64_t nb = (a.C + kBlock - 1) / kBlock;
  const int64_t want_items = 8 * static_cast<int64_t>(omp_get_max_threads());
  const int64_t n_ranges = static_cast<int64_t>(ranges.size());
  const int64_t n_spans =
      std::clamp<int64_t>((want_items + n_ranges - 1) / std::max<int64_t>(n_ranges, 1), 1, nb);
  const int64_t span = (nb + n_spans - 1) / n_spans * kBlock;
  const int64_t spans = (a.C + span - 1) / span;
  const int64_t out_items = n_ranges * spans;
  const int64_t state_items = a.state && H > 0 ? static_cast<int64_t>(long_seqs.size()) * nb : 0;
  wt.resize(static_cast<size_t>(a.W * a.C));
  Range* rg = ranges.data();
  const int64_t* ls = long_seqs.data();
  float* wtp = wt.data();
  // Every thread's history and ring buffers, allocated here: a std::bad_alloc inside the region would
  // end the process (no exception may leave an OpenMP region), and one thread leaving the worksharing
  // loops below would leave the others at their barriers.
  const bool parallel = a.T * a.C * a.W >= kMinParallelWork;
  const int64_t threads = parallel ? omp_get_max_threads() : 1;
  const int64_t hist_n = (a.x_bf16 ? 2 : 1) * H * span, ring_n = a.W * span;
  thread_local std::vector<float> hist_all, ring_all;
  hist_all.resize(static_cast<size_t>(threads * hist_n));
  ring_all.resize(static_cast<size_t>(threads * ring_n));
  float* const hist0 = hist_all.data();
  float* const ring0 = ring_all.data();

#pragma omp parallel if (parallel) num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t c = 0; c < a.C; ++c) {
      for (int i = 0; i < a.W; ++i) wtp[i * a.C + c] = a.weight[c * a.W + i];
    }
    float* const hist = hist0 + omp_get_thread_num() * hist_n;
    float* const ring = ring0 + omp_get_thread_num() * ring_n;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < out_items; ++it) {
      const Range& r = rg[it / spans];
      const int64_t c0 = (it % spans) * span, nc = std::min(span, a.C - c0);
      const int64_t slot = slot_of(r.seq);
      if (slot < 0) {  // padded row: zero output, slot untouched
        for (int64_t t = r.t0; t < r.t1; ++t) {
          const int64_t o = t * y_stride(a) + c0;
          if (a.y_bf16) {
            std::fill(a.y_bf16 + o, a.y_bf16 + o + nc, bf16_t{0});
          } else {
            std::fill(a.y + o, a.y + o + nc, 0.0f);
          }
        }
        continue;
      }
      StateT* st = a.state ? a.state + slot * H * a.C : nullptr;
      const int64_t bos = seq_start(r.seq), eos = seq_end(r.seq);
      auto rows = [&](const auto* x, auto* out) {
        conv_rows(a, x, out, wtp, bos, r.t0, r.t1, st, reads_state(r.seq), c0, nc, hist, ring);
        // A segment in one item: nothing else touches these channels of its slot, so write it now
        // while they are in cache.
        if (st && r.t0 == bos && r.t1 == eos)
          write_state(a, x, bos, eos - bos, st, reads_state(r.seq), c0, nc);
      };
      if (a.x_bf16) {
        a.y_bf16 ? rows(a.x_bf16, a.y_bf16) : rows(a.x_bf16, a.y);
      } else {
        a.y_bf16 ? rows(a.x, a.y_bf16) : rows(a.x, a.y);
      }
    }
    // A longer segment reads its slot in its first time chunk; the rewrite waits for the barrier
    // above so that it cannot race with that read. Empty segments have no range: slot unchanged.
#pragma omp for schedule(static)
    for (int64_t it = 0; it < state_items; ++it) {
      const int64_t i = ls[it / nb], c0 = (it % nb) * kBlock, nc = std::min(kBlock, a.C - c0);
      const int64_t slot = slot_of(i), bos = seq_start(i);
      if (slot < 0) continue;
      StateT* st = a.state + slot * H * a.C;
      if (a.x_bf16) {
        write_state(a, a.x_bf16, bos, seq_end(i) - bos, st, reads_state(i), c0, nc);
      } else {
        write_state(a, a.x, bos, seq_end(i) - bos, st, reads_state(i), c0, nc);
      }
    }
  }
}

}  // namespace

void short_conv_extend(const ShortConvArgs<float>& a) { run(a, Mode::kExtend); }
void short_conv_extend(const ShortConvArgs<bf16_t>& a) { run(a, Mode::kExtend); }
void short_conv_decode(const ShortConvArgs<float>& a) { run(a, Mode::kDecode); }
void short_conv_decode(const ShortConvArgs<bf16_t>& a) { run(a, Mode::kDecode); }

}  // namespace kda::kernels::KDA_ISA_NS
KDA_ISA_POP
