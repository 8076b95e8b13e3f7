// bfloat16 storage and the round-to-nearest-even rounding the spec's bf16 mode uses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kda {

// A bf16 value is stored as its 16 raw bits (the top half of an IEEE fp32).
using bf16_t = uint16_t;

inline bf16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<bf16_t>(u >> 16);
}

inline float bf16_to_f32(bf16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// fp32 -> nearest bf16 -> fp32: the value a bf16 tensor would hold (bf16_to_f32(f32_to_bf16(f)), NaN
// included). Written in 32-bit lanes so that simd loops do not pack to 16 bits and back.
inline float round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet_nan = (u | 0x00400000u) & 0xffff0000u;
  const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
  float out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

void round_bf16_inplace(float* x, size_t n);
void f32_to_bf16_array(const float* src, bf16_t* dst, size_t n);
void bf16_to_f32_array(const bf16_t* src, float* dst, size_t n);

// IEEE half precision (checkpoints may store F16).
float f16_to_f32(uint16_t h);

}  // namespace kda
