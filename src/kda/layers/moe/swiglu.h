// One SwiGLU MLP, E(x) = down(silu(gate x) * (up x)): the dense MLP, the shared expert and each routed
// expert. gate and up are one fused [2I, D] Linear (one GEMM, one pass over x); down is [D, I].
//
// bf16 precision: the gate/up GEMM writes bf16 (its outputs are rounding points), silu(g) * u is
// rounded once (silu itself is not), and down reads it as bf16; down's output is rounded when the caller
// asks (round_out): it is a rounding point only where the output is a whole MLP's, not a tensor-parallel
// partial sum.
//
// Thread safety: forward only reads the weights; each call brings its own scratch.
#pragma once

#include <cstdint>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/common/precision.h"
#include "kda/common/weights.h"
#include "kda/layers/linear.h"

namespace kda::layers::moe {

struct SwigluScratch {
  std::vector<float> h, a;       // fp32: gate|up [T, 2I], silu*up [T, I]
  std::vector<bf16_t> h16, a16;  // bf16: the same, stored as bf16
};

class SwigluMlp {
 public:
  // gate, up [I, D], down [D, I], fp32 values (converted or quantized here per precision / weights).
  SwigluMlp(int64_t D, int64_t I, const std::vector<float>& gate, const std::vector<float>& up,
            const std::vector<float>& down, Precision precision, Weights weights);
  // Projections built already: gate_up [2I, D] (gate rows, then up rows), down [D, I] (a packed
  // checkpoint's, layers/packed_linears.h); std::invalid_argument when the shapes disagree.
  SwigluMlp(int64_t D, int64_t I, Linear gate_up, Linear down, Precision precision);

  int64_t hidden() const { return D_; }
  int64_t intermediate() const { return I_; }
  int64_t weight_bytes() const { return gate_up_.weight_bytes() + down_.weight_bytes(); }
  const Linear& gate_up() const { return gate_up_; }
  const Linear& down() const { return down_; }

  // x [T, D] with row stride ldx -> out [T, D] with row stride ldo.
  void forward(const float* x, int64_t T, int64_t ldx, float* out, int64_t ldo, bool round_out,
               SwigluScratch& scratch) const;
  // The bf16 precision with x as bf16 rows (what gate_up would round fp32 x to; a MoE converts its input
  // once for the shared and every routed expert), out fp32 (rounded where round_out) or bf16 (always a
  // rounding point: down's output rounded as it is stored). std::logic_error in the fp32 precision.
  void forward(const bf16_t* x, int64_t T, int64_t ldx, float* out, int64_t ldo, bool round_out,
               SwigluScratch& scratch) const;
  void forward(const bf16_t* x, int64_t T, int64_t ldx, bf16_t* out, int64_t ldo,
               SwigluScratch& scratch) const;
  // `scratch` and the projections' thread scratch grown to a forward of up to T rows, and touched.
  void reserve(int64_t T, SwigluScratch& scratch) const;

 private:
  int64_t D_, I_;
  Precision precision_;
  Linear gate_up_, down_;
  template <class Y>
  void forward_bf16(const bf16_t* x, int64_t T, int64_t ldx, Y* out, int64_t ldo, bool round_out,
                    SwigluScratch& scratch) const;
};

// One MLP as `pieces` SwigluMlps over consecutive slices of its intermediate rows (gate / up rows,
// down columns), as tensor parallelism splits it within one process: piece p's down output is a partial
// sum, and E(x) is the pieces' partials added in piece order. At decode an expert is then `pieces` jobs
// of equal size, so the selected experts (top-k + shared) split evenly over the threads, each thread
// streaming its own pieces' weights (9 whole experts on 2 threads left one thread a tenth of the step idle).
// bf16: each piece's gate/up and silu*up as SwigluMlp rounds them; the sum of the partials is the down
// output's rounding point (round_out), as a whole MLP's.
class SwigluPieces {
 public:
  // pieces_for(I, weights, want) pieces (std::invalid_argument for want < 1).
  SwigluPieces(int64_t D, int64_t I, const std::vector<float>& gate, const std::vector<float>& up,
               const std::vector<float>& down, Precision precision, Weights weights, int want_pieces);

  // The most pieces up to `want` that split I evenly into slices of a multiple of 32 rows (int4's
  // groups, the widened bf16 kernels' input groups: the down input of a slice needs no padding); 1 when
  // none does.
  static int pieces_for(int64_t I, Weights weights, int want);
  // Pieces built already (a packed checkpoint's, in piece order): each [.., D] over I / pieces rows.
  SwigluPieces(int64_t D, int64_t I, std::vector<SwigluMlp> pieces);
  const SwigluMlp& piece(int p) const { return pieces_.at(static_cast<size_t>(p)); }

  int64_t hidden() const { return D_; }
  int64_t intermediate() const { return I_; }
  int pieces() const { return static_cast<int>(pieces_.size()); }
  int64_t weight_bytes() const;

  // Piece p's partial down output, x [T, D] (stride ldx) -> part [T, D] (stride ldp), never rounded.
  void forward_piece(int p, const float* x, int64_t T, int64_t ldx, float* part, int64_t ldp,
                     SwigluScratch& scratch) const;
  // The whole MLP: the pieces one after another (their GEMMs threaded), partials added in piece order;
  // `part` is [T, D] scratch for pieces after the first.
  void forward(const float* x, int64_t T, int64_t ldx, float* out, int64_t ldo, bool round_out,
               SwigluScratch& scratch, std::vector<float>& part) const;
  // The same from bf16 rows (SwigluMlp's bf16 forward).
  void forward(const bf16_t* x, int64_t T, int64_t ldx, float* out, int64_t ldo, bool round_out,
               SwigluScratch& scratch, std::vector<float>& part) const;
  // One piece only (std::logic_error else: the pieces' partials are summed in fp32 before the rounding):
  // bf16 rows in, bf16 rows out.
  void forward(const bf16_t* x, int64_t T, int64_t ldx, bf16_t* out, int64_t ldo,
               SwigluScratch& scratch) const;
  // What forward and forward_piece take for up to T rows, grown and touched (SwigluMlp::reserve).
  void reserve(int64_t T, SwigluScratch& scratch, std::vector<float>& part) const;
  // out [T, D] (stride ldo) += part [T, D] (stride ldp).
  static void add_part(float* out, int64_t ldo, const float* part, int64_t ldp, int64_t T, int64_t D);

 private:
  int64_t D_, I_;
  std::vector<SwigluMlp> pieces_;
  template <class X>
  void forward_as(const X* x, int64_t T, int64_t ldx, float* out, int64_t ldo, bool round_out,
                  SwigluScratch& scratch, std::vector<float>& part) const;
};

// a[t, i] = silu(h[t, i]) * h[t, I + i] over T rows of h [T, 2I]; the reference (libm's expf; fp32 in and
// out; round: the bf16 mode, a rounded once) beside the rows SwigluMlp uses: kernels/silu_mul.h's per-ISA
// copies, whose vectorised exp keeps them within 2e-7 relative of it.
void silu_mul_reference(const float* h, int64_t T, int64_t I, float* a, bool round);
void silu_mul(const float* h, int64_t T, int64_t I, float* a);
void silu_mul(const bf16_t* h, int64_t T, int64_t I, bf16_t* a);

}  // namespace kda::layers::moe
