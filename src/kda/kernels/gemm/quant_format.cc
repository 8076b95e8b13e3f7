// The int8 and int4 formats' quantization at load, their dequantization and the activation
// quantization of their kernels (the table of weight_format.h points here).
#include <algorithm>
#include <cmath>
#include <limits>

#include "kda/common/isa_target.h"
#include "kda/kernels/gemm/quant_gemm.h"
#include "kda/kernels/gemm/quant_gemm_isa.h"

namespace kda::kernels::gemm {
namespace {

// Symmetric round to nearest of w[0..n) with scale max|w| / qmax (computed in double), into q. A run
// with a NaN or Inf weight gets scale NaN (q zero): its outputs are NaN, as a dense projection's
// outputs through that weight are NaN or Inf.
template <class Store>
float quantize_run(const float* w, int64_t n, int qmax, Store store) {
  double amax = 0.0;
  bool finite = true;
  for (int64_t k = 0; k < n; ++k) {
    finite &= std::isfinite(w[k]);
    amax = std::max(amax, std::fabs(static_cast<double>(w[k])));
  }
  const double s = finite ? amax / qmax : std::numeric_limits<double>::quiet_NaN();
  for (int64_t k = 0; k < n; ++k) {
    const double r = s > 0.0 ? std::nearbyint(static_cast<double>(w[k]) / s) : 0.0;
    store(k, static_cast<int>(std::clamp(r, -static_cast<double>(qmax), static_cast<double>(qmax))));
  }
  return static_cast<float>(s);
}

}  // namespace

int activation_qmax(int64_t in) {
  // The AVX-512 kernel's int32 lanes each sum 2 products per 32 inputs, |w| <= 127.
  const int64_t per_lane = 2 * ((in + 31) / 32);
  return static_cast<int>(
      std::min<int64_t>(32767, (int64_t{2147483647} / 127) / std::max<int64_t>(per_lane, 1)));
}
// A run with a NaN or Inf has no integer image: scale NaN and q all zero, so that every output the run
// feeds is NaN (a NaN or Inf activation makes the dense GEMM's outputs NaN or Inf as well), where a
// cast of NaN to int16 is undefined and came out as finite garbage. Cloned per ISA: the x86-64 baseline has
// no rounding instruction (nearbyint is a libm call per value), and the decode kernels run this per call.
KDA_TARGET_CLONES float quantize_activations(const float* x, int64_t in, int qmax, int16_t* q) {
  // The largest magnitude does not depend on the order it is found in (a NaN makes the run non-finite
  // whatever amax comes out): reductions the compiler vectorises.
  float amax = 0.0f;
  int bad = 0;
#pragma omp simd reduction(max : amax) reduction(| : bad)
  for (int64_t k = 0; k < in; ++k) {
    const float a = std::fabs(x[k]);
    bad |= !(a <= std::numeric_limits<float>::max());
    amax = std::max(amax, a);
  }
  const float s = !bad ? amax / static_cast<float>(qmax) : std::numeric_limits<float>::quiet_NaN();
  if (!(s > 0.0f)) {
    std::fill(q, q + in, int16_t{0});
    return s;
  }
  const float lim = static_cast<float>(qmax);
  for (int64_t k = 0; k < in; ++k)
    q[k] = static_cast<int16_t>(std::clamp(std::nearbyint(x[k] / s), -lim, lim));
  return s;
}

bool cpu_has_vnni() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  static const bool v = __builtin_cpu_supports("avx512vnni");
  return v;
#else
  return false;
#endif
}

void quantize_int8(const float* w, int64_t in, int64_t out, int8_t* q, float* scale) {
  for (int64_t n = 0; n < out; ++n) {
    int8_t* qr = q + n * in;
    scale[n] = quantize_run(w + n * in, in, 127, [&](int64_t k, int v) { qr[k] = static_cast<int8_t>(v); });
  }
}

void quantize_int4(const float* w, int64_t in, int64_t out, uint8_t* q, float* scale) {
  const int64_t G = in / kInt4Group;
  std::fill(q, q + in / 2 * out, uint8_t{0});
  for (int64_t n = 0; n < out; ++n)
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* qg = q + n * (in / 2) + g * 16;
      // Input j of the group: byte j % 16, low nibble for j < 16, high for j >= 16; stored as q + 8.
      scale[n * G + g] = quantize_run(w + n * in + g * kInt4Group, kInt4Group, 7, [&](int64_t j, int v) {
        const auto u = static_cast<uint8_t>(v + 8);
        qg[j % 16] = static_cast<uint8_t>(j < 16 ? (qg[j % 16] & 0xF0) | u : (qg[j % 16] & 0x0F) | (u << 4));
      });
    }
}

void dequantize_int8_rows(const Int8Weights& w, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* q = w.q + n * w.in;
    float* o = out + (n - n0) * w.in;
    const float s = w.scale[n];
    for (int64_t k = 0; k < w.in; ++k) o[k] = static_cast<float>(q[k]) * s;
  }
}

void dequantize_int4_rows(const Int4Weights& w, int64_t n0, int64_t n1, float* out) {
  const int64_t G = w.in / kInt4Group;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = w.q + n * (w.in / 2);
    float* o = out + (n - n0) * w.in;
    for (int64_t k = 0; k < w.in; ++k) {
      const uint8_t b = q[(k / kInt4Group) * 16 + k % 16];
      const int nib = (k % kInt4Group) < 16 ? (b & 0xF) : (b >> 4);
      o[k] = static_cast<float>(nib - 8) * w.scale[n * G + k / kInt4Group];
    }
  }
}

}  // namespace kda::kernels::gemm
