// A small Kimi-Linear config for the serving tests (simulate, engine): full model fields at small widths.
#pragma once

#include <cstdint>
#include <vector>

#include "kda/io/config.h"

namespace kda::testing {

// KDA layers of 2 heads x 128, hidden 256; MLA 2 heads (nope 32, rope 16, v 32, kv_lora 64); a dense MLP
// of 512 at decoder layer 0, MoE layers of 4 experts of 64 (top 2) and one shared expert. `kda` and `mla`
// are 1-based layer ids; the layer count is their total.
io::KimiLinearConfig small_model_config(std::vector<int> kda, std::vector<int> mla, int64_t vocab);

}  // namespace kda::testing
