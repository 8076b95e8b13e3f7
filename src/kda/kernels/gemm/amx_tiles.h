// What the AMX kernels (bf16_amx.cc, quant_amx.cc) share: the tile configuration's memory layout, as
// LDTILECFG reads it, and a compiler fence around tile loads and stores.
#pragma once

#include <cstdint>

namespace kda::kernels::gemm::amx {

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
