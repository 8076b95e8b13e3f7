// The element-wise steps RequestSampler and sample_reference share, so that both give the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace kda::sampling::detail {

inline float repetition(float l, float r) { return l > 0.0f ? l / r : l * r; }

inline float presence_frequency(float l, int32_t count, float presence, float frequency) {
  return l - (presence + frequency * static_cast<float>(count));
}

// e^x for x <= 0 (Cephes' expf polynomial, within 2 ulp; 0 at and below -87, and for NaN or x > 0, which
// never reach it from an allowed id): exactly 1 at 0, the top id's weight. The selects are done on the
// bits, because GCC does not vectorize a loop with a float compare in it (it might trap).
inline float exp_nonpositive(float x) {
  uint32_t xb;
  std::memcpy(&xb, &x, sizeof xb);
  const uint32_t keep =
      0u - static_cast<uint32_t>((xb == 0u) | ((xb - 0x80000000u) < 0x42AE0000u));  // -87 < x <= 0
  const uint32_t cb = (xb & keep) | (0xC2AE0000u & ~keep);  // -87 elsewhere: the arithmetic stays finite
  float xc;
  std::memcpy(&xc, &cb, sizeof xc);
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t sb = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float scale;
  std::memcpy(&scale, &sb, sizeof scale);
  const float y = p * scale;
  uint32_t yb;
  std::memcpy(&yb, &y, sizeof yb);
  yb &= keep;
  float out;
  std::memcpy(&out, &yb, sizeof out);
  return out;
}

// w = exp(s - m); m infinite: 1 where s == m, else 0 (the limit of a softmax whose top logit dominates).
inline float weight(float s, float m) {
  if (!std::isfinite(m)) return s == m ? 1.0f : 0.0f;
  return exp_nonpositive(s - m);
}

// log_softmax from m = max and z = sum of weight(l, m) over the allowed ids.
inline float log_prob(float l, float m, double z) {
  if (!std::isfinite(m))
    return l == m ? static_cast<float>(-std::log(z)) : -std::numeric_limits<float>::infinity();
  return static_cast<float>((static_cast<double>(l) - static_cast<double>(m)) - std::log(z));
}

// (v descending, id ascending): a strict total order over distinct ids (NaN excluded before).
inline bool before(float va, int32_t a, float vb, int32_t b) { return va > vb || (va == vb && a < b); }

[[noreturn]] inline void nan_logit(int64_t id) {
  throw std::invalid_argument("logits: NaN at id " + std::to_string(id));
}

// Masses: a weight w in [0, 1] as an integer count of 2^-62 (truncated; a w below 2^-62 of the top one
// weighs nothing). Sums of masses are exact, so every order of adding them gives the same bits: a pass
// in id order, a histogram and a sorted walk all agree on where a running sum crosses a target.
using Mass = unsigned __int128;
inline uint64_t mass(float w) { return static_cast<uint64_t>(static_cast<double>(w) * 0x1.0p62); }

// floor(f * z / 2^53) exactly, for f <= 2^53 (a fraction in 53 bits) and z < 2^93 (2^31 masses).
inline Mass scale(Mass z, uint64_t f) {
  const auto hi = static_cast<uint64_t>(z >> 64), lo = static_cast<uint64_t>(z);
  return ((static_cast<Mass>(f) * hi) << 11) + ((static_cast<Mass>(f) * lo) >> 53);
}
// p in (0, 1] as a 53-bit fraction (a float p is exact in it down to 2^-29).
inline uint64_t frac53(float p) { return static_cast<uint64_t>(static_cast<double>(p) * 0x1.0p53); }

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The k-th generated token's draw: 53 random bits (u = draw53 / 2^53 in [0, 1)).
inline uint64_t draw53(uint64_t seed, int64_t k) {
  return splitmix64(splitmix64(seed) + static_cast<uint64_t>(k)) >> 11;
}

}  // namespace kda::sampling::detail
