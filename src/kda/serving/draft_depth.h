// Adaptive draft depth: how many tokens a sequence drafts before its next verify step.
//
// On a MoE model a verify row of d + 1 tokens reads the union of the experts its tokens select, so a
// verify step can cost several plain decode steps at batch 1; speculation pays only when the tokens a step
// emits grow faster than its cost. Two parts:
//   VerifyCostModel        one per serving loop: the measured time of decode/verify steps per draft depth
//                          and batch-size bucket, as a ratio to a plain decode step's.
//   DraftDepthController   one per sequence: its measured per-token acceptance a; before each step it
//                          picks the depth d maximising the expected emitted tokens of a chain,
//                          (1 - a^(d+1)) / (1 - a), over the step's relative cost; 0 when no depth beats
//                          plain decoding by kMinGain. a is taken one standard error above its estimate
//                          (optimism under uncertainty): a sequence's first rejections would otherwise rule
//                          speculation out on the evidence of a token or two, while the margin shrinks
//                          as verify steps add evidence.
// Exploration is cheap and deterministic: a depth with no measurement at a row count borrows the ratio
// measured at the nearest bucket; depth 1 is tried first, and once it is measured a depth measured nowhere
// is costed as the deepest measured depth below it (optimistic, so it gets tried once it might pay: the
// cost is not linear in the depth, and a depth 1 that does not pay says little about depth 4).
// After the controller chooses 0 it re-probes depth 1 after kReprobeSteps steps, doubling the wait each
// time the probe does not make speculation pay (acceptance can change along a sequence); a probe first
// cuts the older evidence's weight to kProbeMemory tokens.
// Everything is a function of the observations and timings fed in: the same sequence of calls gives the
// same choices.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kda::serving {

class VerifyCostModel {
 public:
  static constexpr int32_t kBuckets = 8;  // row counts 1, 2-3, 4-7, ..., >= 128
  static constexpr int32_t kWindow = 9;   // the last steps per (depth, bucket) whose median is the estimate

  explicit VerifyCostModel(int32_t max_depth);  // std::invalid_argument unless 0 <= max_depth <= 64

  // A decode step (depth 0) or a verify step whose deepest row drafted `depth` tokens, with `rows` rows,
  // took `seconds`. std::invalid_argument for a depth outside [0, max_depth], rows < 1 or seconds not
  // finite and >= 0.
  void record(int32_t depth, int64_t rows, double seconds);
  // Estimated step time at `depth` over a plain decode step's, at `rows` rows: 1 at depth 0; +infinity
  // while no plain decode step is measured (so the first steps decode plainly and give the baseline).
  double relative_cost(int32_t depth, int64_t rows) const;
  // Steps recorded at (depth, rows' bucket).
  int64_t samples(int32_t depth, int64_t rows) const;
  int32_t max_depth() const { return max_depth_; }
  static int32_t bucket(int64_t rows);

 private:
  struct Cell {
    std::array<double, kWindow> recent{};
    int64_t count = 0;
    double estimate() const;  // the window's median (its minimum while under 3 samples)
  };
  const Cell& cell(int32_t depth, int32_t b) const {
    return cells_[static_cast<size_t>(depth) * kBuckets + b];
  }
  // The measured ratio at (depth, b) or, unmeasured there, at the nearest bucket that has both; < 0: none.
  double measured_ratio(int32_t depth, int32_t b) const;

  int32_t max_depth_;
  std::vector<Cell> cells_;  // [depth][bucket]
};

class DraftDepthController {
 public:
  static constexpr double kMinGain = 1.05;  // a depth must beat plain decoding's tokens per cost by this
  static constexpr int32_t kReprobeSteps = 16, kMaxReprobeSteps = 512;
  static constexpr double kDecay = 0.97;  // weight of the older observations per verify (acceptance drifts)
  // At a re-probe the evidence from before is stale (acceptance can change along a sequence): its weight
  // is cut to this many tokens, so that the probe's own outcome can move the estimate.
  static constexpr double kProbeMemory = 2.0;

  explicit DraftDepthController(int32_t max_depth);  // std::invalid_argument unless 0 <= max_depth <= 64

  // After a verify step: `drafted` chain tokens, the first `accepted` of them accepted. drafted == 0 (no
  // drafts were available, e.g. ngram with no match) changes nothing: an empty draft costs nothing.
  // std::invalid_argument unless 0 <= accepted <= drafted.
  void observe(int32_t drafted, int32_t accepted);
  // The depth to draft at before a step with `rows` decode rows (see the file comment).
  int32_t choose(const VerifyCostModel& cost, int64_t rows);

  double acceptance() const;  // the per-token acceptance estimate (a prior of 0.5 before any draft)
  // acceptance() plus its standard error over the evidence held (prior included), at most 0.99: the rate
  // choose() plans with.
  double optimistic_acceptance() const;
  int32_t last_choice() const { return last_; }

 private:
  int32_t best_depth(const VerifyCostModel& cost, int64_t rows, double a) const;  // at acceptance a

  int32_t max_depth_;
  double hits_ = 0.0, misses_ = 0.0;  // discounted accepted tokens and first rejections
  int32_t last_ = 0;
  int32_t zero_run_ = 0;  // consecutive choices of 0
  int32_t reprobe_after_ = kReprobeSteps;
  bool probing_ = false;  // the last choice was a re-probe
};

}  // namespace kda::serving
