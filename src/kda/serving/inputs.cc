#include "kda/serving/inputs.h"

#include <cmath>
#include <numbers>

namespace kda::serving {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A key for the tuple: each field is folded through splitmix64 so that neighbouring tuples give
// unrelated streams.
uint64_t key_of(uint64_t seed, int64_t id, int64_t pos, int64_t sample, uint64_t stream) {
  uint64_t k = splitmix64(seed ^ 0x6b64615f73696dULL);  // "kda_sim"
  k = splitmix64(k ^ static_cast<uint64_t>(id));
  k = splitmix64(k ^ static_cast<uint64_t>(pos));
  k = splitmix64(k ^ static_cast<uint64_t>(sample));
  return splitmix64(k ^ stream);
}

// n standard normals of the stream `key`: pair i from the two counters 2i and 2i+1.
void normals(uint64_t key, int64_t n, float* out) {
  constexpr double kInv53 = 1.0 / 9007199254740992.0;  // 2^-53
  for (int64_t i = 0; i < n; i += 2) {
    const uint64_t a = splitmix64(key + 2 * static_cast<uint64_t>(i));
    const uint64_t b = splitmix64(key + 2 * static_cast<uint64_t>(i) + 1);
    const double u1 = (static_cast<double>(a >> 11) + 1.0) * kInv53;  // (0, 1]: log is finite
    const double u2 = static_cast<double>(b >> 11) * kInv53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double t = 2.0 * std::numbers::pi * u2;
    out[i] = static_cast<float>(r * std::cos(t));
    if (i + 1 < n) out[i + 1] = static_cast<float>(r * std::sin(t));
  }
}

constexpr uint64_t kPromptStream = 1, kDecodeStream = 2;

}  // namespace

void prompt_input(uint64_t seed, int64_t id, int64_t pos, int64_t D, float* out) {
  normals(key_of(seed, id, pos, 0, kPromptStream), D, out);
}

void decode_input(uint64_t seed, int64_t id, int64_t pos, int32_t sample, const float* prev, int64_t D,
                  float* out) {
  normals(key_of(seed, id, pos, sample, kDecodeStream), D, out);
  double ss = 0.0;
  for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(prev[d]) * prev[d];
  const double rms = std::sqrt(ss / static_cast<double>(D));
  // A zero (or non-finite) previous output contributes nothing rather than a NaN.
  const float scale = (rms > 0.0 && std::isfinite(rms)) ? static_cast<float>(0.8 / rms) : 0.0f;
  for (int64_t d = 0; d < D; ++d) out[d] = scale * prev[d] + 0.6f * out[d];
}

}  // namespace kda::serving
