#include "support/compact_rows.h"

namespace kda::testing {

std::unique_ptr<CompactRows> compact_rows(kernels::gemm::RowFormat f, const std::vector<float>& w,
                                          int64_t rows, int64_t cols) {
  using kernels::gemm::RowFormat;
  auto h = std::make_unique<CompactRows>();
  h->values = w;
  switch (f) {
    case RowFormat::F32:
      h->view = {f, h->values.data(), nullptr, rows, cols};
      break;
    case RowFormat::BF16:
      h->bf16.resize(w.size());
      f32_to_bf16_array(w.data(), h->bf16.data(), w.size());
      bf16_to_f32_array(h->bf16.data(), h->values.data(), w.size());
      h->view = {f, h->bf16.data(), nullptr, rows, cols};
      break;
    case RowFormat::Int8:
    case RowFormat::Int4:
      h->packed = std::make_unique<kernels::gemm::PackedMatrix>(
          f == RowFormat::Int8 ? Weights::Int8 : Weights::Int4, w.data(), cols, rows);
      h->values = kernels::gemm::dequantize(h->packed->view());
      h->view = {f, h->packed->view().data, h->packed->view().scale, rows, cols};
      break;
  }
  return h;
}

const char* row_format_name(kernels::gemm::RowFormat f) {
  using kernels::gemm::RowFormat;
  return f == RowFormat::F32 ? "f32" : f == RowFormat::BF16 ? "bf16" : f == RowFormat::Int8 ? "int8" : "int4";
}

}  // namespace kda::testing
