// The row-by-row matrix-vector products of kernels/gemm/row_gemv.h (the MLA absorbed form's decode rows):
// against their references in every format on shapes across the kernel's 512-column chunks (the real
// kv_b's 512 among them), row sub-ranges, the claim that a compact copy gives its fp32 copy's bits, and
// the batched form's rows against each row alone, and the checks before anything is written.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/kernels/gemm/row_gemv.h"
#include "support/compact_rows.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace kg = kernels::gemm;
using kg::RowFormat;
using testing::random_normal;

// Each output within a few fp32 roundings of its sum of |products| (the reference sums in double).
void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                  const std::vector<double>& mag, int64_t terms, const std::string& what) {
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(static_cast<double>(got[i]) - want[i]) <=
          2.4e-7 * static_cast<double>(terms + 2) * mag[i]))
      ++bad;
  EXPECT_EQ(bad, 0) << what;
}

// Rows [r0, r0 + n) of a [rows, cols] matrix.
struct Shape {
  int64_t rows, cols, r0, n;
};

// body(shape, format, held) for every shape in every format that takes it (int4: columns a multiple of
// 32), each on its own random matrix (seeds from `seed` on).
template <class F>
void each_held(const std::vector<Shape>& shapes, uint64_t& seed, F&& body) {
  for (const Shape& s : shapes)
    for (const RowFormat f : {RowFormat::F32, RowFormat::BF16, RowFormat::Int8, RowFormat::Int4}) {
      if (f == RowFormat::Int4 && s.cols % 32 != 0) continue;
      const std::vector<float> w = random_normal(static_cast<size_t>(s.rows * s.cols), ++seed, 0.05f);
      const auto held = testing::compact_rows(f, w, s.rows, s.cols);
      body(s, f, *held);
    }
}

TEST(RowGemv, EqualsTheReferenceInEveryFormat) {
  // kv_b at the real shapes (a head's 128 W_UK rows, its 128 W_UV rows), one group, columns past a
  // 512-column chunk and not a multiple of it, single rows, a range at the end; columns of an odd count
  // of 16 and of no multiple of 16 (not int4, whose rows come in groups of 32).
  const std::vector<Shape> shapes{{512, 512, 0, 128}, {512, 512, 384, 128}, {4, 32, 0, 4},
                                  {40, 544, 3, 37},   {24, 1056, 5, 1},     {64, 96, 63, 1},
                                  {16, 2048, 0, 16},  {8, 48, 1, 6},        {6, 40, 0, 6}};
  uint64_t seed = 11;
  each_held(shapes, seed, [&](const Shape& s, RowFormat f, const testing::CompactRows& h) {
    const std::string what = std::string(testing::row_format_name(f)) + " [" + std::to_string(s.rows) + ", " +
                             std::to_string(s.cols) + "] rows " + std::to_string(s.r0) + " + " +
                             std::to_string(s.n);
    // x W over rows [r0, r0 + n) (cols outputs), then W u over the same rows (n outputs): output o's
    // terms are x[k] W[r0 + k, o], or u[c] W[r0 + o, c].
    for (const bool xw : {true, false}) {
      const int64_t in = xw ? s.n : s.cols, outs = xw ? s.cols : s.n;
      const std::vector<float> x = random_normal(static_cast<size_t>(in), ++seed);
      std::vector<float> got(static_cast<size_t>(outs)), want(got.size());
      (xw ? kg::gemv_rows_xw : kg::gemv_rows_wx)(h.view, s.r0, s.n, x.data(), got.data());
      (xw ? kg::gemv_rows_xw_reference : kg::gemv_rows_wx_reference)(h.view, s.r0, s.n, x.data(),
                                                                     want.data());
      std::vector<double> mag(got.size(), 0.0);
      for (int64_t o = 0; o < outs; ++o)
        for (int64_t k = 0; k < in; ++k)
          mag[o] +=
              std::fabs(x[k] * (xw ? h.values[(s.r0 + k) * s.cols + o] : h.values[(s.r0 + o) * s.cols + k]));
      expect_close(got, want, mag, in, (xw ? "xw " : "wx ") + what);
    }
  });
}

// What MLA's compact kv_b rests on: the compact copy's products are its fp32 values' products, bit for bit.
TEST(RowGemv, ACompactCopyGivesTheBitsOfItsFp32Values) {
  const int64_t rows = 256, cols = 512;
  const std::vector<float> w = random_normal(static_cast<size_t>(rows * cols), 5, 0.05f);
  const std::vector<float> x = random_normal(static_cast<size_t>(rows), 6), u = random_normal(cols, 7);
  for (const RowFormat f : {RowFormat::BF16, RowFormat::Int8, RowFormat::Int4}) {
    const auto held = testing::compact_rows(f, w, rows, cols);
    const testing::CompactRows& h = *held;
    const kg::RowMatrix f32{RowFormat::F32, h.values.data(), nullptr, rows, cols};
    std::vector<float> a(cols), b(cols), c(128), d(128);
    kg::gemv_rows_xw(h.view, 0, 128, x.data(), a.data());
    kg::gemv_rows_xw(f32, 0, 128, x.data(), b.data());
    kg::gemv_rows_wx(h.view, 128, 128, u.data(), c.data());
    kg::gemv_rows_wx(f32, 128, 128, u.data(), d.data());
    EXPECT_EQ(a, b) << testing::row_format_name(f);
    EXPECT_EQ(c, d) << testing::row_format_name(f);
  }
}

// The batched products (the MLA decode batch's): each row's outputs the bits of that row alone, for
// every batch size across the kernels' blocks of rows (8 / 4 / 2 / 1 for xw, 4 / 2 / 1 for wx), every
// format, columns of an even and an odd count of 16 and of no multiple of 16, and rows held apart in
// memory in any order.
TEST(RowGemv, ABatchGivesEachRowItsBitsAlone) {
  const std::vector<Shape> shapes{{512, 512, 384, 128}, {40, 544, 3, 37}, {8, 48, 1, 6}, {6, 40, 0, 6}};
  uint64_t seed = 71;
  each_held(shapes, seed, [&](const Shape& s, RowFormat f, const testing::CompactRows& held) {
    for (const bool xw : {true, false})
      for (const int64_t M : {1, 2, 3, 7, 13, 16}) {
        const int64_t in = xw ? s.n : s.cols, outs = xw ? s.cols : s.n;
        // Row m at m * (in + 3) of one buffer, its outputs at (M - 1 - m) * (outs + 5): neither
        // contiguous nor in order.
        const std::vector<float> xs = random_normal(static_cast<size_t>(M * (in + 3)), ++seed);
        std::vector<float> ys(static_cast<size_t>(M * (outs + 5)), 9.0f);
        std::vector<const float*> xp;
        std::vector<float*> yp;
        for (int64_t m = 0; m < M; ++m) {
          xp.push_back(xs.data() + m * (in + 3));
          yp.push_back(ys.data() + (M - 1 - m) * (outs + 5));
        }
        (xw ? kg::gemm_rows_xw : kg::gemm_rows_wx)(held.view, s.r0, s.n, M, xp.data(), yp.data());
        std::string what = xw ? "xw " : "wx ";
        what += testing::row_format_name(f);
        what += " cols " + std::to_string(s.cols) + " M " + std::to_string(M);
        for (int64_t m = 0; m < M; ++m) {
          std::vector<float> alone(static_cast<size_t>(outs));
          (xw ? kg::gemv_rows_xw : kg::gemv_rows_wx)(held.view, s.r0, s.n, xp[m], alone.data());
          const std::vector<float> got(yp[m], yp[m] + outs);
          ASSERT_EQ(got, alone) << what << " row " << m;
          EXPECT_EQ(yp[m][outs], 9.0f) << what << ": written past row " << m;  // the gap left alone
        }
      }
  });
}

TEST(RowGemv, RowBytesCountValuesAndScales) {
  const std::vector<float> v(64, 0.0f);
  EXPECT_EQ(kg::row_bytes({RowFormat::F32, v.data(), nullptr, 2, 64}, 2), 2 * 64 * 4);
  EXPECT_EQ(kg::row_bytes({RowFormat::BF16, v.data(), nullptr, 2, 64}, 2), 2 * 64 * 2);
  EXPECT_EQ(kg::row_bytes({RowFormat::Int8, v.data(), v.data(), 2, 64}, 2), 2 * (64 + 4));
  EXPECT_EQ(kg::row_bytes({RowFormat::Int4, v.data(), v.data(), 2, 64}, 2), 2 * (32 + 2 * 4));
}

TEST(RowGemv, BadArgumentsAreRefusedBeforeWriting) {
  const std::vector<float> w = random_normal(8 * 64, 3), x(64, 1.0f);
  const kg::RowMatrix m{RowFormat::F32, w.data(), nullptr, 8, 64};
  std::vector<float> y(64, 7.0f);
  const std::vector<float> before = y;
  EXPECT_THROW(kg::gemv_rows_xw(m, 4, 5, x.data(), y.data()), std::invalid_argument);   // past the rows
  EXPECT_THROW(kg::gemv_rows_wx(m, -1, 2, x.data(), y.data()), std::invalid_argument);  // negative start
  EXPECT_THROW(kg::gemv_rows_wx(m, 0, 2, nullptr, y.data()), std::invalid_argument);
  EXPECT_THROW(kg::gemv_rows_xw({RowFormat::Int4, w.data(), w.data(), 8, 48}, 0, 1, x.data(), y.data()),
               std::invalid_argument);  // int4 columns not a multiple of 32
  EXPECT_THROW(kg::gemv_rows_xw({RowFormat::Int8, w.data(), nullptr, 8, 64}, 0, 1, x.data(), y.data()),
               std::invalid_argument);  // no scales
  EXPECT_THROW(kg::gemv_rows_xw({RowFormat::F32, nullptr, nullptr, 8, 64}, 0, 1, x.data(), y.data()),
               std::invalid_argument);
  // The batched form: a bad row anywhere in the batch, or no row arrays, before any row is written.
  std::vector<float> y2(64, 7.0f);
  const float* xs[2] = {x.data(), nullptr};
  float* ys[2] = {y.data(), y2.data()};
  EXPECT_THROW(kg::gemm_rows_xw(m, 0, 4, 2, xs, ys), std::invalid_argument);
  testing::expect_throw_with<std::invalid_argument>([&] { kg::gemm_rows_wx(m, 0, 4, -1, xs, ys); },
                                                    "negative row count");
  testing::expect_throw_with<std::invalid_argument>([&] { kg::gemm_rows_wx(m, 0, 4, 2, nullptr, ys); },
                                                    "no row pointers");
  xs[1] = x.data();
  EXPECT_THROW(kg::gemm_rows_wx(m, 6, 4, 2, xs, ys), std::invalid_argument);  // past the rows
  EXPECT_EQ(y, before);
  EXPECT_EQ(y2, before);
}

}  // namespace
}  // namespace kda
