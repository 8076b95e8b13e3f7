// router_logits's per-ISA copies (router_gemm.cc compiled once per ISA, see kda/common/isa_target.h),
// behind the entry point of router_gemm.h (router_gemm_dispatch.cc). Arguments checked by the caller.
// Private to the library.
#pragma once

#include <cstdint>

namespace kda::kernels::gemm {

#define KDA_ROUTER_GEMM_DECLS \
  void router_logits(const float* x, int64_t T, int64_t D, const float* packed, int64_t E, float* y);

namespace portable {
KDA_ROUTER_GEMM_DECLS
}  // namespace portable
namespace avx2 {
KDA_ROUTER_GEMM_DECLS
}  // namespace avx2
namespace avx512 {
KDA_ROUTER_GEMM_DECLS
}  // namespace avx512

#undef KDA_ROUTER_GEMM_DECLS

}  // namespace kda::kernels::gemm
