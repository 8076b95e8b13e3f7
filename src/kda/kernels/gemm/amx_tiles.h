// What the AMX kernels (bf16_amx.cc, bf16_amx_block.cc, quant_amx.cc) share: whether this build has them,
// the tile configuration's memory layout, as LDTILECFG reads it, a compiler fence around tile loads and
// stores, and the bf16 kernels' argument checks.
#pragma once

#include <cstdint>

#include "kda/common/bf16.h"

// The AMX kernels are built with GCC's tile intrinsics on x86-64 Linux (the tile data is granted per
// process through arch_prctl), beside the AVX-512 copies.
#if defined(KDA_WITH_AVX512) && defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    defined(__linux__)
#define KDA_AMX_BUILD 1
#include "kda/kernels/kda/avx512.h"  // <immintrin.h>, its GCC 12 false warnings silenced
#endif

namespace kda::kernels::gemm::amx {

// y[M, N] = x[M, K] W^T's arguments (std::invalid_argument naming `what`, before anything is written): K
// and N positive, M not negative, row strides at least K and N, data where M > 0.
void check_bf16_gemm_args(const char* what, const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w,
                          int64_t K, int64_t N, const float* y, int64_t ldy);

// GCC's tile store and load intrinsics are asm statements that do not tell the compiler they touch
// memory: stores to a buffer a tile loads next, and loads of one a tile stored, stay on their side of this.
#define KDA_TILE_FENCE() asm volatile("" ::: "memory")

// Palette 1: per tile its bytes per row (colsb) and rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace kda::kernels::gemm::amx
