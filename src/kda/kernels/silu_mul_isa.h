// silu_mul's per-ISA copies (silu_mul.cc compiled once per ISA, see kda/common/isa_target.h), behind the
// entry points of silu_mul.h. Private to the library.
#pragma once

#include "kda/kernels/silu_mul.h"

namespace kda::kernels {

#define KDA_SILU_MUL_DECLS                                       \
  void silu_mul(const float* h, int64_t T, int64_t I, float* a); \
  void silu_mul(const bf16_t* h, int64_t T, int64_t I, bf16_t* a);

namespace portable {
KDA_SILU_MUL_DECLS
}  // namespace portable
namespace avx2 {
KDA_SILU_MUL_DECLS
}  // namespace avx2
namespace avx512 {
KDA_SILU_MUL_DECLS
}  // namespace avx512

#undef KDA_SILU_MUL_DECLS

}  // namespace kda::kernels
