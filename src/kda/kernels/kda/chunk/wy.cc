// chunk_kda_opt, steps 4-5: the WY representation of the chunk's delta rule, T = (I + Akk)^-1, and
// the values it gives, Vn = T (beta V - (beta K exp(Gamma)) S).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/chunk/common.h"
#if defined(KDA_ISA_AVX512)
#include "kda/kernels/kda/arch/avx512/chunk_blocks.h"
#else
#include "kda/kernels/kda/arch/portable/chunk_blocks.h"
#endif

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

// Step 4: T = (I + Akk)^-1 = (I - NAkk)^-1. Diagonal blocks by substitution; then block row i:
// T[i, :i] = T_ii (NAkk[i, :i] T[:i, :i]). Every row of T is zero beyond its diagonal, which the
// lower-triangular product T R relies on.
[[gnu::noinline]] void invert(int L, Scratch& w) {
  constexpr int C = kChunk;
  // invert_diagonal_blocks writes whole 16-column rows of the diagonal blocks and the products below the
  // blocks left of them; the blocks right of the diagonal are zero (the product X reads T[:n, :n]).
  for (int r = 0; r < C - kSub; ++r) {
    const int e = (r / kSub + 1) * kSub;
    std::memset(w.T + r * C + e, 0, sizeof(float) * (C - e));
  }
  invert_diagonal_blocks(w.NAkk, w.T);
  for (int n = kSub; n < L; n += kSub) {
    const int m = std::min(kSub, L - n);
    const Seg sx{w.NAkk + n * C, C, false, w.T, C, n, false};
    gemm(m, n, &sx, 1, Init{}, w.X, C);
    const Seg st{w.T + n * C + n, C, false, w.X, C, m, true};
    gemm(m, n, &st, 1, Init{}, w.T + n * C, C);
  }
}

void wy_residual(int K, int V, int L, const float* S, Scratch& w) {
  const Seg s_r{w.Xk, K, false, S, V, K, false};
  gemm(L, V, &s_r, 1, Init{w.sv, V, w.B}, w.R, V);
}

void wy_values(int V, int L, Scratch& w, Stager& pf) {
  const Seg s_vn{w.T, kChunk, false, w.R, V, L, true};
  gemm(L, V, &s_vn, 1, Init{}, w.Vn, V, &pf);
}

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
