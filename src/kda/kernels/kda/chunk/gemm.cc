// chunk_kda_opt's products (chunk/common.h): one out-of-line function per ISA copy, its body that
// ISA's (arch/avx512: the register-blocked micro-kernel; arch/portable: plain loops, also the AVX2 copy).
#include "kda/common/isa_target.h"
#include "kda/kernels/kda/chunk/common.h"
#include "kda/kernels/kda/chunk/stager.h"
#if defined(KDA_ISA_AVX512)
#include "kda/kernels/kda/arch/avx512/chunk_gemm.h"
#else
#include "kda/kernels/kda/arch/portable/chunk_gemm.h"
#endif

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

void gemm(int M, int N, const Seg* segs, int nseg, const Init& init, float* c, int64_t ldc, Stager* pf) {
  gemm_body(M, N, segs, nseg, init, c, ldc, pf);
}

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
