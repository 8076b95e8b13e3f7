// chunk_kda_opt, step 6: the chunk's output, the state's contribution and the intra-chunk one,
// written straight into o.
#include <cstdint>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/chunk/common.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

void chunk_output(int K, int V, int L, const float* S, Scratch& w, float* o, int64_t ldo, Stager& pf) {
  const Seg s_o[2] = {{w.Xq, K, false, S, V, K, false}, {w.Aqk, kChunk, false, w.Vn, V, L, true}};
  gemm(L, V, s_o, 2, Init{}, o, ldo, &pf);
}

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
