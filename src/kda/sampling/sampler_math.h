// The element-wise steps RequestSampler and sample_reference share, so that both give the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace kda::sampling::detail {

inline float repetition(float l, float r) { return l > 0.0f ? l / r : l * r; }

inline float presence_frequency(float l, int32_t count, float presence, float frequency) {
  return l - (presence + frequency * static_cast<float>(count));
}

// w = exp(s - m); m infinite: 1 where s == m, else 0 (the limit of a softmax whose top logit dominates).
inline float weight(float s, float m) {
  if (!std::isfinite(m)) return s == m ? 1.0f : 0.0f;
  return std::exp(s - m);
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
