// chunk_kda_opt, step 7: the inter-chunk state pass, S decayed over the chunk plus the chunk's keys
// against its WY values, in place (in the pool slot when possible).
#include <cstdint>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/chunk/common.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

void state_pass(int K, int V, int L, float* S, Scratch& w, Stager& pf) {
  // Kr read transposed: A(d, r) = Kr[r, d].
  const Seg s_s{w.Kc, K, true, w.Vn, V, L, false};
  gemm(K, V, &s_s, 1, Init{S, V, w.last}, S, V, &pf);
}

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
