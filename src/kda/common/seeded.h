// Seeded draws that must not depend on batching or on the order things are built in: the simulation's
// prompts and drafts, the synthetic models' weights.
//
// Counter-based: every value is a function of (seed, a key tuple, element) only (splitmix64 over a hash
// of the tuple, Box-Muller to normals), so a request's random prompt tokens are the same whether its
// prompt runs in one chunk or ten, next to other requests or alone, and a weight row is the same
// whichever thread draws it.
#pragma once

#include <cstdint>

namespace kda {

// What a seeded token is for: a request's own random prompt tokens, or a shared system prompt's.
enum class TokenStream : uint64_t { kPrompt = 1, kSharedPrefix = 3 };

// Token `pos` of stream `owner` (a request id, or a shared-prefix group): uniform in [0, vocab).
int32_t seeded_token(uint64_t seed, TokenStream stream, int64_t owner, int64_t pos, int64_t vocab);

// 64 random bits of the tuple (a, b, c) in stream `stream` (a value no other draw here uses: >= 16).
uint64_t seeded_bits(uint64_t seed, uint64_t stream, int64_t a, int64_t b, int64_t c);

// Weight rows: n standard normals of row `row` of the table `table` (embedding, LM head).
void seeded_normals(uint64_t seed, uint64_t table, int64_t row, int64_t n, float* out);

// n values of row `row` of the table `table`, uniform on [-sqrt(3), sqrt(3)] (mean 0, variance 1): a
// cheap stand-in for normals where a model's bulk weights are drawn (a MoE layer's hundreds of experts).
void seeded_uniforms(uint64_t seed, uint64_t table, int64_t row, int64_t n, float* out);

}  // namespace kda
