// silu_mul's entry points: the copy for the fastest ISA this CPU runs (best_isa()). Only the copies in
// the build are referenced.
#include "kda/common/isa.h"
#include "kda/kernels/silu_mul.h"
#include "kda/kernels/silu_mul_isa.h"

namespace kda::kernels {
namespace {

template <class T>
void dispatch(const T* h, int64_t rows, int64_t I, T* a) {
  switch (best_isa()) {
#if defined(KDA_WITH_AVX512)
    case Isa::Avx512:
      return avx512::silu_mul(h, rows, I, a);
#endif
#if defined(KDA_WITH_AVX2)
    case Isa::Avx2:
      return avx2::silu_mul(h, rows, I, a);
#endif
    default:
      return portable::silu_mul(h, rows, I, a);
  }
}

}  // namespace

void silu_mul(const float* h, int64_t T, int64_t I, float* a) { dispatch(h, T, I, a); }
void silu_mul(const bf16_t* h, int64_t T, int64_t I, bf16_t* a) { dispatch(h, T, I, a); }

}  // namespace kda::kernels
