#include "kda/common/seeded.h"

#include <cmath>
#include <numbers>

namespace kda {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A key for the tuple: each field is folded through splitmix64 so that neighbouring tuples give
// unrelated streams.
uint64_t key_of(uint64_t seed, int64_t a, int64_t b, int64_t c, uint64_t stream) {
  uint64_t k = splitmix64(seed ^ 0x6b64615f73696dULL);  // "kda_sim"
  k = splitmix64(k ^ static_cast<uint64_t>(a));
  k = splitmix64(k ^ static_cast<uint64_t>(b));
  k = splitmix64(k ^ static_cast<uint64_t>(c));
  return splitmix64(k ^ stream);
}

constexpr uint64_t kWeightStream = 4, kUniformStream = 5;

}  // namespace

int32_t seeded_token(uint64_t seed, TokenStream stream, int64_t owner, int64_t pos, int64_t vocab) {
  const uint64_t k = key_of(seed, owner, pos, 0, static_cast<uint64_t>(stream));
  return static_cast<int32_t>(k % static_cast<uint64_t>(vocab));  // vocab << 2^64: the bias is nil
}

uint64_t seeded_bits(uint64_t seed, uint64_t stream, int64_t a, int64_t b, int64_t c) {
  return key_of(seed, a, b, c, stream);
}

void seeded_normals(uint64_t seed, uint64_t table, int64_t row, int64_t n, float* out) {
  const uint64_t key = key_of(seed, static_cast<int64_t>(table), row, 0, kWeightStream);
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

void seeded_uniforms(uint64_t seed, uint64_t table, int64_t row, int64_t n, float* out) {
  const uint64_t key = key_of(seed, static_cast<int64_t>(table), row, 0, kUniformStream);
  // 24 random bits per value, centred: (u + 0.5) / 2^24 in (0, 1), mapped onto (-sqrt 3, sqrt 3).
  constexpr float kScale = 2.0f * 1.7320508075688772f / 16777216.0f, kSqrt3 = 1.7320508075688772f;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t u = splitmix64(key + static_cast<uint64_t>(i)) >> 40;
    out[i] = (static_cast<float>(u) + 0.5f) * kScale - kSqrt3;
  }
}

}  // namespace kda
