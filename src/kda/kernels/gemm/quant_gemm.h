// Weight-only quantized GEMM y = x W^T for the decode-sized row counts (M = 1..64): W [out, in] stored
// packed (int8 per output channel, or int4 in groups of 32 along the input), x and y fp32. Each row of x
// is first quantized to int16 symmetrically (quantize_activations; one scale per row for int8
// weights, one per group of 32 inputs for int4 weights), so that the dot products run in integers
// (AVX-512: vpmaddwd / vpmaddubsw, or AVX512_VNNI's vpdpwssd / vpdpbusd where the CPU has them; the
// same integer sums either way) and each int32 sum is converted and scaled once per channel (int8) or
// per group (int4) instead of every weight being widened to fp32. The kernels read each packed weight
// byte once per call (a block of output channels stays in L1 while every row of x passes over it);
// OpenMP threads split the output channels. Beside each kernel a reference with the same signature
// that quantizes x the same way, then dequantizes x and W to fp32 and runs plain loops (the tests
// compare the two within fp32 rounding; weight_format.h has both).
//
// The activation rounding this adds (a relative step of 2^-15 of the row's, or the group's, largest
// value) is finer than the bf16 rounding of the layer input. The int4 groups of x are the weights'
// groups, so that a row-parallel shard (split at a multiple of 32 inputs) quantizes its part of x
// exactly as the whole row is. (int8 activations, which would let int4 weights take one vpdpbusd per
// 64 weights instead of two, moved the decode output by about 1% against the prefill path's fp32 one.)
#pragma once

#include <cstdint>

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
// channel, int4 scale = max|w| / 7 per group (a zero row or group gets scale 0; one holding a NaN or
// Inf gets scale NaN and zero values, so that it dequantizes to NaN and its outputs are NaN, as a dense
// projection propagates it). w is [out, in]; q and scale sized as weight_format.h's table says (int8:
// [out, in] and [out]; int4: [out, in / 2] and [out, in / 32]).
void quantize_int8(const float* w, int64_t in, int64_t out, int8_t* q, float* scale);
void quantize_int4(const float* w, int64_t in, int64_t out, uint8_t* q, float* scale);
// Rows [n0, n1) of W in fp32, as the kernels see it, into out [(n1 - n0), in].
void dequantize_int8_rows(const Int8Weights& w, int64_t n0, int64_t n1, float* out);
void dequantize_int4_rows(const Int4Weights& w, int64_t n0, int64_t n1, float* out);

// The activation quantization the kernels and the references share, of x[0..n) (a row for int8
// weights, each group of 32 for int4 ones): s = max|x| / qmax (as float; 0 for all zeros), q[k] =
// round to nearest (x[k] / s), clamped to [-qmax, qmax]; returns s (NaN, q all zero, where x holds a
// NaN or Inf: every output the run feeds is then NaN, as on the dense path). int8 weights take qmax =
// activation_qmax(in) (32767, less for inputs so long that one int32 lane of the kernel could
// overflow); int4 weights kInt4ActivationMax.
inline constexpr int kInt4ActivationMax = 32767;
int activation_qmax(int64_t in);
float quantize_activations(const float* x, int64_t n, int qmax, int16_t* q);

// The entry points, the reference and the packing into owned storage: weight_format.h.

}  // namespace kda::kernels::gemm
