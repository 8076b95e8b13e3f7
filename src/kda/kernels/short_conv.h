// Depthwise causal short convolution with per-request state, fused with silu (spec step 2).
//
//   y_t[c] = silu( sum_{i=0..W-1} w[c, i] * x_{t-(W-1)+i}[c] )     (tap W-1 multiplies the current token)
//
// Positions before a sequence's first token come from its conv state: the last W-1 raw pre-conv inputs,
// oldest first, layout [W-1, C] per slot (C = channels, q||k||v in the layer). After a segment the
// state holds its last W-1 raw inputs, shifted through from the old state when the segment is shorter
// than W-1. States live in a pool [num_slots, W-1, C] of fp32 (fp32 mode) or bf16 (bf16 mode); a
// sequence reads and writes slot indices[i] in place; index -1 is a padded row: zero output, no slot
// read or written. Inputs are fp32 or bf16 (x or x_bf16), outputs fp32 or bf16 (y or y_bf16).
#pragma once

#include <cstdint>

#include "kda/common/bf16.h"

namespace kda::kernels {

template <class StateT>
struct ShortConvArgs {
  // The input, exactly one of the two (when T > 0 and C > 0): fp32, or bf16 for the bf16 mode, whose
  // projections are bf16 values anyway, at half the bytes (the conv is bound on reading them). x_bf16
  // gives the bits of x holding the same values widened, with the same round_input_bf16, outputs and
  // state alike (a bf16 state keeps the inputs exactly, an fp32 one widened). Rounding a bf16 value is
  // exact, so the flag then only matters for history read from an fp32 state holding values that are not
  // bf16 (the bf16 mode never writes such).
  const float* x = nullptr;        // [T, x_stride]: channel c of token t at x[t * x_stride + c]
  const bf16_t* x_bf16 = nullptr;  // [T, x_stride]
  int64_t x_stride = 0;            // elements, of whichever input is set; >= C (the layer passes its
                                   // fused projection output)
  int64_t T = 0;
  int64_t C = 0;
  const float* weight = nullptr;  // [C, W]
  int W = 4;
  // EXTEND: [N+1] boundaries (null: one sequence of T tokens when N == 1). DECODE: ignored, T == N.
  const int32_t* cu_seqlens = nullptr;
  int64_t N = 1;
  StateT* state = nullptr;           // [num_slots, W-1, C]; null: zero history and no state kept
  const int32_t* indices = nullptr;  // [N]; null: sequence i <-> slot i; -1: padded row
  int64_t num_slots = 0;
  const uint8_t* has_initial_state = nullptr;  // [N]; null = all true; false: zero history, slot not read
  // The bf16 mode's rounding points: each input (the raw projections, so the state keeps rounded values
  // too) and each output (after silu) rounded to bf16. round_output_bf16 only applies to y: y_bf16
  // implies it.
  bool round_input_bf16 = false;
  bool round_output_bf16 = false;
  // The output, exactly one of the two (when T > 0 and C > 0): fp32, or bf16 for the bf16 mode, whose
  // consumers read bf16 anyway, at half the bytes. y_bf16 holds f32_to_bf16 of what y would hold with
  // round_output_bf16, bit for bit.
  float* y = nullptr;        // [T, y_stride]
  bf16_t* y_bf16 = nullptr;  // [T, y_stride]
  int64_t y_stride = 0;      // elements, of whichever output is set; 0: C
};

// Prefill: varlen segments of any length (0 and 1 included).
void short_conv_extend(const ShortConvArgs<float>& a);
void short_conv_extend(const ShortConvArgs<bf16_t>& a);

// Decode: one token per sequence (T == N), the state updated in place.
void short_conv_decode(const ShortConvArgs<float>& a);
void short_conv_decode(const ShortConvArgs<bf16_t>& a);

}  // namespace kda::kernels
