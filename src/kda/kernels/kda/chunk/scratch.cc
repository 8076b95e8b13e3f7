// chunk_kda_opt's per-thread working arrays (chunk/common.h), carved from one buffer per thread.
#include "kda/kernels/kda/scratch.h"

#include <algorithm>
#include <cstddef>
#include <iterator>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/chunk/common.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

namespace {

thread_local ScratchBuffer tl_scratch;

}  // namespace

Scratch::Scratch(int K, int V, int group) {
  const size_t K_ = K, V_ = V, C = kChunk, CK = C * K_, NB = kBlocks;
  const size_t r1 = std::max(K_ * C, C * V_), r2 = std::max({K_ * C, C * V_, kSub * C});
  float* r1p = nullptr;
  float* r2p = nullptr;
  const size_t sizes[] = {group * K_ * V_, CK,      CK, CK, CK, CK,    CK,    CK,    r1, r2,    NB * K_,
                          NB * K_,         NB * K_, K_, K_, K_, C * C, C * C, C * C, C,  C * V_};
  float** ptrs[] = {&S,  &Q, &Kh,  &G, &E,    &Xq,  &Xk,   &Kc, &r1p, &r2p, &fa,
                    &ra, &M, &acc, &P, &last, &Aqk, &NAkk, &T,  &B,   &sv};
  static_assert(std::size(sizes) == std::size(ptrs));
  size_t total = 0;
  for (size_t n : sizes) total += (n + 15) / 16 * 16;  // keep every array 64-byte aligned
  float* p = tl_scratch.get(total);
  for (size_t i = 0; i < std::size(sizes); ++i) {
    *ptrs[i] = p;
    p += (sizes[i] + 15) / 16 * 16;
  }
  KcT = Vn = r1p;
  Bn = X = R = r2p;
}

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
