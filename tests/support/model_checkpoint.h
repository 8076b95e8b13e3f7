// Whole-model checkpoints for tests: random weights in the real checkpoint layout for any config, written
// as the real checkpoint is laid out (config.json, shards in key order, model.safetensors.index.json), and
// read back as fp32 for the float64 reference.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include "kda/io/config.h"
#include "kda/io/safetensors.h"

namespace kda::testing {

// All of a model's weights as fp32 values, by checkpoint key (what the reference reads).
using TensorMap = std::map<std::string, io::StTensor>;

// Random weights in the real checkpoint layout for a config (every key of kimi-linear-model.md
// "Checkpoint keys" and the KDA layers' keys of kda-numerics.md), scaled so that activations stay O(1)
// through the layers; the router correction bias small normals. dtype BF16 stores bf16 values (A_log and
// dt_bias stay F32), F32 stores fp32. The values held are exactly those the file will store.
TensorMap random_model_weights(const io::KimiLinearConfig& cfg, uint64_t seed, io::StDType dtype);

// Writes config.json (every field parse_model_config needs, from cfg), model-0000k-of-0000n.safetensors
// shards split in key order, and model.safetensors.index.json, as the real checkpoint is laid out.
// Throws std::invalid_argument when shards < 1 or exceeds the number of tensors.
void write_model_checkpoint(const std::filesystem::path& dir, const io::KimiLinearConfig& cfg,
                            const TensorMap& weights, int shards = 2);

// Every tensor of a checkpoint folder (index + shards, or model.safetensors) as fp32, dtype as stored.
TensorMap read_model_weights(const std::filesystem::path& dir);

// The config.json text write_model_checkpoint writes for cfg.
std::string model_config_json(const io::KimiLinearConfig& cfg);

}  // namespace kda::testing
