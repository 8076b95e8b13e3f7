// The workload of a simulation: a JSON trace file, or requests generated from a seed.
//
// Trace format: a JSON list of objects {"prompt_len": int >= 1, "output_len": int >= 0,
// "arrival_step": int >= 0}; other keys are ignored. Every error (std::invalid_argument) names the
// file, the entry and the field, and is raised before any work.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "kda/serving/request.h"

namespace kda::serving {

std::vector<RequestSpec> parse_trace(const std::string& json_text, const std::string& what);
std::vector<RequestSpec> load_trace(const std::filesystem::path& path);

struct LenRange {
  int32_t min = 1, max = 1;
};
// "MIN:MAX" (or "N" for MIN = MAX = N), 1 <= MIN <= MAX.
LenRange parse_len_range(const std::string& text, const std::string& option);

// `requests` requests arriving at step 0, prompt lengths uniform in [range.min, range.max] and
// `output_len` decode steps each, drawn from `seed`.
std::vector<RequestSpec> make_workload(int64_t requests, LenRange prompt, int32_t output_len, uint64_t seed);

// Checks a workload (from any source): non-empty, ids unique and >= 0, lengths in range. Throws
// std::invalid_argument naming the request and the field.
void validate_workload(const std::vector<RequestSpec>& reqs);

}  // namespace kda::serving
