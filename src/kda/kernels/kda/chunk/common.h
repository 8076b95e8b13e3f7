// chunk_kda_opt's pieces (chunk_kda.cc has the overview): the chunk's sizes, the product descriptions
// that its micro-kernel runs, each thread's working arrays, and the steps that each chunk goes through,
// one file each (the same split as fla/ops/kda):
//   chunk/gate.cc       step 2: in-block decays and block anchors of the gate, and applying the anchors
//   chunk/intra.cc      step 3: Aqk and Akk inside the chunk
//   chunk/wy.cc         steps 4-5: T = (I + Akk)^-1, the WY values Vn = T (beta V - (beta K exp(Gamma)) S)
//   chunk/output.cc     step 6: O = (Q exp(Gamma)) S + Aqk Vn
//   chunk/state_pass.cc step 7: the state passed to the next chunk
//   chunk/gemm.cc       the products C = init + A B of steps 3-7 (micro-kernels under arch/)
//   chunk/stager.h      step 1, staged a row at a time while the chunk before computes
// Every file of the set is compiled once per ISA (isa_target.h); this header's code is inside the ISA's
// namespace, so each copy has its own.
#pragma once

#include <cstdint>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/impl.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

constexpr int kChunk = 64;  // C
constexpr int kSub = 16;    // block size of the decay anchoring
constexpr int kBlocks = kChunk / kSub;
constexpr int kMaxGroup = 4;  // heads that advance together through a sequence (see process_item)

// One product term A[M, kd] B[kd, N] of a micro-kernel call. A(i, d) is a[i * lda + d], or with `at`
// (A stored transposed) a[d * lda + i]; B row d starts at b + d * ldb. `lower`: A is lower triangular
// with its diagonal, so the rows r0..r0+m-1 of a tile only need the first r0+m columns of A (A must hold
// zeros above the diagonal inside the tile's rows).
struct Seg {
  const float* a;
  int64_t lda;
  bool at;
  const float* b;
  int64_t ldb;
  int kd;
  bool lower;
};

// Initial value of C: rows of src scaled by scale[row] (null scale: by 1), or zero when src is null.
struct Init {
  const float* src = nullptr;
  int64_t ld = 0;
  const float* scale = nullptr;
};

// One thread's working arrays, carved from its buffer (a thread_local that only grows, so steady-state
// calls allocate nothing). Rows are [C, K] unless noted. Arrays that are never live at the same time
// share memory (the scratch stays well inside L2, next to the states).
struct Scratch {
  float* S = nullptr;   // [kMaxGroup, K, V] private states when the pool slots cannot be updated in place
  float* Q = nullptr;   // scale * q-hat
  float* Kh = nullptr;  // k-hat
  float* G = nullptr;   // log-space gate g
  float* E = nullptr;   // exp(g)
  float* Xq = nullptr;  // q_r * exp(Gamma_r - Gamma_n), n the block's first row; then Q * exp(Gamma) (Qf)
  float* Xk = nullptr;  // -beta_r k_r * exp(Gamma_r - Gamma_n); then -beta K * exp(Gamma) (Wn)
  // k_s * exp(Gamma_e - Gamma_s), e the block's last row; then K * exp(Gamma_last - Gamma) (Kr)
  float* Kc = nullptr;
  float* KcT = nullptr;  // [K, C] Kc transposed (step 3)
  float* Bn = nullptr;   // [K, C] KcT times the block-to-block decays of one query block (step 3)
  float* X = nullptr;    // [kSub, C] (step 4)
  float* R = nullptr;    // [C, V] (step 5)
  float* Vn = nullptr;   // [C, V] (steps 5-7)
  float* fa = nullptr;   // [kBlocks, K] exp(Gamma_n), n the first row of each block
  float* ra = nullptr;   // [kBlocks, K] exp(Gamma_last - Gamma_e), e the last row of each block
  // [kBlocks, K] exp(Gamma_n - Gamma_e') for one query block n and the earlier blocks' last rows e'
  float* M = nullptr;
  float* acc = nullptr;   // [K] running sums
  float* P = nullptr;     // [K] running products
  float* last = nullptr;  // [K] exp(Gamma_last)
  float* Aqk = nullptr;   // [C, C]
  float* NAkk = nullptr;  // [C, C] -Akk
  float* T = nullptr;     // [C, C] (I + Akk)^-1
  float* B = nullptr;     // [C] beta
  // The (chunk, head) named by staged_t0 / staged_h has had its step 1 done by the Stager: Q, Kh, G, E
  // and B hold its rows and sv its v (written during steps 5-7 of the chunk before, when they are dead,
  // or at the start of a work item's first chunk).
  float* sv = nullptr;  // [C, V]
  int64_t staged_t0 = -1;
  int staged_h = -1;

  // The calling thread's arrays for heads of K x V and groups of `group` heads (std::bad_alloc when its
  // buffer cannot grow).
  Scratch(int K, int V, int group);
};

class Stager;

// C[M, N] = init + sum over segs of A B (C may alias init.src: every tile reads its own init first).
// During each full micro-tile pf (if any) prefetches its next lines, and after it prepares the rows due.
// This and the steps below are kept out of line: inlined all into one function, GCC 12 compiles the
// chunk into much slower code.
[[gnu::noinline]] void gemm(int M, int N, const Seg* segs, int nseg, const Init& init, float* c, int64_t ldc,
                            Stager* pf = nullptr);

// The steps of one chunk of L rows of one head (K x V state S), in order, on w's arrays.
[[gnu::noinline]] void decays(int K, int L, Scratch& w);           // step 2 (gate.cc)
[[gnu::noinline]] void build_attention(int K, int L, Scratch& w);  // step 3 (intra.cc)
[[gnu::noinline]] void apply_anchors(int K, int L, Scratch& w);    // after step 3 (gate.cc)
[[gnu::noinline]] void invert(int L, Scratch& w);                  // step 4 (wy.cc)
// Step 5 (wy.cc), in two products, so that the next unit's staging can start between them (R has read
// this chunk's v and beta): R = beta V + Wn S, then Vn = T R while pf stages.
void wy_residual(int K, int V, int L, const float* S, Scratch& w);
void wy_values(int V, int L, Scratch& w, Stager& pf);
// Step 6 (output.cc): O = Qf S + Aqk Vn into o (rows ldo apart).
void chunk_output(int K, int V, int L, const float* S, Scratch& w, float* o, int64_t ldo, Stager& pf);
// Step 7 (state_pass.cc): S <- diag(exp(Gamma_last)) S + Kr^T Vn.
void state_pass(int K, int V, int L, float* S, Scratch& w, Stager& pf);

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
