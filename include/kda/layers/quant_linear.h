// A bias-free linear projection y = x W^T with W quantized at construction (weight-only: int8 per
// output channel or int4 in groups of 32, kernels/gemm/quant_gemm.h); the same forward() signatures as
// Linear. x is taken in fp32 (bf16 inputs widened exactly; in the bf16 precision fp32 inputs are rounded
// to bf16 first, the layer input's rounding point, as Linear does), accumulation is fp32, and a bf16
// output is rounded to nearest even as it is stored.
//
// Up to decode_rows() rows (decode_rows_for: kDecodeRows; fewer on the Dpbf16 and AmxBf16 paths, whose
// kernels are faster from there on): the packed decode kernels, one pass over the packed bytes per
// kDecodeRows rows. More rows (prefill, compute bound): a tile of output channels at a time is widened and
// multiplied, so the packed weights are never resident in a wider form (prefill_path()):
//  - Bf16Tiles, in the bf16 precision for an int8 layer whose input size the Dpbf16 or AmxBf16 kernels do
//    not take (a multiple of 32), and for every layer on a CPU whose oneDNN runs a native bf16 matmul where
//    neither of those kernels runs: the tile in bf16 as kernels/gemm/quant_tile.h writes it (int8's
//    integers with the scales applied to the sums, int4's weights as hi + lo), the products the scheme's
//    own.
//  - Dpbf16, in the bf16 precision on AVX512_BF16 without AMX (int8 and int4, an input size that is a
//    multiple of 32): the project's kernels (kernels/gemm/quant_dpbf16.h), panels of the scheme's integers
//    with the scales applied to the sums: the bf16 rate, without int4's hi + lo doubled depth, and from 49
//    (int8) or 9 (int4) rows on, where the integer decode kernels, with int16 activations, fall behind.
//  - AmxBf16, in the bf16 precision on AMX-BF16 (an input size that is a multiple of 32): the project's
//    kernels (kernels/gemm/quant_amx.h). int4 (gemm_int4_amx_bf16) from 5 rows on, decode batches
//    included: up to 16 rows Dpbf16's scheme on tiles (one tile product per group of the scheme's
//    integers, the scales on the group sums); from 17 the weights widened to bf16 with their scales,
//    summed in the tiles over all the inputs. int8 (gemm_int8_amx_bf16) from kAmxDecodeRowsInt8 + 1 rows:
//    Dpbf16's scheme, q widened to bf16 (exact) and summed in the tiles, the channel scale on the sum.
//  - Fp32Tiles otherwise: the tile dequantized to fp32 through oneDNN's fp32 matmul.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/common/precision.h"
#include "kda/common/weights.h"

namespace kda::kernels::gemm {
class PackedMatrix;
}

namespace kda::layers {

class QuantLinear {
 public:
  static constexpr int64_t kDecodeRows = 64;
  // On the Dpbf16 path its kernels take the calls of more rows than these: where they beat the integer
  // decode kernels on cold weights at the model's shapes (Zen 4, `kda bench --only qdecode`; int4 since its
  // calls of at most 16 rows widen W in registers: docs/performance.md, "int4 decode rows on AVX512_BF16";
  // int8 since its integer kernel prefetches into L2: "int8 decode rows: the next block into L2").
  static constexpr int64_t kDpbf16DecodeRowsInt8 = 48;
  static constexpr int64_t kDpbf16DecodeRowsInt4 = 8;
  // int8 in the bf16 precision on AMX (the AmxBf16 path; the packed kernels on AMX-INT8 tiles,
  // kernels/gemm/weight_format.h, gemm_runs_amx): the packed kernels take the calls of up to these rows.
  // From there on the widened bf16 tiles are faster: at the model's shapes 0.9-1.0 of the packed kernels'
  // time at 64 rows, 0.7-0.8 at 128-256, 1.0-1.4 at 32-48 (AMX host; docs/performance.md, "int8's prefill
  // on the widened AMX tiles"). The fp32 precision keeps kDecodeRows: its prefill path takes the
  // activations unquantized.
  static constexpr int64_t kAmxDecodeRowsInt8 = 48;
  // int4 on the AmxBf16 path: its kernel, one tile product per group for up to 16 rows, ties the
  // AVX-512 packed kernel at 4 rows (whose work grows with each row) and beats the packed AMX one
  // (activations split in two) from 5 rows on, most from 9 (docs/performance.md, "int4 decode rows on
  // AMX-BF16 tiles").
  static constexpr int64_t kAmxBf16DecodeRowsInt4 = 4;
  static constexpr int64_t kTile = 256;       // output channels per fp32 tile on the prefill path
  static constexpr int64_t kBf16Tile = 2048;  // output channels per bf16 tile
  enum class Prefill { Fp32Tiles, Bf16Tiles, Dpbf16, AmxBf16 };
  // The prefill path a projection of these weights and precision takes on this CPU.
  static Prefill prefill_path_for(Weights weights, Precision precision);
  // The most rows a call of such a projection of `in` inputs sends to the packed decode kernels on this
  // CPU (decode_rows() of one built with the first constructors below).
  static int64_t decode_rows_for(Weights weights, Precision precision, int64_t in);
  // The prefill path's matmul primitives kept for reuse: one per (rows, tile width, strides), at most
  // kMaxPrimitives (least recently used dropped first), as Linear keeps its own.
  static constexpr size_t kMaxPrimitives = 32;

  // weights: Int8 or Int4 (int4 needs in_features % 32 == 0); weight [out, in] in fp32.
  QuantLinear(int64_t in_features, int64_t out_features, const std::vector<float>& weight, Weights weights,
              Precision precision);
  // W already packed (int8 or int4: kernels/gemm/weight_format.h), owned or borrowed from a mapped
  // checkpoint (io/packed_checkpoint.h): used as it is, nothing converted.
  QuantLinear(const kernels::gemm::PackedMatrix& packed, Precision precision);
  // The same with the prefill path chosen (benchmarks and tests of each on one CPU): Bf16Tiles and
  // Dpbf16 only in the bf16 precision (std::invalid_argument otherwise: fp32 activations are not bf16
  // values), Dpbf16 only on a CPU with AVX512_BF16 and an input size that is a multiple of 32, AmxBf16 only
  // on a CPU with AMX-BF16 and an input size that is a multiple of 32. The chosen path takes every call of
  // more than kDecodeRows rows (the Dpbf16 and AmxBf16 paths' own decode rows on them).
  QuantLinear(int64_t in_features, int64_t out_features, const std::vector<float>& weight, Weights weights,
              Precision precision, Prefill prefill);
  ~QuantLinear();
  QuantLinear(QuantLinear&&) noexcept;
  QuantLinear& operator=(QuantLinear&&) noexcept;

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Weights weights() const { return weights_; }
  // The packed bytes the forward reads: the quantized values and their scales.
  int64_t weight_bytes() const;
  // W as the kernels read it (kda quantize writes these bytes).
  const kernels::gemm::PackedMatrix& packed() const;
  // W as the scheme gives it, fp32 [out, in] (for tests and references).
  std::vector<float> dequantized() const;
  // W as a call of M rows multiplies it: dequantized(), but on the AmxBf16 path from
  // kernels::gemm::kAmxBf16WidenedRows rows on each weight widened to bf16 (kernels::gemm::int4_widened).
  std::vector<float> dequantized(int64_t M) const;

  void forward(const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy) const;
  void forward(const bf16_t* x, int64_t M, int64_t ldx, float* y, int64_t ldy) const;
  void forward(const float* x, int64_t M, int64_t ldx, bf16_t* y, int64_t ldy) const;
  void forward(const bf16_t* x, int64_t M, int64_t ldx, bf16_t* y, int64_t ldy) const;
  // The calling thread's scratch (shared by every QuantLinear it calls) grown to what a forward of up to M
  // rows needs on this projection's path, any input and output type, and touched (Linear::reserve).
  void reserve(int64_t M) const;

  size_t cached_primitives() const;
  Prefill prefill_path() const { return prefill_; }
  // The most rows a call sends to the packed decode kernels (more go to the prefill path).
  int64_t decode_rows() const { return decode_rows_; }

 private:
  struct Impl;
  template <class X, class Y>
  void forward_as(const X* x, int64_t M, int64_t ldx, Y* y, int64_t ldy) const;
  void prefill(const float* xf, int64_t M, int64_t ldxf, float* yf, int64_t ldyf) const;
  template <class X, class Y>
  void prefill_bf16(const X* x, int64_t M, int64_t ldx, Y* y, int64_t ldy) const;
  template <class X, class Y>
  void prefill_dpbf16(const X* x, int64_t M, int64_t ldx, Y* y, int64_t ldy) const;
  int64_t in_ = 0, out_ = 0;
  Weights weights_ = Weights::Int8;
  Precision precision_ = Precision::BF16;
  Prefill prefill_ = Prefill::Fp32Tiles;
  int64_t decode_rows_ = kDecodeRows;
  std::unique_ptr<Impl> impl_;
};

// "fp32 tiles", "bf16 tiles", "dpbf16", "amx bf16" (benchmark rows, test messages).
const char* to_string(QuantLinear::Prefill p);

}  // namespace kda::layers
