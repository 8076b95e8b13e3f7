#include "support/vec_math_lanes.h"

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/vec_math.h"

#if !defined(KDA_ISA_AVX512)
#error "vec_math_lanes.cc is the AVX-512 copy: compile it with KDA_ISA_AVX512"
#endif

KDA_ISA_PUSH
namespace kda::testing::avx512 {
namespace {

// A template rather than a lambda argument: a lambda's compiler-made function-pointer thunk is not in
// the target region, and an __m512 return there is an ABI change (GCC's -Wpsabi).
template <bool kSoftplus>
void lanes(const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; i += 16) {
    float in[16] = {}, res[16];
    for (size_t j = 0; j < 16 && i + j < n; ++j) in[j] = x[i + j];
    const __m512 v = _mm512_loadu_ps(in);
    _mm512_storeu_ps(
        res, kSoftplus ? kernels::avx512::vecmath::softplus16(v) : kernels::avx512::vecmath::exp16(v));
    for (size_t j = 0; j < 16 && i + j < n; ++j) y[i + j] = res[j];
  }
}

}  // namespace

void exp16_lanes(const float* x, float* y, size_t n) { lanes<false>(x, y, n); }

void softplus16_lanes(const float* x, float* y, size_t n) { lanes<true>(x, y, n); }

}  // namespace kda::testing::avx512
KDA_ISA_POP
