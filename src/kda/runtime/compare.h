// What kda verify's checks share (verify.cc and verify_quant.cc): the relative L2 metric and reading a
// case's array by name. Private to the library.
#pragma once

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/io/npy.h"

namespace kda::runtime {

// ||a - b|| / ||b|| in float64 (||a - b|| when b is zero); infinity when a holds a NaN or an Inf.
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) throw std::runtime_error("compared arrays differ in size");
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Worst |a - b| / (tol + tol |b|) (atol = rtol = tol, the spec's elementwise fp32 rule; <= 1 passes);
// infinity when a holds a NaN or an Inf.
inline double max_err_ratio(const std::vector<float>& a, const std::vector<float>& b, double tol) {
  if (a.size() != b.size()) throw std::runtime_error("compared arrays differ in size");
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    worst = std::max(worst, d / (tol + tol * std::fabs(static_cast<double>(b[i]))));
  }
  return worst;
}

// The case file's array `key` as fp32; std::runtime_error naming the file when it has none.
inline std::vector<float> need(const io::NpzArchive& npz, const std::string& key,
                               const std::filesystem::path& file) {
  auto it = npz.find(key);
  if (it == npz.end()) throw std::runtime_error(file.string() + " has no '" + key + "' array");
  return it->second.to_f32();
}

}  // namespace kda::runtime
