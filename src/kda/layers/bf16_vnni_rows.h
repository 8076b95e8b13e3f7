// Which bf16 rows a Linear sends to the AVX512_BF16 decode kernel (kernels/gemm/bf16_vnni.h) instead of
// oneDNN's matmul: the kernel reads W in the layout oneDNN keeps it in, so no second copy, and gives a row
// the bits oneDNN's matmul gives it, so a row computes the same whichever of the two runs its call (a
// decode row alone, in a batch, or in a prefill chunk). Private to the library and its tests.
#pragma once

#include <cstdint>
#include <dnnl.hpp>

namespace kda::layers {

// Rows per call up to which the kernel runs: up to 24 rows it is faster than oneDNN's matmul at the model's
// shapes, from 32 on about as fast or slower (docs/performance.md, "bf16 decode on AVX512_BF16" and "bf16
// decode rows: the next stretch into L2").
inline constexpr int64_t kVnniMaxRows = 24;

// The chunk of inputs oneDNN's bf16 matmul sums on its own for a W of K inputs and N outputs (the
// kernel's k_chunk), found once per shape and process by running both on probe values of that shape and
// comparing bits (oneDNN picks its blocking per shape; on the hosts measured it depended on K alone);
// -1 where this CPU has no AVX512_BF16, oneDNN multiplies with AMX tiles (their order is oneDNN's own),
// oneDNN keeps W in another layout than the kernel reads, or no chunk gives oneDNN's bits.
int64_t onednn_bf16_k_chunk(int64_t K, int64_t N);

// Whether `weights` (a bf16 W of K inputs and N outputs, as oneDNN's matmul keeps it) is in the kernel's
// layout.
bool in_vnni_layout(const dnnl::memory::desc& weights, int64_t K, int64_t N);

}  // namespace kda::layers
