// Matrix-vector products of one row of activations with a matrix W [rows, cols] held row-major in fp32,
// bf16 or a weight-only int8 / int4 packing, on the calling thread: the MLA absorbed form's decode rows,
// which multiply one query by each head's slices of kv_b (W_UK^T q_nope, W_UV u) and read those slices
// from memory once a step. Each row of W is widened to fp32 exactly as the format's dequantize gives it
// (weight_format.h: (nibble - 8) * scale, q * scale, or the bf16 value), then met in fp32: a row's
// products and sums are the same whichever format holds its values, so a compact copy of a matrix gives
// the bits its fp32 copy gives, and reads a half (bf16) to a seventh (int4) of the bytes.
//
// oneDNN's sgemm at one row ran these at about two thirds of the read bandwidth (it packs its operands
// per call); plain loops over rows read at it (docs/performance.md, "MLA decode: kv_b read in place").
//
// Sums, each output from zero in a fixed order that depends on the shape only (not on the caller's
// batch, the format or the thread): gemv_rows_xw adds row after row, gemv_rows_wx sums a row in the
// loop's vector lanes, then the lanes in a fixed tree. The references below give the same values up to
// fp32 rounding.
#pragma once

#include <cstdint>

namespace kda::kernels::gemm {

enum class RowFormat { F32, BF16, Int8, Int4 };

// W [rows, cols], row r at data + r * (row bytes): F32 float, BF16 bf16_t, Int8 int8_t (scale [rows]),
// Int4 quant_gemm.h's packing (cols / 2 bytes a row, scale [rows, cols / 32]; cols a multiple of 32).
struct RowMatrix {
  RowFormat format = RowFormat::F32;
  const void* data = nullptr;
  const float* scale = nullptr;
  int64_t rows = 0, cols = 0;
};

// The bytes of `rows` rows of W (values and scales): what a product over them reads.
int64_t row_bytes(const RowMatrix& w, int64_t rows);

// y[0, cols) = sum over k in [0, K) of x[k] * W[k0 + k, :], rows added in order.
void gemv_rows_xw(const RowMatrix& w, int64_t k0, int64_t K, const float* x, float* y);
// y[n] = W[n0 + n, :] . x for n in [0, N).
void gemv_rows_wx(const RowMatrix& w, int64_t n0, int64_t N, const float* x, float* y);

// The same products for M rows of activations at once (x[m] in, y[m] out, m in [0, M)): each row's
// outputs are gemv_rows_xw's / gemv_rows_wx's bits for that row alone, whatever M and the rows beside it,
// while each row of W is widened once for a block of the rows instead of once per row (the MLA absorbed
// form's decode batch: every sequence's query meets the same head's slices of kv_b).
void gemm_rows_xw(const RowMatrix& w, int64_t k0, int64_t K, int64_t M, const float* const* x,
                  float* const* y);
void gemm_rows_wx(const RowMatrix& w, int64_t n0, int64_t N, int64_t M, const float* const* x,
                  float* const* y);

// The references: each row dequantized by weight_format.h's dequantize (bf16 widened), sums in double.
void gemv_rows_xw_reference(const RowMatrix& w, int64_t k0, int64_t K, const float* x, float* y);
void gemv_rows_wx_reference(const RowMatrix& w, int64_t n0, int64_t N, const float* x, float* y);

}  // namespace kda::kernels::gemm
