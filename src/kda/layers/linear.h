// A bias-free linear projection y = x W^T through oneDNN matmul (W [out, in] as checkpoints store it).
//
// fp32: fp32 weights, fp32 in and out. bf16: bf16 weights and inputs (fp32 inputs are converted here;
// they are already bf16 values in the bf16 mode), fp32 accumulation, and an fp32 output or a bf16 one
// (rounded to nearest even by the GEMM as it stores, for a caller whose next step is a bf16 rounding
// point: half the bytes written and read back). W is reordered once, at construction, into the layout
// oneDNN's matmul asks for; a primitive is created per call shape and reused (kMaxPrimitives kept).
//
// weights int8 / int4 (--weights): W is quantized at construction instead and the calls go to a
// QuantLinear (quant_linear.h) with the same inputs, outputs and rounding points.
//
// Thread safety: forward may be called from several threads at once; the primitive cache, the oneDNN
// stream and the bf16 input scratch are behind a mutex per object, so calls on one Linear take turns
// (distinct objects run in parallel).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/common/precision.h"
#include "kda/common/weights.h"

namespace kda::layers {

class Linear {
 public:
  Linear(int64_t in_features, int64_t out_features, const std::vector<float>& weight, Precision precision,
         Weights weights = Weights::BF16);
  ~Linear();
  Linear(Linear&&) noexcept;
  Linear& operator=(Linear&&) noexcept;

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Precision precision() const { return precision_; }
  Weights weights() const { return weights_; }
  // The bytes of W a forward reads: dense (2 or 4 per weight) or the packed quantized values and scales.
  int64_t weight_bytes() const;

  // x: [M, in] with row stride ldx (>= in); y: [M, out] with row stride ldy (>= out). In the bf16
  // precision x is converted to bf16 (round to nearest even) on the way in.
  void forward(const float* x, int64_t M, float* y) const { forward(x, M, in_, y, out_); }
  void forward(const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy) const;
  // bf16 input as it is, no conversion pass; only in the bf16 precision.
  void forward(const bf16_t* x, int64_t M, int64_t ldx, float* y, int64_t ldy) const;
  // bf16 output; only in the bf16 precision.
  void forward(const float* x, int64_t M, int64_t ldx, bf16_t* y, int64_t ldy) const;
  void forward(const bf16_t* x, int64_t M, int64_t ldx, bf16_t* y, int64_t ldy) const;

  // Matmul primitives kept for reuse: one per call shape, at most kMaxPrimitives (least recently used
  // dropped first).
  static constexpr size_t kMaxPrimitives = 64;
  size_t cached_primitives() const;

 private:
  struct Impl;
  template <class X, class Y>
  void forward_as(const X* x, int64_t M, int64_t ldx, Y* y, int64_t ldy) const;
  void check(int64_t M, int64_t ldx, int64_t ldy, bool bf16_io) const;
  const bf16_t* to_bf16(const float* x, int64_t M, int64_t ldx) const;
  const bf16_t* dense(const bf16_t* x, int64_t M, int64_t ldx) const;
  void run(const void* x, int64_t M, int64_t ldx, void* y, bool y_bf16, int64_t ldy) const;
  int64_t in_ = 0, out_ = 0;
  Precision precision_ = Precision::FP32;
  Weights weights_ = Weights::BF16;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kda::layers
