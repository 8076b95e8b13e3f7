// The weight formats of a projection (bf16, int8, int4: kda/common/weights.h) as one table, as ggml-cpu
// keeps one type_traits entry per quantized type: per format its storage (the packing at load and its
// size), the way back to fp32 (dequantize), the activation quantization its kernels take and the GEMM
// copy per ISA. The GEMM entry points, the reference and the projections (layers/linear.cc,
// layers/quant_linear.cc) read the table instead of taking one overload per format. The formats'
// kernels and packings are described beside them: bf16_gemm.h, quant_gemm.h.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kda/common/isa.h"
#include "kda/common/weight_buffer.h"
#include "kda/common/weights.h"

namespace kda::kernels::gemm {

// W [out, in] in one format, as the kernels read it.
struct PackedWeights {
  Weights format = Weights::BF16;
  const void* data = nullptr;    // bf16: the blocks of bf16_gemm.h; int8: int8 [out, in]; int4: nibbles
  const float* scale = nullptr;  // int8: [out]; int4: [out, in / 32]; bf16: none
  int64_t in = 0, out = 0;
};

// x as a format's kernel takes it: the fp32 rows, and for int8 / int4 the int16 rows [M, in] (contiguous)
// with their scales (quantize_activations).
struct Activations {
  const float* x = nullptr;
  int64_t ldx = 0;
  const int16_t* xq = nullptr;
  const float* sx = nullptr;
};
using GemmKernel = void (*)(const Activations& x, int64_t M, const PackedWeights& w, float* y, int64_t ldy);

struct WeightFormat {
  Weights format;
  const char* name;
  int64_t in_multiple;  // the input size must be a multiple of it (int4: its group of 32)
  // Inputs that share an activation scale (int8: the row, int4: a group of 32) and the largest quantized
  // value; nullptr: the activations stay fp32 (bf16).
  int64_t (*activation_run)(int64_t in);
  int (*activation_qmax)(int64_t in);
  int64_t (*data_bytes)(int64_t in, int64_t out);
  int64_t (*scale_count)(int64_t in, int64_t out);
  // W [out, in] in fp32 into data [data_bytes] and scale [scale_count] (in and out already checked).
  void (*pack)(const float* w, int64_t in, int64_t out, uint8_t* data, float* scale);
  // Rows [n0, n1) of W as the kernels see it, in fp32 into out [(n1 - n0), in].
  void (*dequantize_rows)(const PackedWeights& w, int64_t n0, int64_t n1, float* out);
  GemmKernel gemm[3];  // per Isa (Portable, Avx2, Avx512); nullptr for a copy not in this build
};

const WeightFormat& weight_format(Weights w);

// W packed in one format: owning its bytes (packed here from fp32), or borrowing bytes packed before
// (a mapped checkpoint's, io/packed_checkpoint.h), kept alive by `owner`. std::invalid_argument for
// empty or mis-sized weights, or an input size the format does not take.
class PackedMatrix {
 public:
  PackedMatrix(Weights format, const float* w, int64_t in, int64_t out);
  // `view` must hold data_bytes(in, out) bytes at view.data and scale_count(in, out) floats at view.scale
  // (the format's table): the caller has checked the sizes against the tensors it maps.
  PackedMatrix(const PackedWeights& view, std::shared_ptr<const void> owner);
  PackedMatrix(const PackedMatrix& o);
  PackedMatrix& operator=(const PackedMatrix& o);
  PackedMatrix(PackedMatrix&&) noexcept = default;  // a move keeps the buffer: view_ stays valid
  PackedMatrix& operator=(PackedMatrix&&) noexcept = default;

  const PackedWeights& view() const { return view_; }
  bool borrowed() const { return owner_ != nullptr; }
  // The packed values' and the scales' byte counts (the format's table), and their sum: what a GEMM
  // reads.
  int64_t data_bytes() const;
  int64_t scale_count() const;
  int64_t bytes() const { return data_bytes() + static_cast<int64_t>(sizeof(float)) * scale_count(); }

 private:
  void point_at_own();
  static WeightBuffer copy_of(const WeightBuffer& from, size_t n);  // empty from empty
  WeightBuffer data_;   // owned bytes (weight_buffer.h: in huge pages); empty when borrowed
  WeightBuffer scale_;  // owned scales, as data_; empty when borrowed or the format has none
  std::shared_ptr<const void> owner_;
  PackedWeights view_;
};

// W back in fp32 [out, in], as the kernels see it; or rows [n0, n1) of it into out [(n1 - n0), in].
std::vector<float> dequantize(const PackedWeights& w);
void dequantize_rows(const PackedWeights& w, int64_t n0, int64_t n1, float* out);

// y = x W^T: x [M, ldx >= in], y [M, ldy >= out]; the copy for best_isa(), or for `isa`
// (std::invalid_argument when that one is not available: require_isa()). int8 / int4: x quantized to
// int16 first (quantize_activations).
void gemm(const float* x, int64_t M, int64_t ldx, const PackedWeights& w, float* y, int64_t ldy);
void gemm(const float* x, int64_t M, int64_t ldx, const PackedWeights& w, float* y, int64_t ldy, Isa isa);

// Whether gemm() (best_isa()'s copy) runs this format's AMX tile kernels (quant_amx.h) for W of `in`
// inputs, from their row counts on: int8 and int4 on a CPU with the tiles they need, int8 for an input
// size amx_takes. Their time grows with the rows at about the bf16 tiles' GEMM rate, so they stay the
// faster path up to a few hundred rows (QuantLinear::decode_rows_for).
bool gemm_runs_amx(Weights format, int64_t in);

// The reference: x quantized as the kernels take it and dequantized (int8, int4; bf16: as it is), W
// dequantized, then y[m, n] = sum_k x[m, k] W[n, k] in fp32, k ascending.
void gemm_reference(const float* x, int64_t M, int64_t ldx, const PackedWeights& w, float* y, int64_t ldy);

}  // namespace kda::kernels::gemm
