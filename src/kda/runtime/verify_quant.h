// kda verify --weights int8 | int4: a layer with quantized projections checked against the bound its
// quantization scheme sets (the accuracy rule): its output and final recurrent state are within
// 1.1x the relative L2 error, against the dump's float64 reference, of the same layer in fp32 with the
// projections replaced by their dequantized values (the scheme alone, no kernel or activation
// rounding); and prefill -> decode invariance within 5e-3. In the bf16 precision the bound also holds
// the bf16 rounding's own error (the dump's out_bf16 against float64), in quadrature with the scheme's.
#pragma once

#include <filesystem>

#include "kda/common/weights.h"
#include "kda/io/config.h"
#include "kda/kernels/kda/kda.h"
#include "kda/models/kimi_linear.h"
#include "kda/runtime/verify.h"

namespace kda::runtime {

// The layer weights with every projection (q, k, v, f_a, g_a, b, f_b, g_b, o_proj) replaced by its
// quantized-then-dequantized values under `weights` (as layers::QuantLinear holds them).
models::KdaLayerWeights dequantized_projections(const models::KdaLayerWeights& w,
                                                const io::KimiLinearConfig& cfg, Weights weights);

// `quantized`: the layer under test; `scheme`: the fp32 dense layer on dequantized_projections().
CaseReport verify_case_quantized(models::KimiDeltaAttention& quantized, models::KimiDeltaAttention& scheme,
                                 const io::KimiLinearConfig& cfg, const std::filesystem::path& case_file,
                                 kernels::KernelImpl kernel, int invariance_tail = 8);

}  // namespace kda::runtime
