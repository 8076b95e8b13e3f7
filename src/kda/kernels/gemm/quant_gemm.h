// Weight-only quantized GEMM y = x W^T for the decode-sized row counts (M = 1..64): W [out, in] stored
// packed (int8 per output channel, or int4 in groups of 32 along the input), x and y fp32. The kernels
// read each packed weight byte once per call (a block of output channels stays in L1 while every row of
// x passes over it), dequantize in registers and accumulate in fp32; OpenMP threads split the output
// channels. Beside each kernel a reference with the same signature: dequantize W to fp32, then plain
// loops (the tests compare the two).
#pragma once

#include <cstdint>
#include <vector>

#include "kda/common/isa.h"

namespace kda::kernels::gemm {

// int8: W[n, k] ~= q[n * in + k] * scale[n]; q in [-127, 127], symmetric per output channel.
struct Int8Weights {
  const int8_t* q = nullptr;     // [out, in]
  const float* scale = nullptr;  // [out]
  int64_t in = 0, out = 0;
};

// int4: groups of kInt4Group consecutive inputs of one output channel share a scale; W[n, k] ~=
// (nibble(n, k) - 8) * scale[n * (in / 32) + k / 32], nibbles in [1, 15] (symmetric, -7..7). A group
// is 16 bytes: byte j holds input j in its low nibble and input j + 16 in its high one, so that one
// 16-byte load widened to 16 lanes gives both halves of the group with a mask and a shift. in must be a
// multiple of 32.
inline constexpr int64_t kInt4Group = 32;
struct Int4Weights {
  const uint8_t* q = nullptr;    // [out, in / 2]
  const float* scale = nullptr;  // [out, in / 32]
  int64_t in = 0, out = 0;
};

// Quantization at load (round to nearest, computed in double): int8 scale = max|w| / 127 per output
// channel, int4 scale = max|w| / 7 per group (a zero row or group gets scale 0). w is [out, in].
void quantize_int8(const float* w, int64_t in, int64_t out, std::vector<int8_t>& q,
                   std::vector<float>& scale);
void quantize_int4(const float* w, int64_t in, int64_t out, std::vector<uint8_t>& q,
                   std::vector<float>& scale);
// W back in fp32 [out, in], as the kernels see it; or rows [n0, n1) of it into out [(n1 - n0), in].
std::vector<float> dequantize(const Int8Weights& w);
std::vector<float> dequantize(const Int4Weights& w);
void dequantize_rows(const Int8Weights& w, int64_t n0, int64_t n1, float* out);
void dequantize_rows(const Int4Weights& w, int64_t n0, int64_t n1, float* out);

// x [M, ldx >= in], y [M, ldy >= out]; the copy for best_isa(), or for `isa` (std::invalid_argument
// when that one is not available: require_isa()).
void gemm(const float* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y, int64_t ldy);
void gemm(const float* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy);
void gemm(const float* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y, int64_t ldy, Isa isa);
void gemm(const float* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy, Isa isa);

// The references: dequantize, then y[m, n] = sum_k x[m, k] W[n, k] in fp32, k ascending.
void gemm_reference(const float* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y, int64_t ldy);
void gemm_reference(const float* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy);

}  // namespace kda::kernels::gemm
