// A matrix held as kernels/gemm/row_gemv.h reads it (fp32, bf16, int8 / int4 packed), with the fp32
// values that format gives: for the row_gemv tests and the MLA decode tests of a compact kv_b.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/row_gemv.h"
#include "kda/kernels/gemm/weight_format.h"

namespace kda::testing {

struct CompactRows {
  std::vector<float> values;  // [rows, cols]: the values as the format gives them (dequantized, widened)
  std::vector<bf16_t> bf16;
  std::unique_ptr<kernels::gemm::PackedMatrix> packed;
  kernels::gemm::RowMatrix view;  // over this object's storage (values for F32)
};

// w [rows, cols] in format f: F32 as it is, BF16 rounded to nearest even, Int8 / Int4 packed as a
// QuantLinear packs them (cols a multiple of 32 for Int4).
std::unique_ptr<CompactRows> compact_rows(kernels::gemm::RowFormat f, const std::vector<float>& w,
                                          int64_t rows, int64_t cols);

// "f32", "bf16", "int8" or "int4", for test messages.
const char* row_format_name(kernels::gemm::RowFormat f);

}  // namespace kda::testing
