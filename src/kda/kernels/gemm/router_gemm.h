// The MoE router's logits, l = x W^T in fp32 (spec "MoE": an fp32 router in every mode), W [E, D] as a
// checkpoint stores it, packed once into blocks of kRouterBlock experts: block b holds experts [64 b,
// 64 b + width) as [D][width] (input d's weights of the block's experts side by side), one run of bytes per
// block, blocks one after another. Every logit is one fused multiply-add chain over the inputs in order,
// from zero: l[t, e] = fma(x[t, D-1], W[e, D-1], ... fma(x[t, 0], W[e, 0], 0)). That order does not depend
// on T, the rows beside a row or the thread that computes it, so a token routes to the same experts with the
// same combine weights in a decode step, a verify batch or a prefill; and the reference below, a scalar
// std::fma loop, gives the same bits (tests compare them exactly).
//
// oneDNN's fp32 matmul, which the router took before, spent more on a decode step's few rows than reading W
// takes, several times more on a 16-expert router (its per-call cost; docs/performance.md, "The router on
// its own kernel"). Rows are split over the threads in chunks, experts in blocks. Private to the library.
#pragma once

#include <cstdint>
#include <vector>

namespace kda::kernels::gemm {

inline constexpr int64_t kRouterBlock = 64;  // experts per block of the packing

// W [E, D] (row-major) -> the packing above, E * D floats. std::invalid_argument for E or D < 1 or a
// size that is not E * D.
std::vector<float> pack_router(const std::vector<float>& w, int64_t E, int64_t D);
// Into `packed` (E * D floats, the caller's buffer).
void pack_router(const float* w, int64_t E, int64_t D, float* packed);

// y [T, E] (row stride E) = x [T, D] (row stride D) against the packed W. std::invalid_argument for T < 0,
// E or D < 1, or null pointers where T > 0, before anything is written.
void router_logits(const float* x, int64_t T, int64_t D, const float* packed, int64_t E, float* y);
// The reference: the same chain per logit, one at a time.
void router_logits_reference(const float* x, int64_t T, int64_t D, const float* packed, int64_t E, float* y);

}  // namespace kda::kernels::gemm
