// The hidden states fed to the stack, drawn so that they do not depend on batching.
//
// Counter-based: every value is a function of (seed, request id, position, sample, element) only
// (splitmix64 over a hash of the tuple, Box-Muller to normals), so a request's inputs are the same
// whether its prompt runs in one chunk or ten, next to other requests or alone.
#pragma once

#include <cstdint>

namespace kda::serving {

// Prompt token `pos` of request `id`: D standard normals.
void prompt_input(uint64_t seed, int64_t id, int64_t pos, int64_t D, float* out);

// Decode token `pos` (>= prompt length) of continuation `sample` of request `id`: the previous
// token's last-layer output `prev` normalised to unit RMS, mixed with seeded noise
//   x = 0.8 * prev / rms(prev) + 0.6 * noise(seed, id, pos, sample)
// so that state errors compound across decode steps as they do in a model fed its own outputs.
void decode_input(uint64_t seed, int64_t id, int64_t pos, int32_t sample, const float* prev, int64_t D,
                  float* out);

}  // namespace kda::serving
