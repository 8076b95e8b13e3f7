// The two precision modes of the spec (kda-numerics.md, "Precision modes").
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace kda {

enum class Precision { FP32, BF16 };

inline const char* to_string(Precision p) { return p == Precision::FP32 ? "fp32" : "bf16"; }

inline Precision parse_precision(std::string_view s) {
  if (s == "fp32") return Precision::FP32;
  if (s == "bf16") return Precision::BF16;
  throw std::invalid_argument("unknown precision '" + std::string(s) + "' (expected fp32 or bf16)");
}

}  // namespace kda
