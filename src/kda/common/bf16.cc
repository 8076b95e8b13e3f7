#include "kda/common/bf16.h"

#include <omp.h>

#include "kda/common/isa_target.h"

namespace kda {

namespace {
// Passes over more than this many values are split over the threads (each part a contiguous run).
constexpr size_t kParallelMin = size_t{1} << 16;

// The loops below are compiled per ISA (KDA_TARGET_CLONES), as the build no longer targets the build
// machine's CPU: their vectorised form is what makes the bf16 mode's rounding points cheap.
KDA_TARGET_CLONES void round_bf16_run(float* x, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) x[i] = round_bf16(x[i]);
}

}  // namespace

void round_bf16_inplace(float* x, size_t n) {
  if (n < kParallelMin) return round_bf16_run(x, n);
#pragma omp parallel
  {
    const size_t nt = static_cast<size_t>(omp_get_num_threads()),
                 th = static_cast<size_t>(omp_get_thread_num());
    const size_t lo = n * th / nt, hi = n * (th + 1) / nt;
    round_bf16_run(x + lo, hi - lo);
  }
}

KDA_TARGET_CLONES void f32_to_bf16_array(const float* src, bf16_t* dst, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

KDA_TARGET_CLONES void bf16_to_f32_array(const bf16_t* src, float* dst, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace kda
