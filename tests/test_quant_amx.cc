// The AMX kernels of the quantized GEMM (quant_amx.h), called directly at every decode row count 1..64
// on the model's widths and on odd shapes (channel counts past whole blocks of 16, int4 inputs not a
// multiple of 64): int8 the portable and AVX-512 kernels' value bit for bit, int4 within fp32 summation
// rounding of the reference and its scalar model (exact group sums, scaled, added in order) bit for bit,
// extreme nibbles and activations included; a row's bits independent of the rows beside it; NaN activations
// and weights confined to their row and channel; the entry points taking them from their row counts on.
// Skipped where the CPU (or the build) lacks the tiles (AMX-INT8 for int8, and AMX-BF16 for int4).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/isa.h"
#include "kda/kernels/gemm/quant_amx.h"
#include "kda/kernels/gemm/quant_gemm.h"
#include "kda/kernels/gemm/quant_gemm_isa.h"
#include "kda/kernels/gemm/weight_format.h"
#include "support/gemm_check.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace qg = kernels::gemm;
using testing::expect_close_fp32;
using testing::random_normal;

// The AVX-512 copy is in the build (the tests see KDA_ENABLE_AVX512 by the definition the build gives
// them for it; KDA_WITH_AVX512 is the library's own).
#if defined(KDA_TEST_AVX512_LANES)
// The tiles each format's kernel takes: AMX-INT8 (int8), AMX-INT8 and AMX-BF16 (int4).
bool amx_for(Weights fmt) {
  return qg::cpu_has_amx_int8() && (fmt == Weights::Int8 || qg::cpu_has_amx_bf16());
}
#define SKIP_WITHOUT_AMX(fmt) \
  if (!amx_for(fmt)) GTEST_SKIP() << "no AMX for " << to_string(fmt) << " on this CPU or in this build"
#define SKIP_WITHOUT_ANY_AMX()                            \
  if (!amx_for(Weights::Int8) && !amx_for(Weights::Int4)) \
  GTEST_SKIP() << "no AMX on this CPU or in this build"

struct Shape {
  int64_t in, out;
};
// The model's projection widths (KDA / MLA projections, expert gate|up and down, o_proj), and odd ones.
constexpr Shape kInt8Shapes[] = {{2304, 576}, {2304, 2048}, {1024, 2304}, {4096, 48},
                                 {128, 260},  {64, 37},     {192, 15}};
constexpr Shape kInt4Shapes[] = {{2304, 576}, {2304, 2048}, {1024, 2304}, {4096, 48},
                                 {128, 260},  {96, 37},     {32, 17},     {160, 15}};
constexpr int64_t kManyRows[] = {1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 48, 63, 64};

// x [M, in] quantized as the entry points do: a scale per row (int8 weights), per group of 32 (int4).
struct Quantized {
  std::vector<int16_t> q;
  std::vector<float> s;
};
Quantized quantize(const std::vector<float>& x, int64_t M, Weights fmt, int64_t in) {
  const bool i8 = fmt == Weights::Int8;
  const int64_t run = i8 ? in : qg::kInt4Group, R = in / run;
  const int qmax = i8 ? qg::activation_qmax(in) : qg::kInt4ActivationMax;
  Quantized r{std::vector<int16_t>(static_cast<size_t>(M * in)),
              std::vector<float>(static_cast<size_t>(M * R))};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < R; ++g)
      r.s[m * R + g] =
          qg::quantize_activations(x.data() + m * in + g * run, run, qmax, r.q.data() + m * in + g * run);
  return r;
}

qg::Int8Weights int8_of(const qg::PackedWeights& w) {
  return {static_cast<const int8_t*>(w.data), w.scale, w.in, w.out};
}
qg::Int4Weights int4_of(const qg::PackedWeights& w) {
  return {static_cast<const uint8_t*>(w.data), w.scale, w.in, w.out};
}

// The AMX kernel on x into y [M, ldy]; the padding columns past out left as they were.
std::vector<float> amx(const qg::PackedWeights& w, const Quantized& xq, int64_t M, int64_t ldy) {
  std::vector<float> y(static_cast<size_t>(M * ldy), 7.0f);
  if (w.format == Weights::Int8)
    qg::gemm_int8_amx(xq.q.data(), xq.s.data(), M, int8_of(w), y.data(), ldy);
  else
    qg::gemm_int4_amx(xq.q.data(), xq.s.data(), M, int4_of(w), y.data(), ldy);
  return y;
}

void check_shape(Weights fmt, Shape sh) {
  const std::string tag =
      std::string(to_string(fmt)) + " " + std::to_string(sh.in) + "x" + std::to_string(sh.out);
  const std::vector<float> wsrc =
      random_normal(static_cast<size_t>(sh.in * sh.out), sh.in + 3 * sh.out, 0.05f);
  const qg::PackedMatrix p(fmt, wsrc.data(), sh.in, sh.out);
  const qg::PackedWeights& w = p.view();
  const std::vector<float> wf = qg::dequantize(w);
  const int64_t ldy = sh.out + 3;
  for (int64_t M : kManyRows) {
    const std::string what = tag + " M=" + std::to_string(M);
    const std::vector<float> x = random_normal(static_cast<size_t>(M * sh.in), 50 + M);
    const Quantized xq = quantize(x, M, fmt, sh.in);
    const std::vector<float> y = amx(w, xq, M, ldy);
    std::vector<float> yref(static_cast<size_t>(M * ldy));
    qg::gemm_reference(x.data(), M, sh.in, w, yref.data(), ldy);
    expect_close_fp32(x, sh.in, wf, M, sh.in, sh.out, y.data(), ldy, yref.data(), ldy, what);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = sh.out; n < ldy; ++n) ASSERT_EQ(y[m * ldy + n], 7.0f) << what;
    if (fmt == Weights::Int8) {
      // The same bits as the portable kernel and the AVX-512 ones (VNNI where the CPU has it).
      std::vector<float> yp(y.size(), 7.0f), yv(y.size(), 7.0f);
      qg::portable::gemm_int8(xq.q.data(), xq.s.data(), M, int8_of(w), yp.data(), ldy, false);
      qg::avx512::gemm_int8(xq.q.data(), xq.s.data(), M, int8_of(w), yv.data(), ldy, qg::cpu_has_vnni());
      ASSERT_EQ(std::memcmp(y.data(), yp.data(), sizeof(float) * y.size()), 0) << what << " vs portable";
      ASSERT_EQ(std::memcmp(y.data(), yv.data(), sizeof(float) * y.size()), 0) << what << " vs avx512";
    }
  }
}

TEST(QuantAmx, Int8EqualsThePortableKernelBitForBit) {
  SKIP_WITHOUT_AMX(Weights::Int8);
  for (Shape sh : kInt8Shapes) check_shape(Weights::Int8, sh);
}

TEST(QuantAmx, Int4WithinTheReferenceRounding) {
  SKIP_WITHOUT_AMX(Weights::Int4);
  for (Shape sh : kInt4Shapes) check_shape(Weights::Int4, sh);
}

// Each row alone and each row among 64 (from several offsets of the blocks of 16): the same bits.
TEST(QuantAmx, ARowsBitsDoNotDependOnTheRowsBesideIt) {
  SKIP_WITHOUT_ANY_AMX();
  for (Weights fmt : {Weights::Int8, Weights::Int4}) {
    if (!amx_for(fmt)) continue;
    const int64_t in = 1024, out = 48, all = 64;
    const std::vector<float> wsrc = random_normal(static_cast<size_t>(in * out), 11, 0.05f);
    const qg::PackedMatrix p(fmt, wsrc.data(), in, out);
    const std::vector<float> x = random_normal(static_cast<size_t>(all * in), 12);
    const std::vector<float> ref = amx(p.view(), quantize(x, all, fmt, in), all, out);
    for (int64_t s : {0, 5, 16, 40})
      for (int64_t M : {1, 3, 8, 16, 24}) {
        if (s + M > all) continue;
        const std::vector<float> xs(x.begin() + s * in, x.begin() + (s + M) * in);
        const std::vector<float> y = amx(p.view(), quantize(xs, M, fmt, in), M, out);
        EXPECT_EQ(std::memcmp(y.data(), ref.data() + s * out, sizeof(float) * M * out), 0)
            << to_string(fmt) << " rows [" << s << ", " << s + M << ")";
      }
  }
}

// A NaN activation (its row's or group's scale NaN) makes its row NaN, a NaN weight (its channel's or
// group's scale NaN) its channel: the rest stays finite.
TEST(QuantAmx, NonFiniteValuesStayInTheirRowAndChannel) {
  SKIP_WITHOUT_ANY_AMX();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t in = 128, out = 37, M = 20;
  for (Weights fmt : {Weights::Int8, Weights::Int4}) {
    if (!amx_for(fmt)) continue;
    std::vector<float> wsrc = random_normal(static_cast<size_t>(in * out), 21, 0.05f);
    wsrc[20 * in + 70] = nan;  // channel 20 (the second block), group 2
    const qg::PackedMatrix p(fmt, wsrc.data(), in, out);
    std::vector<float> x = random_normal(static_cast<size_t>(M * in), 22);
    x[17 * in + 40] = nan;  // row 17 (the second block of rows), group 1
    const std::vector<float> y = amx(p.view(), quantize(x, M, fmt, in), M, out);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < out; ++n)
        EXPECT_EQ(std::isnan(y[m * out + n]), m == 17 || n == 20) << to_string(fmt) << " " << m << "," << n;
  }
}

// The entry point (the AVX-512 copy) takes the AMX kernels from their row counts on: int8 the same bits
// at every row count, int4 the AMX kernel's bits from kAmxMinRowsInt4 rows.
TEST(QuantAmx, TheEntryPointsTakeThemFromTheirRowCounts) {
  SKIP_WITHOUT_ANY_AMX();
  const int64_t in = 2304, out = 64;
  for (Weights fmt : {Weights::Int8, Weights::Int4}) {
    if (!amx_for(fmt)) continue;
    const std::vector<float> wsrc = random_normal(static_cast<size_t>(in * out), 31, 0.05f);
    const qg::PackedMatrix p(fmt, wsrc.data(), in, out);
    const int64_t from = fmt == Weights::Int8 ? qg::kAmxMinRowsInt8 : qg::kAmxMinRowsInt4;
    for (int64_t M : {int64_t{1}, from - 1, from, int64_t{16}, int64_t{64}}) {
      if (M < 1) continue;
      const std::vector<float> x = random_normal(static_cast<size_t>(M * in), 32 + M);
      std::vector<float> y(static_cast<size_t>(M * out));
      qg::gemm(x.data(), M, in, p.view(), y.data(), out, Isa::Avx512);
      const Quantized xq = quantize(x, M, fmt, in);
      std::vector<float> want = amx(p.view(), xq, M, out);
      if (M < from && fmt == Weights::Int4)  // below: the AVX-512 kernel's
        qg::avx512::gemm_int4(xq.q.data(), xq.s.data(), M, int4_of(p.view()), want.data(), out,
                              qg::cpu_has_vnni());
      EXPECT_EQ(std::memcmp(y.data(), want.data(), sizeof(float) * y.size()), 0)
          << to_string(fmt) << " M=" << M;
    }
  }
}

// The int4 kernel's arithmetic, bit for bit: per group the exact integer sum of (nibble - 8) x, in fp32,
// times (weight scale times activation scale) added in group order with one FMA, modelled here in
// scalars on whole blocks of 16 channels (the tail goes to the AVX-512 kernel). Nibbles and activations
// reach their extremes (nibble 0 is -8, x at +-32767 and -32768: a group's sum up to 2^23), where any
// rounding inside the bf16 tiles would show.
TEST(QuantAmx, Int4EqualsItsScalarModelBitForBit) {
  SKIP_WITHOUT_AMX(Weights::Int4);
  constexpr Shape kShapes[] = {{2304, 48}, {1024, 32}, {160, 16}, {32, 16}};
  uint32_t seed = 7;
  const auto next = [&seed] { return seed = seed * 1664525u + 1013904223u; };
  for (Shape sh : kShapes) {
    const int64_t G = sh.in / qg::kInt4Group;
    std::vector<uint8_t> q(static_cast<size_t>(sh.in / 2 * sh.out));
    for (auto& v : q) v = static_cast<uint8_t>(next() >> 24);
    std::fill(q.begin(), q.begin() + sh.in / 2, uint8_t{0x00});          // channel 0: all -8
    std::fill(q.begin() + sh.in / 2, q.begin() + sh.in, uint8_t{0xFF});  // channel 1: all 7
    std::vector<float> ws(static_cast<size_t>(G * sh.out));
    for (auto& v : ws) v = 1e-3f * static_cast<float>(1 + next() % 997);
    const qg::Int4Weights w{q.data(), ws.data(), sh.in, sh.out};
    for (int64_t M :
         {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{16}, int64_t{17}, int64_t{40}}) {
      std::vector<int16_t> x(static_cast<size_t>(M * sh.in));
      for (auto& v : x) v = static_cast<int16_t>(static_cast<int32_t>(next() % 65535) - 32767);
      std::fill(x.begin(), x.begin() + sh.in, int16_t{-32768});
      if (M > 1) std::fill(x.begin() + sh.in, x.begin() + 2 * sh.in, int16_t{32767});
      std::vector<float> sx(static_cast<size_t>(M * G));
      for (auto& v : sx) v = 1e-5f * static_cast<float>(1 + next() % 991);
      std::vector<float> y(static_cast<size_t>(M * sh.out), 7.0f), want(y.size());
      qg::gemm_int4_amx(x.data(), sx.data(), M, w, y.data(), sh.out);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < sh.out; ++n) {
          float acc = 0.0f;
          for (int64_t g = 0; g < G; ++g) {
            int64_t sum = 0;
            for (int64_t k = 0; k < qg::kInt4Group; ++k) {
              const uint8_t byte = q[static_cast<size_t>(n * sh.in / 2 + 16 * g + k % 16)];
              const int nibble = k < 16 ? byte & 15 : byte >> 4;
              sum += (nibble - 8) * int64_t{x[static_cast<size_t>(m * sh.in + g * qg::kInt4Group + k)]};
            }
            const float s = ws[static_cast<size_t>(n * G + g)] * sx[static_cast<size_t>(m * G + g)];
            acc = std::fma(static_cast<float>(sum), s, acc);
          }
          want[static_cast<size_t>(m * sh.out + n)] = acc;
        }
      EXPECT_EQ(std::memcmp(y.data(), want.data(), sizeof(float) * y.size()), 0)
          << sh.in << "x" << sh.out << " M=" << M;
    }
  }
}

// int8 inputs the kernel does not take are refused before anything is written.
TEST(QuantAmx, Int8ShapesItDoesNotTakeAreRefused) {
  SKIP_WITHOUT_AMX(Weights::Int8);
  const int64_t M = 2;
  for (int64_t in : {int64_t{96}, int64_t{65536 + 64}}) {
    const std::vector<float> wsrc = random_normal(static_cast<size_t>(in * 16), 41, 0.05f);
    const qg::PackedMatrix p(Weights::Int8, wsrc.data(), in, 16);
    EXPECT_FALSE(qg::amx_takes(int8_of(p.view()))) << in;
    const Quantized xq = quantize(random_normal(static_cast<size_t>(M * in), 42), M, Weights::Int8, in);
    std::vector<float> y(static_cast<size_t>(M * 16), 7.0f);
    EXPECT_THROW(qg::gemm_int8_amx(xq.q.data(), xq.s.data(), M, int8_of(p.view()), y.data(), 16),
                 std::invalid_argument)
        << in;
    EXPECT_TRUE(std::all_of(y.begin(), y.end(), [](float v) { return v == 7.0f; })) << in;
  }
}

#else
TEST(QuantAmx, NotInThisBuild) {
  EXPECT_FALSE(qg::cpu_has_amx_int8());
  EXPECT_FALSE(qg::cpu_has_amx_bf16());
}
#endif

}  // namespace
}  // namespace kda
