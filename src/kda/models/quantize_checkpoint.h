// `kda quantize`: a checkpoint's projections, experts and MLPs packed once into a packed checkpoint
// (io/packed_checkpoint.h) that later loads map and use in place.
#pragma once

#include <cstdint>
#include <filesystem>

#include "kda/common/weights.h"

namespace kda::models {

struct QuantizeSummary {
  int layers = 0;
  int64_t packed = 0;  // projections written packed
  int64_t copied = 0;  // tensors copied as they were (norms, conv, router, embedding, head)
  int64_t bytes = 0;   // tensor bytes written
};

// Reads the checkpoint folder `model` (a plain one: bf16 / fp32 / f16, as from_pretrained takes) and
// writes the packed checkpoint of `weights` (int8 | int4) into `out`, which must not exist or be empty:
// shards model-{i}-of-{n}.safetensors (one per decoder layer, then the embedding, norm and head), the
// index, config.json with quantization_config, and the folder's other files (tokenizer, ...) copied.
// Each layer is built as a load with conversion builds it (so the packed bytes are those) and written
// before the next is read. std::invalid_argument for bad arguments (weights, folders, a packed source),
// std::runtime_error for unreadable or malformed input, before anything is written where possible; the
// index is written last, so an interrupted run leaves no loadable checkpoint.
QuantizeSummary quantize_checkpoint(const std::filesystem::path& model, const std::filesystem::path& out,
                                    Weights weights);

}  // namespace kda::models
