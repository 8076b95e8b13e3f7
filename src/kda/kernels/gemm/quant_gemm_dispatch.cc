// The quantized GEMM's entry points (the copy for best_isa()), the quantization at load and the
// references.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/isa.h"
#include "kda/kernels/gemm/quant_gemm.h"
#include "kda/kernels/gemm/quant_gemm_isa.h"

namespace kda::kernels::gemm {
namespace {

void check_shape(int64_t in, int64_t out, bool int4) {
  if (in <= 0 || out <= 0) throw std::invalid_argument("quantize: features must be positive");
  if (int4 && in % kInt4Group != 0)
    throw std::invalid_argument("int4 weights: the input size " + std::to_string(in) +
                                " is not a multiple of the group size " + std::to_string(kInt4Group));
}

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

void check_call(const float* x, int64_t M, int64_t ldx, int64_t in, int64_t out, const float* y,
                int64_t ldy) {
  if (M < 0 || ldx < in || ldy < out) throw std::invalid_argument("quantized gemm: bad M or row strides");
  if (M > 0 && (x == nullptr || y == nullptr)) throw std::invalid_argument("quantized gemm: null x or y");
}

// A run with a NaN or Inf has no integer image: scale NaN and q all zero, so that every output the run
// feeds is NaN (a NaN or Inf activation makes the dense GEMM's outputs NaN or Inf as well), where a
// cast of NaN to int16 is undefined and came out as finite garbage.
template <class Q>
float quantize_row(const float* x, int64_t in, int qmax, Q* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t k = 0; k < in; ++k) {
    const float a = std::fabs(x[k]);
    finite &= a <= std::numeric_limits<float>::max();
    amax = std::max(amax, a);
  }
  const float s = finite ? amax / static_cast<float>(qmax) : std::numeric_limits<float>::quiet_NaN();
  if (!(s > 0.0f)) {
    std::fill(q, q + in, Q{0});
    return s;
  }
  const float lim = static_cast<float>(qmax);
  for (int64_t k = 0; k < in; ++k) q[k] = static_cast<Q>(std::clamp(std::nearbyint(x[k] / s), -lim, lim));
  return s;
}

// x quantized into contiguous [M, in] rows, as the kernels take it: one scale per run of `run` inputs
// (the row, or a group of 32). Per-thread scratch: a call from the serving loop does not allocate (nor
// fault in fresh pages) every time.
template <class Q>
const Q* quantize_x(const float* x, int64_t M, int64_t ldx, int64_t in, int64_t run, int qmax,
                    std::vector<Q>& q, std::vector<float>& s) {
  const int64_t R = in / run;
  q.resize(static_cast<size_t>(M * in));
  s.resize(static_cast<size_t>(M * R));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r)
      s[m * R + r] = quantize_row(x + m * ldx + r * run, run, qmax, q.data() + m * in + r * run);
  return q.data();
}

template <class W>
void reference(const float* x, int64_t M, int64_t ldx, const W& w, int64_t run, int qmax, float* y,
               int64_t ldy) {
  check_call(x, M, ldx, w.in, w.out, y, ldy);
  std::vector<int16_t> q;
  std::vector<float> s;
  quantize_x(x, M, ldx, w.in, run, qmax, q, s);
  const int64_t R = w.in / run;
  const std::vector<float> wf = dequantize(w);
  std::vector<float> xd(static_cast<size_t>(w.in));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < w.in; ++k) xd[k] = static_cast<float>(q[m * w.in + k]) * s[m * R + k / run];
    for (int64_t n = 0; n < w.out; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < w.in; ++k) acc += xd[k] * wf[n * w.in + k];
      y[m * ldy + n] = acc;
    }
  }
}

}  // namespace

int activation_qmax(int64_t in) {
  // The AVX-512 kernel's int32 lanes each sum 2 products per 32 inputs, |w| <= 127.
  const int64_t per_lane = 2 * ((in + 31) / 32);
  return static_cast<int>(
      std::min<int64_t>(32767, (int64_t{2147483647} / 127) / std::max<int64_t>(per_lane, 1)));
}
float quantize_activations(const float* x, int64_t n, int qmax, int16_t* q) {
  return quantize_row(x, n, qmax, q);
}

bool cpu_has_vnni() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  static const bool v = __builtin_cpu_supports("avx512vnni");
  return v;
#else
  return false;
#endif
}

void quantize_int8(const float* w, int64_t in, int64_t out, std::vector<int8_t>& q,
                   std::vector<float>& scale) {
  check_shape(in, out, false);
  q.assign(static_cast<size_t>(in * out), 0);
  scale.assign(static_cast<size_t>(out), 0.0f);
  for (int64_t n = 0; n < out; ++n) {
    int8_t* qr = q.data() + n * in;
    scale[n] = quantize_run(w + n * in, in, 127, [&](int64_t k, int v) { qr[k] = static_cast<int8_t>(v); });
  }
}

void quantize_int4(const float* w, int64_t in, int64_t out, std::vector<uint8_t>& q,
                   std::vector<float>& scale) {
  check_shape(in, out, true);
  const int64_t G = in / kInt4Group;
  q.assign(static_cast<size_t>(in / 2 * out), 0);
  scale.assign(static_cast<size_t>(G * out), 0.0f);
  for (int64_t n = 0; n < out; ++n)
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* qg = q.data() + n * (in / 2) + g * 16;
      // Input j of the group: byte j % 16, low nibble for j < 16, high for j >= 16; stored as q + 8.
      scale[n * G + g] = quantize_run(w + n * in + g * kInt4Group, kInt4Group, 7, [&](int64_t j, int v) {
        const auto u = static_cast<uint8_t>(v + 8);
        qg[j % 16] = static_cast<uint8_t>(j < 16 ? (qg[j % 16] & 0xF0) | u : (qg[j % 16] & 0x0F) | (u << 4));
      });
    }
}

void dequantize_rows(const Int8Weights& w, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* q = w.q + n * w.in;
    float* o = out + (n - n0) * w.in;
    const float s = w.scale[n];
    for (int64_t k = 0; k < w.in; ++k) o[k] = static_cast<float>(q[k]) * s;
  }
}

void dequantize_rows(const Int4Weights& w, int64_t n0, int64_t n1, float* out) {
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

std::vector<float> dequantize(const Int8Weights& w) {
  std::vector<float> out(static_cast<size_t>(w.in * w.out));
  dequantize_rows(w, 0, w.out, out.data());
  return out;
}

std::vector<float> dequantize(const Int4Weights& w) {
  std::vector<float> out(static_cast<size_t>(w.in * w.out));
  dequantize_rows(w, 0, w.out, out.data());
  return out;
}

#define KDA_QUANT_DISPATCH(fn, run, qmax)                                             \
  check_call(x, M, ldx, w.in, w.out, y, ldy);                                         \
  require_isa(isa);                                                                   \
  if (M == 0) return;                                                                 \
  thread_local std::vector<int16_t> xq_scratch;                                       \
  thread_local std::vector<float> sx_scratch;                                         \
  const int16_t* xq = quantize_x(x, M, ldx, w.in, run, qmax, xq_scratch, sx_scratch); \
  const float* sx = sx_scratch.data();                                                \
  switch (isa) {                                                                      \
    case Isa::Avx512:                                                                 \
      KDA_QUANT_AVX512(return avx512::fn(xq, sx, M, w, y, ldy, cpu_has_vnni()));      \
      break;                                                                          \
    case Isa::Avx2:                                                                   \
      KDA_QUANT_AVX2(return avx2::fn(xq, sx, M, w, y, ldy, false));                   \
      break;                                                                          \
    default:                                                                          \
      break;                                                                          \
  }                                                                                   \
  portable::fn(xq, sx, M, w, y, ldy, false);

// Only the copies in the build are referenced (require_isa() refuses the others first).
#if defined(KDA_WITH_AVX512)
#define KDA_QUANT_AVX512(...) __VA_ARGS__
#else
#define KDA_QUANT_AVX512(...)
#endif
#if defined(KDA_WITH_AVX2)
#define KDA_QUANT_AVX2(...) __VA_ARGS__
#else
#define KDA_QUANT_AVX2(...)
#endif

void gemm(const float* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y, int64_t ldy, Isa isa) {
  KDA_QUANT_DISPATCH(gemm_int8, w.in, activation_qmax(w.in))
}

void gemm(const float* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy, Isa isa) {
  check_shape(w.in, w.out, true);
  KDA_QUANT_DISPATCH(gemm_int4, kInt4Group, kInt4ActivationMax)
}

void gemm(const float* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y, int64_t ldy) {
  gemm(x, M, ldx, w, y, ldy, best_isa());
}
void gemm(const float* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy) {
  gemm(x, M, ldx, w, y, ldy, best_isa());
}

void gemm_reference(const float* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y, int64_t ldy) {
  reference(x, M, ldx, w, w.in, activation_qmax(w.in), y, ldy);
}
void gemm_reference(const float* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy) {
  reference(x, M, ldx, w, kInt4Group, kInt4ActivationMax, y, ldy);
}

}  // namespace kda::kernels::gemm
