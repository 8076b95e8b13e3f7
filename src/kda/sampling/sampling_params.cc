#include "kda/sampling/sampling_params.h"

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>

namespace kda::sampling {
namespace {

[[noreturn]] void fail(const char* field, const std::string& what) {
  throw std::invalid_argument(std::string(field) + ": " + what);
}

std::string show(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

// Finite and within [lo, hi]; lo_open: strictly above lo.
void check_range(const char* field, float v, double lo, double hi, bool lo_open, const char* rule) {
  const bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && v <= hi;
  if (!ok) fail(field, std::string("must be a finite number ") + rule + ", got " + show(v));
}

}  // namespace

void SamplingParams::validate(int64_t vocab) const {
  if (vocab <= 0) fail("vocab", "must be positive, got " + std::to_string(vocab));
  if (!std::isfinite(temperature) || temperature < 0.0f)
    fail("temperature", "must be a finite number >= 0, got " + show(temperature));
  // top_k: every value is meaningful (<= 0: off; above the vocabulary: everything).
  check_range("top_p", top_p, 0.0, 1.0, true, "in (0, 1]");
  check_range("min_p", min_p, 0.0, 1.0, false, "in [0, 1]");
  if (!std::isfinite(repetition_penalty) || repetition_penalty <= 0.0f)
    fail("repetition_penalty", "must be a finite number > 0, got " + show(repetition_penalty));
  check_range("presence_penalty", presence_penalty, -2.0, 2.0, false, "in [-2, 2]");
  check_range("frequency_penalty", frequency_penalty, -2.0, 2.0, false, "in [-2, 2]");
  if (max_tokens < 1) fail("max_tokens", "must be >= 1, got " + std::to_string(max_tokens));
  for (size_t i = 0; i < stop_token_ids.size(); ++i) {
    const int32_t id = stop_token_ids[i];
    if (id < 0 || id >= vocab)
      fail("stop_token_ids", "id " + std::to_string(id) + " at index " + std::to_string(i) +
                                 " is outside [0, " + std::to_string(vocab) + ")");
  }
  if (logprobs < -1 || logprobs > kMaxLogprobs)
    fail("logprobs",
         "must be -1 (off) or in [0, " + std::to_string(kMaxLogprobs) + "], got " + std::to_string(logprobs));
}

}  // namespace kda::sampling
