// How a layer's projections hold their weights (--weights): bf16 is the precision's own dense weights
// (bf16 in the bf16 mode, fp32 in the fp32 mode: the behaviour before quantization existed); int8 and
// int4 are weight-only quantized at load (layers/quant_linear.h), with the activations in the
// precision's type. Both precisions take every weight format.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace kda {

enum class Weights { BF16, Int8, Int4 };

inline const char* to_string(Weights w) {
  switch (w) {
    case Weights::Int8:
      return "int8";
    case Weights::Int4:
      return "int4";
    default:
      return "bf16";
  }
}

inline Weights parse_weights(std::string_view s) {
  if (s == "bf16") return Weights::BF16;
  if (s == "int8") return Weights::Int8;
  if (s == "int4") return Weights::Int4;
  throw std::invalid_argument("unknown weights '" + std::string(s) + "' (expected bf16, int8 or int4)");
}

}  // namespace kda
