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
// bf16 precision with bf16 weights multiplies one of three ways (Bf16Gemm), chosen at construction:
// - OneDnn: oneDNN's bf16 matmul, W reordered into its layout (above). On a CPU with AMX its tiles sum
//   a row in an order set by the call's row count, so a row's bits depend on its batch unless the
//   process asked for batch invariance (src/kda/layers/onednn_isa.h: AVX512_BF16 kernels only).
// - OneDnnVnni: the same, but calls of up to kVnniMaxRows rows (decode batches, verify steps, the LM head
//   of a batch) go to the AVX512_BF16 decode kernel
//   (kernels/gemm/bf16_vnni.h) on the same copy of W, which reads it near the memory bandwidth where
//   oneDNN's kernels do not, and gives each row oneDNN's bits (src/kda/layers/bf16_vnni_rows.h).
// - Widened: W kept as bf16 in its [out, in] layout and multiplied by the bf16 GEMM kernels
//   (kernels/gemm/bf16_gemm.h: one pass over W per 64 rows, a row's result independent of the batch it
//   is in, so a token computes the same bits in a decode step, a verify row or a prefill). The same
//   rounding points: bf16 x, fp32 accumulation, a bf16 y rounded to nearest even.
// - OneDnnAmx: where oneDNN multiplies with AMX tiles, calls of up to 64 rows (decode and verify batches)
//   go to the project's AMX decode kernel (kernels/gemm/bf16_amx_block.h, gemm_bf16_amx_rows) on the same
//   copy of W, read from memory once per call in address order; oneDNN keeps the calls of more rows. A decode
//   row's bits do not depend on the rows beside it (oneDNN's AMX kernels' do); they are oneDNN's where its
//   kernel for the shape sums the inputs in one run (docs/performance.md, "bf16 decode rows on AMX tiles").
// - Auto: OneDnnVnni where the CPU has bf16 GEMM hardware (cpu_has_bf16_gemm()) and the kernel gives
//   oneDNN's bits there (not with AMX tiles), OneDnnAmx where oneDNN uses AMX tiles and the input size
//   is a multiple of 32, else OneDnn there, Widened elsewhere. Without
//   AVX512_BF16 oneDNN emulates its bf16 matmul: fast for one row, but compute-bound from two rows on
//   (verifying 4 drafted tokens cost what decoding them one by one does) and below its fp32 matmul's
//   speed at prefill.
//
// Thread safety: forward may be called from several threads at once; the primitive cache and the oneDNN
// stream are behind a mutex per object, so calls on one Linear that go to oneDNN take turns (distinct
// objects run in parallel; OneDnnVnni's and OneDnnAmx's decode rows touch neither and take no lock); input /
// output conversion scratch is the calling thread's, shared by all its projections.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/common/precision.h"
#include "kda/common/weights.h"

namespace kda::kernels::gemm {
class PackedMatrix;
}

namespace kda::layers {

enum class Bf16Gemm { Auto, OneDnn, OneDnnVnni, Widened, OneDnnAmx };

class Linear {
 public:
  // bf16_gemm other than Auto only with the bf16 precision and bf16 weights (std::invalid_argument);
  // OneDnnVnni where the kernel cannot give oneDNN's bits here, and OneDnnAmx where oneDNN does not use
  // AMX tiles or the input size is not a multiple of 32, are std::invalid_argument too.
  Linear(int64_t in_features, int64_t out_features, const std::vector<float>& weight, Precision precision,
         Weights weights = Weights::BF16, Bf16Gemm bf16_gemm = Bf16Gemm::Auto);
  // bf16 weights from bf16 values, [out, in] row-major (a checkpoint's tensor as its mapping holds it):
  // the bf16 precision reorders them into oneDNN's layout as they are, with no fp32 copy of W on the way
  // (a loader's cost at the LM head's size); the fp32 precision and the widened kernels widen them.
  Linear(int64_t in_features, int64_t out_features, const bf16_t* weight, Precision precision,
         Bf16Gemm bf16_gemm = Bf16Gemm::Auto);
  // W already packed in the kernels' layout (kernels/gemm/weight_format.h), owned or borrowed from a
  // mapped checkpoint (io/packed_checkpoint.h), used as it is: int8 / int4 go to a QuantLinear; bf16
  // (the widened kernels' blocks) only in the bf16 precision, as Bf16Gemm::Widened. Other combinations
  // are std::invalid_argument.
  Linear(const kernels::gemm::PackedMatrix& packed, Precision precision);
  ~Linear();
  Linear(Linear&&) noexcept;
  Linear& operator=(Linear&&) noexcept;

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Precision precision() const { return precision_; }
  Weights weights() const { return weights_; }
  // OneDnn, OneDnnVnni, OneDnnAmx or Widened for a bf16 projection with bf16 weights (Auto resolved);
  // OneDnn otherwise.
  Bf16Gemm bf16_gemm() const { return bf16_gemm_; }
  // The bytes of W a forward reads: dense (2 or 4 per weight) or the packed quantized values and scales.
  int64_t weight_bytes() const;
  // W as the kernels read it: the int8 / int4 packing or the widened bf16 blocks; nullptr where oneDNN
  // holds W in its own layout (kda quantize writes the packed bytes).
  const kernels::gemm::PackedMatrix* packed() const;

  // x: [M, in] with row stride ldx (>= in); y: [M, out] with row stride ldy (>= out). In the bf16
  // precision x is converted to bf16 (round to nearest even) on the way in.
  void forward(const float* x, int64_t M, float* y) const { forward(x, M, in_, y, out_); }
  void forward(const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy) const;
  // bf16 input as it is, no conversion pass; only in the bf16 precision.
  void forward(const bf16_t* x, int64_t M, int64_t ldx, float* y, int64_t ldy) const;
  // bf16 output; only in the bf16 precision.
  void forward(const float* x, int64_t M, int64_t ldx, bf16_t* y, int64_t ldy) const;
  void forward(const bf16_t* x, int64_t M, int64_t ldx, bf16_t* y, int64_t ldy) const;

  // Grows the calling thread's conversion scratch (shared by every projection the thread calls) to what a
  // forward of up to M rows needs, any input and output type, and touches it: a model sizes its
  // workspaces at load for the scheduler's token budget, so a server's first long prompt does not fault
  // them in (KimiLinearForCausalLM::reserve).
  void reserve(int64_t M) const;

  // Matmul primitives kept for reuse: one per call shape, at most kMaxPrimitives (least recently used
  // dropped first).
  static constexpr size_t kMaxPrimitives = 64;
  size_t cached_primitives() const;

 private:
  struct Impl;
  template <class X, class Y>
  void forward_as(const X* x, int64_t M, int64_t ldx, Y* y, int64_t ldy) const;
  void check(int64_t M, int64_t ldx, int64_t ldy, bool bf16_io) const;
  void init_dense(const float* wf, const bf16_t* wb, Bf16Gemm bf16_gemm);
  const bf16_t* to_bf16(const float* x, int64_t M, int64_t ldx) const;
  const bf16_t* dense(const bf16_t* x, int64_t M, int64_t ldx) const;
  void run(const void* x, int64_t M, int64_t ldx, void* y, bool y_bf16, int64_t ldy) const;
  int64_t in_ = 0, out_ = 0;
  Precision precision_ = Precision::FP32;
  Weights weights_ = Weights::BF16;
  Bf16Gemm bf16_gemm_ = Bf16Gemm::OneDnn;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kda::layers
