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

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace kda::sampling::detail
