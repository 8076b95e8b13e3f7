// The bf16 GEMM for decode row counts: every ISA copy against its reference (widen, then plain fp32
// loops) on decode and odd shapes, a row's result independent of its batch, and Linear's two bf16
// paths (oneDNN's bf16 matmul, and the widened one: these kernels, then fp32 tiles) against each other
// at every rounding point.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/bf16_amx_block.h"
#include "kda/kernels/gemm/bf16_gemm.h"
#include "kda/kernels/gemm/weight_format.h"
#include "kda/layers/bf16_vnni_rows.h"
#include "kda/layers/linear.h"
#include "kda/layers/onednn_isa.h"
#include "support/gemm_check.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace kg = kernels::gemm;
using testing::available_isas;
using testing::expect_close_fp32;
using testing::expect_throw_with;
using testing::random_normal;

std::vector<bf16_t> to_bf16(const std::vector<float>& v) {
  std::vector<bf16_t> b(v.size());
  f32_to_bf16_array(v.data(), b.data(), v.size());
  return b;
}

// W [out, in] in the kernels' packed form.
std::vector<bf16_t> packed(const std::vector<bf16_t>& w, int64_t in, int64_t out) {
  std::vector<bf16_t> p(static_cast<size_t>(kg::packed_size(in, out)), 0xFFFF);
  kg::pack(w.data(), in, out, p.data());
  return p;
}

// The packed form holds every weight once -- K-chunks of equal groups of 32 inputs (at most 32 groups,
// the last one shorter), in each chunk blocks of 4 channels, in each block its groups, in each group
// its channels -- and zeros in its padding; dequantize_rows gives back any range of rows.
TEST(Bf16Gemm, PackingKeepsEveryWeight) {
  for (auto [in, out] :
       {std::pair<int64_t, int64_t>{2304, 12}, {1100, 6}, {33, 5}, {1, 1}, {64, 7}, {100, 3}, {4096, 4}}) {
    std::vector<bf16_t> w(static_cast<size_t>(in * out));
    for (size_t i = 0; i < w.size(); ++i) w[i] = f32_to_bf16(static_cast<float>(i % 4093 + 1));
    const std::vector<bf16_t> p = packed(w, in, out);
    const int64_t groups = (in + 31) / 32, blocks = (out + 3) / 4, chunks = (groups + 31) / 32,
                  per_chunk = (groups + chunks - 1) / chunks;
    ASSERT_EQ(static_cast<int64_t>(p.size()), blocks * groups * 4 * 32);
    for (int64_t n = 0; n < blocks * 4; ++n)
      for (int64_t k = 0; k < groups * 32; ++k) {
        const int64_t c = k / 32 / per_chunk, in_chunk = std::min(per_chunk, groups - c * per_chunk);
        const int64_t at =
            ((c * per_chunk * blocks + n / 4 * in_chunk + k / 32 % per_chunk) * 4 + n % 4) * 32 + k % 32;
        ASSERT_EQ(p[static_cast<size_t>(at)], n < out && k < in ? w[n * in + k] : bf16_t{0})
            << in << "x" << out << " " << n << "," << k;
      }
    const kg::PackedWeights pw{Weights::BF16, p.data(), nullptr, in, out};
    for (auto [n0, n1] : {std::pair<int64_t, int64_t>{0, out}, {out / 2, out}, {out - 1, out}, {0, 1}}) {
      std::vector<float> rows(static_cast<size_t>((n1 - n0) * in));
      kg::dequantize_rows(pw, n0, n1, rows.data());
      for (int64_t i = 0; i < (n1 - n0) * in; ++i) ASSERT_EQ(rows[i], bf16_to_f32(w[n0 * in + i])) << n0;
    }
  }
}

TEST(Bf16Gemm, KernelsEqualTheReference) {
  struct Shape {
    int64_t in, out;
  };
  for (Shape s : {Shape{2304, 37}, Shape{128, 260}, Shape{4096, 9}, Shape{17, 5}, Shape{100, 3}, Shape{1, 1},
                  Shape{33, 64}, Shape{1100, 14}}) {
    const std::vector<bf16_t> wb =
        packed(to_bf16(random_normal(static_cast<size_t>(s.in * s.out), s.in + s.out, 0.05f)), s.in, s.out);
    const kg::PackedWeights w{Weights::BF16, wb.data(), nullptr, s.in, s.out};
    std::vector<float> wf(static_cast<size_t>(s.in * s.out));
    kg::dequantize_rows(w, 0, s.out, wf.data());
    for (int64_t M : {1, 2, 3, 4, 5, 6, 7, 8, 11, 13, 16, 33, 64, 65, 150}) {
      const int64_t ldx = s.in + 3, ldy = s.out + 5;
      const std::vector<float> x = random_normal(static_cast<size_t>(M * ldx), 100 + M);
      std::vector<float> yref(static_cast<size_t>(M * ldy), -1.0f);
      kg::gemm_reference(x.data(), M, ldx, w, yref.data(), ldy);
      for (Isa isa : available_isas()) {
        std::vector<float> y(static_cast<size_t>(M * ldy), 7.0f);
        kg::gemm(x.data(), M, ldx, w, y.data(), ldy, isa);
        const std::string what = std::to_string(s.in) + "x" + std::to_string(s.out) +
                                 " M=" + std::to_string(M) + " " + to_string(isa);
        expect_close_fp32(x, ldx, wf, M, s.in, s.out, y.data(), ldy, yref.data(), ldy, what);
        for (int64_t m = 0; m < M; ++m)  // the padding between rows is left as it was
          for (int64_t n = s.out; n < ldy; ++n) ASSERT_EQ(y[m * ldy + n], 7.0f) << what;
      }
    }
  }
}

// A row's sums run in the same order at any M, so a token computes the same bits alone (a decode step)
// as in a batch (a verify row of several tokens).
TEST(Bf16Gemm, ARowsResultDoesNotDependOnItsBatch) {
  const int64_t in = 1100, out = 41;  // two K-chunks
  const std::vector<bf16_t> wb =
      packed(to_bf16(random_normal(static_cast<size_t>(in * out), 5, 0.05f)), in, out);
  const kg::PackedWeights w{Weights::BF16, wb.data(), nullptr, in, out};
  const int64_t M = 140;  // several row chunks
  const std::vector<float> x = random_normal(static_cast<size_t>(M * in), 6);
  for (Isa isa : available_isas()) {
    std::vector<float> all(static_cast<size_t>(M * out));
    kg::gemm(x.data(), M, in, w, all.data(), out, isa);
    for (int64_t m = 0; m < M; ++m) {
      std::vector<float> one(static_cast<size_t>(out));
      kg::gemm(x.data() + m * in, 1, in, w, one.data(), out, isa);
      EXPECT_EQ(std::memcmp(one.data(), all.data() + m * out, sizeof(float) * out), 0)
          << "row " << m << " " << to_string(isa);
    }
  }
}

TEST(Bf16Gemm, BadCallsAreRefused) {
  const std::vector<bf16_t> wb(static_cast<size_t>(kg::packed_size(8, 4)));
  const kg::PackedWeights w{Weights::BF16, wb.data(), nullptr, 8, 4};
  std::vector<float> x(16), y(8);
  expect_throw_with<std::invalid_argument>([&] { kg::gemm(x.data(), 2, 7, w, y.data(), 4); },
                                           "bad M or row strides");
  expect_throw_with<std::invalid_argument>([&] { kg::gemm(x.data(), 2, 8, w, nullptr, 4); }, "null x or y");
  expect_throw_with<std::invalid_argument>(
      [&] { kg::gemm(x.data(), 1, 8, kg::PackedWeights{}, y.data(), 4); }, "empty weights");
  std::vector<bf16_t> out(static_cast<size_t>(kg::packed_size(8, 4)), 5);
  expect_throw_with<std::invalid_argument>([&] { kg::pack(nullptr, 8, 4, out.data()); },
                                           "pack of empty weights");
  expect_throw_with<std::invalid_argument>([&] { kg::pack(wb.data(), 0, 4, out.data()); },
                                           "pack of empty weights");
  EXPECT_EQ(out, std::vector<bf16_t>(out.size(), 5));
}

// Linear's widened path (these kernels) against
// oneDNN's bf16 matmul: both multiply the same bf16 x and W exactly and accumulate in fp32, so they
// differ only in summation order; every forward overload, strided rows, one row chunk and several.
TEST(Bf16Gemm, LinearsWidenedPathEqualsOneDnnsBf16Matmul) {
  const int64_t in = 2304, out = 300;
  const std::vector<float> w = random_normal(static_cast<size_t>(in * out), 9, 0.02f);
  const layers::Linear onednn(in, out, w, Precision::BF16, Weights::BF16, layers::Bf16Gemm::OneDnn);
  const layers::Linear widened(in, out, w, Precision::BF16, Weights::BF16, layers::Bf16Gemm::Widened);
  EXPECT_EQ(widened.bf16_gemm(), layers::Bf16Gemm::Widened);
  EXPECT_EQ(widened.weight_bytes(), onednn.weight_bytes());
  const int64_t ldx = in + 16, ldy = out + 8;
  for (int64_t M : {1, 5, 64, 65, 300}) {
    const std::vector<float> x = random_normal(static_cast<size_t>(M * ldx), 40 + M);
    const std::vector<bf16_t> xb = to_bf16(x);
    std::vector<float> ya(static_cast<size_t>(M * ldy), 3.0f), yb(ya);
    onednn.forward(x.data(), M, ldx, ya.data(), ldy);
    widened.forward(x.data(), M, ldx, yb.data(), ldy);
    const std::string what = "M=" + std::to_string(M);
    EXPECT_LE(testing::max_error_ratio(yb.data(), ya.data(), ya.size(), 1e-5, 1e-5), 1.0) << what;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = out; n < ldy; ++n) ASSERT_EQ(yb[m * ldy + n], 3.0f) << what;
    // bf16 input: the same values as the fp32 input rounded to bf16, so the same result.
    std::vector<float> yx(ya.size(), 3.0f);
    widened.forward(xb.data(), M, ldx, yx.data(), ldy);
    EXPECT_EQ(yx, yb) << what;
    // bf16 output: the fp32 result rounded to nearest even.
    std::vector<bf16_t> y16(static_cast<size_t>(M * ldy), 0), y16x(y16.size(), 0);
    widened.forward(x.data(), M, ldx, y16.data(), ldy);
    widened.forward(xb.data(), M, ldx, y16x.data(), ldy);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < out; ++n) {
        ASSERT_EQ(y16[m * ldy + n], f32_to_bf16(yb[m * ldy + n])) << what;
        ASSERT_EQ(y16x[m * ldy + n], y16[m * ldy + n]) << what;
      }
  }
}

namespace qg = kernels::gemm;

// Whether a bf16 Linear of 64 inputs sends its decode rows to the AMX kernel here (oneDNN on AMX tiles).
bool amx_rows_here() { return layers::onednn_bf16_uses_amx() && qg::bf16_amx_block_takes(64); }

TEST(Bf16Gemm, AChoiceIsOnlyForBf16ProjectionsWithBf16Weights) {
  const std::vector<float> w(64 * 32, 0.5f);
  for (auto choice : {layers::Bf16Gemm::OneDnn, layers::Bf16Gemm::OneDnnVnni, layers::Bf16Gemm::Widened,
                      layers::Bf16Gemm::OneDnnAmx}) {
    expect_throw_with<std::invalid_argument>(
        [&] { layers::Linear(64, 32, w, Precision::FP32, Weights::BF16, choice); },
        "only for bf16 projections");
    expect_throw_with<std::invalid_argument>(
        [&] { layers::Linear(64, 32, w, Precision::BF16, Weights::Int8, choice); },
        "only for bf16 projections");
  }
  EXPECT_EQ(layers::Linear(64, 32, w, Precision::FP32).bf16_gemm(), layers::Bf16Gemm::OneDnn);
  const auto expect = !cpu_has_bf16_gemm()                       ? layers::Bf16Gemm::Widened
                      : layers::onednn_bf16_k_chunk(64, 32) >= 0 ? layers::Bf16Gemm::OneDnnVnni
                      : amx_rows_here()                          ? layers::Bf16Gemm::OneDnnAmx
                                                                 : layers::Bf16Gemm::OneDnn;
  EXPECT_EQ(layers::Linear(64, 32, w, Precision::BF16).bf16_gemm(), expect);
}

// A Linear built from bf16 rows (a checkpoint's mapped tensor) is the Linear built from their values in
// fp32, bit for bit, whichever kernel multiplies: the bf16 ones read the rows as they are, the widened
// ones and the fp32 precision widen them.
TEST(Bf16Gemm, ALinearFromBf16RowsIsTheOneFromTheirValues) {
  const int64_t in = 2304, out = 300;
  const std::vector<bf16_t> wb = to_bf16(random_normal(static_cast<size_t>(in * out), 11, 0.02f));
  std::vector<float> wf(wb.size());
  bf16_to_f32_array(wb.data(), wf.data(), wf.size());
  struct Mode {
    Precision precision;
    layers::Bf16Gemm gemm;
  };
  std::vector<Mode> modes{{Precision::FP32, layers::Bf16Gemm::Auto},
                          {Precision::BF16, layers::Bf16Gemm::Auto},
                          {Precision::BF16, layers::Bf16Gemm::Widened}};
  if (cpu_has_bf16_gemm()) modes.push_back({Precision::BF16, layers::Bf16Gemm::OneDnn});
  if (cpu_has_bf16_gemm() && layers::onednn_bf16_k_chunk(in, out) >= 0)
    modes.push_back({Precision::BF16, layers::Bf16Gemm::OneDnnVnni});
  for (const Mode& mode : modes) {
    const layers::Linear from_f32(in, out, wf, mode.precision, Weights::BF16, mode.gemm);
    const layers::Linear from_bf16(in, out, wb.data(), mode.precision, mode.gemm);
    const std::string what = std::string("precision ") + to_string(mode.precision) + ", gemm " +
                             std::to_string(static_cast<int>(mode.gemm));
    EXPECT_EQ(from_bf16.bf16_gemm(), from_f32.bf16_gemm()) << what;
    EXPECT_EQ(from_bf16.weight_bytes(), from_f32.weight_bytes()) << what;
    for (int64_t M : {1, 4, 65}) {
      const std::vector<float> x = random_normal(static_cast<size_t>(M * in), 60 + M);
      std::vector<float> ya(static_cast<size_t>(M * out)), yb(ya.size());
      from_f32.forward(x.data(), M, ya.data());
      from_bf16.forward(x.data(), M, yb.data());
      EXPECT_EQ(std::memcmp(ya.data(), yb.data(), sizeof(float) * ya.size()), 0) << what << ", M " << M;
    }
  }
  expect_throw_with<std::invalid_argument>([&] { layers::Linear(in, out, nullptr, Precision::BF16); },
                                           "null bf16 weight");
  expect_throw_with<std::invalid_argument>([&] { layers::Linear(0, out, wb.data(), Precision::BF16); },
                                           "features must be positive");
}

// Where oneDNN multiplies with AMX tiles, a bf16 Linear's calls of up to kAmxRows rows go to the AMX
// decode kernel on oneDNN's copy of W: each row's bits the same alone as in any such call, within fp32
// summation rounding of oneDNN's own result, a bf16 output its fp32 one rounded; more rows stay oneDNN's
// (its bits). Elsewhere asking for it is refused.
TEST(Bf16Gemm, OneDnnAmxDecodeRowsDoNotDependOnTheirBatch) {
  const std::vector<float> w0(64 * 32, 0.5f);
  if (!amx_rows_here()) {
    expect_throw_with<std::invalid_argument>(
        [&] { layers::Linear(64, 32, w0, Precision::BF16, Weights::BF16, layers::Bf16Gemm::OneDnnAmx); },
        "AMX decode kernel");
    GTEST_SKIP() << "oneDNN does not use AMX tiles here";
  }
  uint64_t seed = 40;
  for (const auto& [in, out] :
       {std::pair<int64_t, int64_t>{2304, 300}, {128, 4096}, {4096, 2304}, {96, 70}}) {
    const std::vector<float> w = random_normal(static_cast<size_t>(in * out), ++seed, 0.02f);
    const layers::Linear amx(in, out, w, Precision::BF16);
    const layers::Linear onednn(in, out, w, Precision::BF16, Weights::BF16, layers::Bf16Gemm::OneDnn);
    ASSERT_EQ(amx.bf16_gemm(), layers::Bf16Gemm::OneDnnAmx);
    constexpr int64_t kRows = qg::kAmxRows + 3;
    const std::vector<bf16_t> x = to_bf16(random_normal(static_cast<size_t>(kRows * in), ++seed));
    std::vector<std::vector<float>> alone(kRows, std::vector<float>(static_cast<size_t>(out)));
    for (int64_t m = 0; m < kRows; ++m) amx.forward(x.data() + m * in, 1, in, alone[m].data(), out);
    for (int64_t M : std::initializer_list<int64_t>{2, 5, 16, 17, 40, qg::kAmxRows, kRows}) {
      const std::string what =
          std::to_string(in) + " -> " + std::to_string(out) + ", " + std::to_string(M) + " rows";
      std::vector<float> y(static_cast<size_t>(M * out)), ref(y.size());
      std::vector<bf16_t> y16(y.size());
      amx.forward(x.data(), M, in, y.data(), out);
      amx.forward(x.data(), M, in, y16.data(), out);
      onednn.forward(x.data(), M, in, ref.data(), out);
      if (M > qg::kAmxRows) {
        EXPECT_EQ(std::memcmp(y.data(), ref.data(), sizeof(float) * y.size()), 0) << what;
        continue;
      }
      for (int64_t m = 0; m < M; ++m)
        ASSERT_EQ(std::memcmp(y.data() + m * out, alone[m].data(), sizeof(float) * out), 0)
            << what << ", row " << m;
      for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y16[i], f32_to_bf16(y[i])) << what;
      EXPECT_LE(testing::max_error_ratio(y.data(), ref.data(), y.size(), 1e-5, 1e-5), 1.0) << what;
    }
  }
}

}  // namespace
}  // namespace kda
