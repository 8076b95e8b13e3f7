// The weight-only quantized GEMM: quantization at load (round to nearest, the packing layout), the
// per-row activation quantization, every ISA copy of the kernels (and the AVX-512 copy both with and
// without AVX512_VNNI) against its reference (x and W quantized as the kernels take them, dequantized,
// then plain fp32 loops) on decode and odd shapes, and QuantLinear's decode and prefill paths and
// rounding points.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/common/isa.h"
#include "kda/kernels/gemm/quant_gemm.h"
#include "kda/kernels/gemm/quant_gemm_isa.h"
#include "kda/kernels/gemm/weight_format.h"
#include "kda/layers/linear.h"
#include "kda/layers/quant_linear.h"
#include "support/gemm_check.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace qg = kernels::gemm;
using testing::available_isas;
using testing::expect_close_fp32;
using testing::expect_throw_with;
using testing::random_normal;

struct Shape {
  int64_t in, out;
};

// The AVX-512 copy called directly with and without VNNI (the entry points take the CPU's choice), on
// x quantized as the entry points do (int8 weights: a scale per row; int4: per group of 32).
#if defined(KDA_TEST_AVX512_LANES)  // the AVX-512 copy is in the build (KDA_WITH_AVX512 is the library's own)
void avx512_direct(const float* x, int64_t M, int64_t ldx, const qg::PackedWeights& w, float* y, int64_t ldy,
                   bool vnni) {
  const bool i8 = w.format == Weights::Int8;
  const int64_t run = i8 ? w.in : qg::kInt4Group, R = w.in / run;
  const int qmax = i8 ? qg::activation_qmax(w.in) : qg::kInt4ActivationMax;
  std::vector<int16_t> q(static_cast<size_t>(M * w.in));
  std::vector<float> s(static_cast<size_t>(M * R));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r)
      s[m * R + r] =
          qg::quantize_activations(x + m * ldx + r * run, run, qmax, q.data() + m * w.in + r * run);
  if (i8)
    qg::avx512::gemm_int8(q.data(), s.data(), M, {static_cast<const int8_t*>(w.data), w.scale, w.in, w.out},
                          y, ldy, vnni);
  else
    qg::avx512::gemm_int4(q.data(), s.data(), M, {static_cast<const uint8_t*>(w.data), w.scale, w.in, w.out},
                          y, ldy, vnni);
}
#endif

// int8 weights: each output is the exact integer sum converted once, so every kernel gives the portable
// copy's bits (whichever order its lanes and steps add in).
void expect_int8_bits(const qg::PackedWeights& w, int64_t M, int64_t ldy, const std::vector<float>& y,
                      const std::vector<float>& portable, const std::string& what) {
  if (w.format != Weights::Int8) return;
  for (int64_t m = 0; m < M; ++m)
    ASSERT_EQ(std::memcmp(y.data() + m * ldy, portable.data() + m * ldy, sizeof(float) * w.out), 0)
        << what << " row " << m;
}

void check_kernels(const qg::PackedWeights& w, const std::string& tag) {
  const std::vector<float> wf = qg::dequantize(w);
  for (int64_t M : {1, 2, 3, 4, 5, 7, 8, 13, 16, 33, 64}) {
    const int64_t ldx = w.in + 3, ldy = w.out + 5;
    const std::vector<float> x = random_normal(static_cast<size_t>(M * ldx), 100 + M);
    std::vector<float> yref(static_cast<size_t>(M * ldy), -1.0f);
    qg::gemm_reference(x.data(), M, ldx, w, yref.data(), ldy);
    std::vector<float> portable(static_cast<size_t>(M * ldy));
    qg::gemm(x.data(), M, ldx, w, portable.data(), ldy, Isa::Portable);
    for (Isa isa : available_isas()) {
      std::vector<float> y(static_cast<size_t>(M * ldy), 7.0f);
      qg::gemm(x.data(), M, ldx, w, y.data(), ldy, isa);
      const std::string what = tag + " M=" + std::to_string(M) + " " + to_string(isa);
      expect_close_fp32(x, ldx, wf, M, w.in, w.out, y.data(), ldy, yref.data(), ldy, what);
      expect_int8_bits(w, M, ldy, y, portable, what);
      // The padding between rows is left as it was.
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = w.out; n < ldy; ++n) ASSERT_EQ(y[m * ldy + n], 7.0f) << what;
    }
#if defined(KDA_TEST_AVX512_LANES)
    if (!isa_available(Isa::Avx512)) continue;
    for (bool vnni : {false, true}) {
      if (vnni && !qg::cpu_has_vnni()) continue;
      std::vector<float> y(static_cast<size_t>(M * ldy), 7.0f);
      avx512_direct(x.data(), M, ldx, w, y.data(), ldy, vnni);
      const std::string what = tag + " M=" + std::to_string(M) + (vnni ? " avx512 vnni" : " avx512 bw");
      expect_close_fp32(x, ldx, wf, M, w.in, w.out, y.data(), ldy, yref.data(), ldy, what);
      expect_int8_bits(w, M, ldy, y, portable, what);
    }
#endif
  }
}

// Per-row symmetric round to nearest of the activations: scale max|x| / qmax, every value within half
// a step, the largest at +-qmax, a zero row all zeros; int8 weights' qmax shrinks only for inputs so
// long that a kernel lane could overflow int32.
TEST(QuantGemm, ActivationQuantizationPerRow) {
  EXPECT_EQ(qg::activation_qmax(2304), 32767);
  EXPECT_EQ(qg::activation_qmax(8192), 32767);
  EXPECT_LT(qg::activation_qmax(100000), 32767);
  EXPECT_LE(int64_t{127} * qg::activation_qmax(100000) * 2 * ((100000 + 31) / 32), int64_t{2147483647});
  const int64_t in = 300;
  std::vector<float> x = random_normal(static_cast<size_t>(in), 3);
  x[17] = -9.0f;
  std::vector<int16_t> q8(in), q16(in);  // qmax 127 and 32767
  const float s8 = qg::quantize_activations(x.data(), in, 127, q8.data());
  const float s16 = qg::quantize_activations(x.data(), in, 32767, q16.data());
  EXPECT_FLOAT_EQ(s8, 9.0f / 127);
  EXPECT_FLOAT_EQ(s16, 9.0f / 32767);
  EXPECT_EQ(q8[17], -127);
  EXPECT_EQ(q16[17], -32767);
  for (int64_t k = 0; k < in; ++k) {
    EXPECT_LE(std::fabs(x[k] - q8[k] * s8), 0.5f * s8 * (1 + 1e-5f)) << k;
    EXPECT_LE(std::fabs(x[k] - q16[k] * s16), 0.5f * s16 * (1 + 1e-5f)) << k;
  }
  const std::vector<float> z(in, 0.0f);
  EXPECT_EQ(qg::quantize_activations(z.data(), in, 127, q8.data()), 0.0f);
  EXPECT_TRUE(std::all_of(q8.begin(), q8.end(), [](int16_t v) { return v == 0; }));
}

TEST(QuantGemm, Int8KernelsEqualTheReference) {
  for (Shape s : {Shape{2304, 37}, Shape{128, 260}, Shape{4096, 9}, Shape{17, 5}, Shape{100, 3}, Shape{1, 1},
                  Shape{33, 64}}) {
    const std::vector<float> wsrc = random_normal(static_cast<size_t>(s.in * s.out), s.in * 7 + s.out, 0.05f);
    const qg::PackedMatrix w(Weights::Int8, wsrc.data(), s.in, s.out);
    check_kernels(w.view(), "int8 " + std::to_string(s.in) + "x" + std::to_string(s.out));
  }
}

TEST(QuantGemm, Int4KernelsEqualTheReference) {
  for (Shape s :
       {Shape{2304, 37}, Shape{128, 260}, Shape{4096, 9}, Shape{32, 5}, Shape{96, 3}, Shape{64, 1}}) {
    const std::vector<float> wsrc = random_normal(static_cast<size_t>(s.in * s.out), s.in * 5 + s.out, 0.05f);
    const qg::PackedMatrix w(Weights::Int4, wsrc.data(), s.in, s.out);
    check_kernels(w.view(), "int4 " + std::to_string(s.in) + "x" + std::to_string(s.out));
  }
}

// Round to nearest with the documented scales: each weight within half a step of its dequantized
// value, and the largest magnitude of each channel (int8) or group (int4) exact at +-qmax steps.
TEST(QuantGemm, QuantizationRoundsToNearestWithMaxAbsScales) {
  const int64_t in = 96, out = 11;
  std::vector<float> wsrc = random_normal(static_cast<size_t>(in * out), 5);
  std::fill(wsrc.begin() + 3 * in, wsrc.begin() + 4 * in, 0.0f);  // a zero channel: scale 0, all zeros
  const qg::PackedMatrix p8(Weights::Int8, wsrc.data(), in, out), p4(Weights::Int4, wsrc.data(), in, out);
  const int8_t* q8 = static_cast<const int8_t*>(p8.view().data);
  const uint8_t* q4 = static_cast<const uint8_t*>(p4.view().data);
  const float *s8 = p8.view().scale, *s4 = p4.view().scale;
  const std::vector<float> d8 = qg::dequantize(p8.view()), d4 = qg::dequantize(p4.view());
  const int64_t G = in / qg::kInt4Group;
  ASSERT_EQ(p8.bytes(), in * out + 4 * out);
  ASSERT_EQ(p4.bytes(), in / 2 * out + 4 * G * out);
  for (int64_t n = 0; n < out; ++n) {
    double amax = 0.0;
    for (int64_t k = 0; k < in; ++k) amax = std::max(amax, std::fabs(static_cast<double>(wsrc[n * in + k])));
    EXPECT_NEAR(s8[n], amax / 127.0, 1e-7 * amax) << "channel " << n;
    for (int64_t k = 0; k < in; ++k) {
      const int64_t i = n * in + k;
      EXPECT_LE(std::fabs(wsrc[i] - d8[i]), 0.5 * s8[n] * (1 + 1e-5) + 1e-30) << "int8 " << n << "," << k;
      const float s = s4[n * G + k / qg::kInt4Group];
      EXPECT_LE(std::fabs(wsrc[i] - d4[i]), 0.5 * s * (1 + 1e-5) + 1e-30) << "int4 " << n << "," << k;
      // The packing: byte (k % 32) % 16 of the group, low nibble for the first 16 inputs.
      const uint8_t b = q4[n * (in / 2) + (k / 32) * 16 + (k % 16)];
      const int nib = (k % 32) < 16 ? (b & 0xF) : (b >> 4);
      EXPECT_GE(nib, 1);
      EXPECT_LE(nib, 15);
      if (std::fabs(wsrc[i]) == amax && amax > 0) {
        EXPECT_EQ(std::abs(q8[i]), 127) << n << "," << k;
      }
    }
  }
  for (int64_t k = 0; k < in; ++k) EXPECT_EQ(d8[3 * in + k], 0.0f);
  for (int64_t k = 0; k < in; ++k) EXPECT_EQ(d4[3 * in + k], 0.0f);
}

TEST(QuantGemm, BadShapesAreRefused) {
  std::vector<float> w(48 * 2, 0.5f);
  expect_throw_with<std::invalid_argument>([&] { qg::PackedMatrix(Weights::Int4, w.data(), 48, 2); },
                                           "not a multiple of the group size 32");
  expect_throw_with<std::invalid_argument>([&] { qg::PackedMatrix(Weights::Int8, w.data(), 0, 2); },
                                           "features must be positive");
  expect_throw_with<std::invalid_argument>(
      [&] {
        qg::gemm(w.data(), 1, 48, qg::PackedWeights{Weights::Int8, nullptr, nullptr, 48, 2}, w.data(), 2);
      },
      "int8 gemm: empty weights");
  expect_throw_with<std::invalid_argument>(
      [&] { layers::QuantLinear(48, 2, w, Weights::Int4, Precision::BF16); },
      "not a multiple of the group size");
  expect_throw_with<std::invalid_argument>(
      [&] { layers::QuantLinear(48, 3, w, Weights::Int8, Precision::BF16); }, "expected 3 x 48");
  layers::QuantLinear ql(48, 2, w, Weights::Int8, Precision::FP32);
  std::vector<bf16_t> xb(48);
  std::vector<float> y(2, 9.0f);
  expect_throw_with<std::invalid_argument>([&] { ql.forward(xb.data(), 1, 48, y.data(), 2); },
                                           "bf16 input or output for an fp32 projection");
  expect_throw_with<std::invalid_argument>([&] { ql.forward(w.data(), 1, 47, y.data(), 2); }, "row strides");
  EXPECT_EQ(y[0], 9.0f);
}

// A NaN activation makes the outputs of its row NaN on every path (the dense GEMM's NaN in, NaN out), in
// every ISA copy and the reference; the other rows stay finite. In the quantized activations a NaN or
// Inf has no int16 value: its run (the row for int8 weights, the group for int4 ones) gets scale NaN,
// so an Inf gives NaN rows on the decode kernels, and non-finite ones on the prefill path (fp32 matmul:
// Inf or NaN, as a dense projection gives).
TEST(QuantGemm, NonFiniteActivationsGiveNaNRows) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const int64_t in = 96, out = 13, M = 4;
  const std::vector<float> wsrc = random_normal(static_cast<size_t>(in * out), 31, 0.05f);
  std::vector<int16_t> q(static_cast<size_t>(in), 5);
  for (float bad : {nan, inf, -inf}) {
    std::vector<float> xr = random_normal(static_cast<size_t>(in), 4);
    xr[40] = bad;
    EXPECT_TRUE(std::isnan(qg::quantize_activations(xr.data(), in, 32767, q.data()))) << bad;
    EXPECT_TRUE(std::all_of(q.begin(), q.end(), [](int16_t v) { return v == 0; })) << bad;
  }
  for (Weights fmt : {Weights::Int8, Weights::Int4})
    for (float bad : {nan, inf, -inf})
      // The decode kernels, the prefill path (in the bf16 precision on AMX from more rows: 600 > every
      // decode_rows()).
      for (int64_t rows : {M, int64_t{70}, int64_t{600}}) {
        const std::string what =
            std::string(to_string(fmt)) + " x=" + std::to_string(bad) + " M=" + std::to_string(rows);
        std::vector<float> x = random_normal(static_cast<size_t>(rows * in), 8);
        x[1 * in + 40] = bad;  // row 1, group 1
        bool want_nan = false;
        const auto row_nan = [&](const float* y, int64_t m) {
          return std::all_of(y + m * out, y + (m + 1) * out,
                             [&](float v) { return want_nan ? std::isnan(v) : !std::isfinite(v); });
        };
        const auto row_finite = [&](const float* y, int64_t m) {
          return std::all_of(y + m * out, y + (m + 1) * out, [](float v) { return std::isfinite(v); });
        };
        std::vector<float> y(static_cast<size_t>(rows * out));
        for (Precision prec : {Precision::FP32, Precision::BF16}) {
          const layers::QuantLinear ql(in, out, wsrc, fmt, prec);
          want_nan = std::isnan(bad) || rows <= ql.decode_rows();
          std::fill(y.begin(), y.end(), 0.0f);
          ql.forward(x.data(), rows, in, y.data(), out);
          EXPECT_TRUE(row_nan(y.data(), 1)) << what << " " << to_string(prec);
          for (int64_t m : {int64_t{0}, int64_t{2}, rows - 1})
            EXPECT_TRUE(row_finite(y.data(), m)) << what << " " << to_string(prec) << " row " << m;
        }
        if (rows > layers::QuantLinear::kDecodeRows) continue;
        want_nan = true;
        const qg::PackedMatrix p(fmt, wsrc.data(), in, out);
        const auto run = [&](auto gemm) {
          std::fill(y.begin(), y.end(), 0.0f);
          gemm();
          EXPECT_TRUE(row_nan(y.data(), 1)) << what;
          EXPECT_TRUE(row_finite(y.data(), 0) && row_finite(y.data(), 2)) << what;
        };
        for (Isa isa : available_isas())
          run([&] { qg::gemm(x.data(), rows, in, p.view(), y.data(), out, isa); });
        run([&] { qg::gemm_reference(x.data(), rows, in, p.view(), y.data(), out); });
      }
}

// A NaN or Inf weight is kept as NaN (as a dense projection keeps it): its channel (int8) or group
// (int4) gets scale NaN, so the outputs of that channel are NaN on every path and the others are as
// they would be without it.
TEST(QuantGemm, NonFiniteWeightsGiveNaNChannels) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const int64_t in = 96, out = 13;
  for (Weights fmt : {Weights::Int8, Weights::Int4})
    for (float bad : {nan, inf, -inf}) {
      const std::string what = std::string(to_string(fmt)) + " w=" + std::to_string(bad);
      std::vector<float> wsrc = random_normal(static_cast<size_t>(in * out), 32, 0.05f);
      const layers::QuantLinear clean(in, out, wsrc, fmt, Precision::FP32);
      wsrc[5 * in + 70] = bad;  // channel 5, group 2
      const layers::QuantLinear ql(in, out, wsrc, fmt, Precision::FP32);
      const std::vector<float> wd = ql.dequantized(), wc = clean.dequantized();
      for (int64_t n = 0; n < out; ++n)
        for (int64_t k = 0; k < in; ++k) {
          const bool hit = n == 5 && (fmt == Weights::Int8 || k / qg::kInt4Group == 2);
          if (hit)
            EXPECT_TRUE(std::isnan(wd[n * in + k])) << what << " " << n << "," << k;
          else
            EXPECT_EQ(wd[n * in + k], wc[n * in + k]) << what << " " << n << "," << k;
        }
      for (int64_t rows : {int64_t{3}, int64_t{70}}) {
        const std::vector<float> x = random_normal(static_cast<size_t>(rows * in), 9);
        std::vector<float> y(static_cast<size_t>(rows * out)), yc(y.size());
        ql.forward(x.data(), rows, in, y.data(), out);
        clean.forward(x.data(), rows, in, yc.data(), out);
        for (int64_t m = 0; m < rows; ++m)
          for (int64_t n = 0; n < out; ++n) {
            if (n == 5)
              EXPECT_TRUE(std::isnan(y[m * out + n])) << what << " M=" << rows << " " << m;
            else
              EXPECT_EQ(y[m * out + n], yc[m * out + n]) << what << " M=" << rows << " " << m << "," << n;
          }
      }
    }
}

// The prefill path keeps its matmul primitives as Linear does: bounded over many row counts (least
// recently used dropped), and a row count whose primitives were dropped still computes right.
TEST(QuantGemm, PrefillPrimitivesStayBoundedOverManyRowCounts) {
  const int64_t in = 64, out = 300;  // two tiles: two primitives per row count
  const std::vector<float> wsrc = random_normal(static_cast<size_t>(in * out), 91, 0.05f);
  const layers::QuantLinear ql(in, out, wsrc, Weights::Int8, Precision::FP32);
  const std::vector<float> wf = ql.dequantized();
  const auto check_rows = [&](int64_t M) {
    const std::vector<float> x = random_normal(static_cast<size_t>(M * in), 300 + M);
    std::vector<float> y(static_cast<size_t>(M * out));
    ql.forward(x.data(), M, in, y.data(), out);
    const std::vector<float> yref = testing::gemm_double(x, in, wf, M, in, out);
    expect_close_fp32(x, in, wf, M, in, out, y.data(), out, yref.data(), out, "M=" + std::to_string(M));
  };
  const int64_t first = layers::QuantLinear::kDecodeRows + 1, counts = layers::QuantLinear::kMaxPrimitives;
  for (int64_t M = first; M < first + counts; ++M) {
    check_rows(M);
    EXPECT_EQ(ql.cached_primitives(),
              std::min<size_t>(2 * static_cast<size_t>(M - first + 1), layers::QuantLinear::kMaxPrimitives));
  }
  check_rows(first);               // dropped long ago
  check_rows(first + counts - 1);  // still kept
  EXPECT_EQ(ql.cached_primitives(), layers::QuantLinear::kMaxPrimitives);
}

// QuantLinear (through Linear, as the layer holds it): the decode path (M <= decode_rows(): activations
// quantized as the kernels take them) and the prefill path (the tiles through oneDNN: bf16 ones in the bf16
// precision where this CPU has a native bf16 matmul, fp32 otherwise, or int4's dpbf16 kernel;
// test_quant_prefill takes each on every CPU that has it), fp32 and bf16 inputs and outputs, against
// x W_deq^T in double.
TEST(QuantGemm, QuantLinearDecodeAndPrefillPaths) {
  const int64_t in = 256, out = 600;  // out > 2 tiles of 256: a tail tile
  const std::vector<float> wsrc = random_normal(static_cast<size_t>(in * out), 77, 0.06f);
  for (Weights fmt : {Weights::Int8, Weights::Int4}) {
    for (Precision prec : {Precision::FP32, Precision::BF16}) {
      const layers::Linear lin(in, out, wsrc, prec, fmt);
      ASSERT_EQ(lin.weights(), fmt);
      const int64_t bytes = fmt == Weights::Int8 ? in * out + 4 * out : in * out / 2 + 4 * out * (in / 32);
      EXPECT_EQ(lin.weight_bytes(), bytes);
      const layers::QuantLinear ql(in, out, wsrc, fmt, prec);
      // Past 64 rows the decode path runs 64 rows at a time (in the bf16 precision on AMX up to 256 or
      // 512 rows); 600 rows take the prefill path on every CPU.
      for (int64_t M : {1, 3, 8, 9, 16, 17, 64, 65, 300, 600}) {
        const std::string what =
            std::string(to_string(fmt)) + "/" + to_string(prec) + " M=" + std::to_string(M);
        const int64_t ldx = in + 8, ldy = out + 4;
        std::vector<float> x = random_normal(static_cast<size_t>(M * ldx), 200 + M);
        std::vector<float> xr = x;  // as the projection reads it: bf16-rounded in the bf16 precision
        if (prec == Precision::BF16) round_bf16_inplace(xr.data(), xr.size());
        if (M <= ql.decode_rows()) {
          const bool i8 = fmt == Weights::Int8;
          const int qmax = i8 ? qg::activation_qmax(in) : qg::kInt4ActivationMax;
          const int64_t run = i8 ? in : qg::kInt4Group;
          std::vector<int16_t> q(static_cast<size_t>(run));
          for (int64_t m = 0; m < M; ++m)
            for (int64_t k0 = 0; k0 < in; k0 += run) {
              float* xg = xr.data() + m * ldx + k0;
              const float s = qg::quantize_activations(xg, run, qmax, q.data());
              for (int64_t k = 0; k < run; ++k) xg[k] = static_cast<float>(q[k]) * s;
            }
        }
        const std::vector<float> wm = ql.dequantized(M);  // W as this call multiplies it
        const std::vector<float> yref = testing::gemm_double(xr, ldx, wm, M, in, out);
        std::vector<float> y(static_cast<size_t>(M * ldy), 3.0f);
        lin.forward(x.data(), M, ldx, y.data(), ldy);
        expect_close_fp32(xr, ldx, wm, M, in, out, y.data(), ldy, yref.data(), out, what + " f32->f32");
        if (prec != Precision::BF16) continue;
        std::vector<bf16_t> xb(static_cast<size_t>(M * ldx)), yb(static_cast<size_t>(M * ldy));
        f32_to_bf16_array(x.data(), xb.data(), xb.size());
        lin.forward(xb.data(), M, ldx, yb.data(), ldy);
        int bad = 0;
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < out; ++n) {
            // bf16 output: the same fp32 sums (checked above) rounded to nearest even as they are stored.
            // (Against yref with one bf16 ulp of slack instead, a sum near cancellation fails by its fp32
            // rounding alone: int4's bf16 tiles carry 16 significant bits of W.)
            if (yb[m * ldy + n] != f32_to_bf16(y[m * ldy + n])) ++bad;
          }
        EXPECT_EQ(bad, 0) << what << " bf16->bf16";
      }
    }
  }
}

// The packed kernels' row counts: int8 in the bf16 precision where they run on AMX tiles takes up to 256
// rows, 64 at a time; the fp32 precision keeps 64; the dpbf16 and amx bf16 paths take fewer. A row's
// values do not depend on the call's row count: a call of the most rows gives each row the bits of calls
// of 16 (the AMX kernels' sums are fixed per row whatever the tiles).
TEST(QuantGemm, PackedRowsGiveEachRowItsBitsAtEveryCount) {
  using layers::QuantLinear;
  const int64_t in = 256, out = 80;
  const std::vector<float> wsrc = random_normal(static_cast<size_t>(in * out), 78, 0.06f);
  for (Weights fmt : {Weights::Int8, Weights::Int4}) {
    const std::string what = to_string(fmt);
    const QuantLinear f32(in, out, wsrc, fmt, Precision::FP32), b16(in, out, wsrc, fmt, Precision::BF16);
    EXPECT_EQ(f32.decode_rows(), QuantLinear::kDecodeRows) << what;
    EXPECT_EQ(QuantLinear::decode_rows_for(fmt, Precision::FP32, in), QuantLinear::kDecodeRows) << what;
    const QuantLinear::Prefill path = QuantLinear::prefill_path_for(fmt, Precision::BF16);
    const bool i8 = fmt == Weights::Int8;
    const int64_t want = path == QuantLinear::Prefill::Dpbf16
                             ? (i8 ? QuantLinear::kDpbf16DecodeRowsInt8 : QuantLinear::kDpbf16DecodeRowsInt4)
                         : path == QuantLinear::Prefill::AmxBf16
                             ? (i8 ? QuantLinear::kAmxDecodeRowsInt8 : QuantLinear::kAmxBf16DecodeRowsInt4)
                         : i8 && qg::gemm_runs_amx(fmt, in) ? QuantLinear::kAmxDecodeRowsInt8
                                                            : QuantLinear::kDecodeRows;
    EXPECT_EQ(b16.decode_rows(), want) << what;
    EXPECT_EQ(QuantLinear::decode_rows_for(fmt, Precision::BF16, in), want) << what;
    const int64_t M = b16.decode_rows();
    std::vector<float> x = random_normal(static_cast<size_t>(M * in), 79);
    round_bf16_inplace(x.data(), x.size());
    std::vector<float> y(static_cast<size_t>(M * out)), part(static_cast<size_t>(16 * out));
    b16.forward(x.data(), M, in, y.data(), out);
    int bad = 0;
    for (int64_t m0 = 0; m0 + 16 <= M; m0 += 16) {
      b16.forward(x.data() + m0 * in, 16, in, part.data(), out);
      for (int64_t i = 0; i < 16 * out; ++i) bad += part[i] != y[m0 * out + i];
    }
    EXPECT_EQ(bad, 0) << what << " M=" << M;
  }
}

}  // namespace
}  // namespace kda
