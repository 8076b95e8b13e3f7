#include "kda/kernels/silu_mul.h"

#include <bit>
#include <cstdint>

#include "kda/common/isa_target.h"
#include "kda/kernels/exp_simd.h"
#include "kda/kernels/silu_mul_isa.h"

// One copy per ISA (isa_target.h); silu_mul_dispatch.cc picks one per call.
KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS {
namespace {

// Below this many outputs a parallel region costs more than it saves.
constexpr int64_t kParallelElems = 1 << 15;

// silu(g) * u as silu_mul_reference computes it, g / (1 + e^-g), with exp_simd; exp_simd clamps its
// argument, so a very negative g gives a tiny quotient rather than 0 * inf.
inline float silu_times(float g, float u) { return g / (1.0f + exp_simd(-g)) * u; }

// round_bf16's bits, shifted: f32_to_bf16 (round to nearest even, NaN kept) in a branch-free form.
inline bf16_t narrow(float v) { return static_cast<bf16_t>(std::bit_cast<uint32_t>(round_bf16(v)) >> 16); }

inline float load(float v) { return v; }
inline float load(bf16_t v) { return std::bit_cast<float>(static_cast<uint32_t>(v) << 16); }
inline void store(float v, float* d) { *d = v; }
inline void store(float v, bf16_t* d) { *d = narrow(v); }

template <class E>
void silu_mul_rows(const E* h, int64_t T, int64_t I, E* a) {
#pragma omp parallel for schedule(static) if (T * I >= kParallelElems)
  for (int64_t t = 0; t < T; ++t) {
    const E* g = h + t * 2 * I;
    const E* u = g + I;
    E* o = a + t * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) store(silu_times(load(g[i]), load(u[i])), o + i);
  }
}

}  // namespace

void silu_mul(const float* h, int64_t T, int64_t I, float* a) { silu_mul_rows(h, T, I, a); }
void silu_mul(const bf16_t* h, int64_t T, int64_t I, bf16_t* a) { silu_mul_rows(h, T, I, a); }

}  // namespace kda::kernels::KDA_ISA_NS
KDA_ISA_POP
