// Checks a dump folder's cases through the full stack against the spec's tolerances
// (kda-numerics.md, "Tolerances"): output, final recurrent state, final conv state, and the
// prefill -> decode invariance (each sequence's last min(8, T_i) tokens as DECODE steps).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "kda/common/precision.h"
#include "kda/io/config.h"
#include "kda/kernels/kda/kda.h"
#include "kda/models/kimi_linear.h"

namespace kda::runtime {

struct CheckRow {
  std::string check;   // what is compared, e.g. "out vs out_fp32"
  std::string metric;  // "max err/tol" (elementwise, <= 1 passes) or "rel L2"
  double value = 0.0;
  double limit = 0.0;
  bool ok = false;
};

struct CaseReport {
  std::string name;
  Precision precision = Precision::FP32;
  std::vector<CheckRow> rows;
  bool ok() const;
};

// Case files of a dump folder: every *.npz but weights.npz, sorted by name.
std::vector<std::filesystem::path> list_cases(const std::filesystem::path& dir);

// Runs one case with `layer` (built for `precision`) and checks it. invariance_tail is the decode tail
// of the invariance check (8 in the spec).
CaseReport verify_case(models::KimiDeltaAttention& layer, const io::KimiLinearConfig& cfg,
                       const std::filesystem::path& case_file, kernels::KernelImpl kernel,
                       int invariance_tail = 8);

}  // namespace kda::runtime
