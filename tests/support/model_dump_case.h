// The whole-model reference dumps (tests/data/model_dumps/tiny): its cases by name, and the checks the
// model tests share (the spec's tolerances on a run_model_case result).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kda/io/npy.h"
#include "kda/models/kimi_linear_case.h"

namespace kda::testing {

struct ModelDumpCase {
  std::string name;
  io::NpzArchive npz;
  std::vector<int32_t> input_ids, cu_seqlens;            // cu_seqlens empty: one sequence
  std::vector<float> f32(const std::string& key) const;  // a float array of the case (missing: error)
};

// T1, T7, T64, T65, T200, varlen_3, decode_tail.
std::vector<std::string> model_dump_case_names();
ModelDumpCase load_model_dump_case(const std::string& name);

// fp32 bounds (spec "Tolerances"): logits and hidden_final within 1e-4 + 1e-4|b|, KDA states and MLA
// cache rows within 1e-5 + 1e-5|b|, against the case's float64 arrays; `what` names the run in failures.
void expect_case_fp32(const models::ModelCaseResult& r, const ModelDumpCase& c, const std::string& what);

}  // namespace kda::testing
