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

 private:
  int64_t D_, I_;
  Precision precision_;
  Linear gate_up_, down_;
};

// a[t, i] = silu(h[t, i]) * h[t, I + i] over T rows of h [T, 2I]; the reference beside the vectorised
// rows SwigluMlp uses (fp32 in and out; kRound: the bf16 mode, a rounded once).
void silu_mul_reference(const float* h, int64_t T, int64_t I, float* a, bool round);
void silu_mul(const float* h, int64_t T, int64_t I, float* a);
void silu_mul(const bf16_t* h, int64_t T, int64_t I, bf16_t* a);

}  // namespace kda::layers::moe
