// QuantLinear's prefill paths (more than kDecodeRows rows): the bf16 tiles of kernels/gemm/quant_tile.h
// against their scalar reference bit for bit and against the scheme's fp32 weights (int8: the integers,
// int4: hi + lo within 2^-16), and every path (bf16 tiles, fp32 tiles, dpbf16 where the CPU has
// AVX512_BF16, int4's amx bf16 where it has AMX-BF16) against x W^T in double (W the
// scheme's dequantized weights, x as the projection reads it) within fp32 summation rounding, at the
// model's widths and odd ones, several row counts, strided rows, bf16 in and out; NaN weights; the
// primitives kept bounded.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <dnnl.hpp>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/quant_amx.h"
#include "kda/kernels/gemm/quant_dpbf16.h"
#include "kda/kernels/gemm/quant_tile.h"
#include "kda/kernels/gemm/weight_format.h"
#include "kda/layers/quant_linear.h"
#include "support/gemm_check.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace qg = kernels::gemm;
using layers::QuantLinear;
using Prefill = QuantLinear::Prefill;
using testing::expect_close_fp32;
using testing::expect_throw_with;
using testing::random_normal;

TEST(QuantPrefill, Bf16TilesEqualTheReferenceAndTheScheme) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Shape {
    int64_t in, out;
  };
  for (Weights fmt : {Weights::Int8, Weights::Int4})
    for (Shape sh : {Shape{32, 1}, Shape{96, 7}, Shape{1024, 5}, Shape{2304, 33}}) {
      const std::string what =
          std::string(to_string(fmt)) + " " + std::to_string(sh.in) + "x" + std::to_string(sh.out);
      std::vector<float> w = random_normal(static_cast<size_t>(sh.in * sh.out), 40 + sh.in, 0.05f);
      if (sh.out > 2) {
        std::fill(w.begin() + sh.in, w.begin() + 2 * sh.in, 0.0f);  // channel 1 all zeros
        w[2 * sh.in + sh.in / 2] = nan;                             // channel 2: a NaN
      }
      w[0] *= 1e4f;  // a large outlier: its channel's (or group's) other weights land near zero
      const qg::PackedMatrix p(fmt, w.data(), sh.in, sh.out);
      const qg::PackedWeights v = p.view();
      const int64_t depth = qg::bf16_tile_depth(v), ld = depth + 3;
      ASSERT_EQ(depth, fmt == Weights::Int4 ? 2 * sh.in : sh.in);
      std::vector<bf16_t> got(static_cast<size_t>(sh.out * ld), 0xABCD), ref(got);
      qg::bf16_tile_rows(v, 0, sh.out, got.data(), ld);
      qg::bf16_tile_rows_reference(v, 0, sh.out, ref.data(), ld);
      EXPECT_TRUE(got == ref) << what;  // the padding between rows untouched by both
      for (int64_t n = 0; n < sh.out; ++n)
        for (int64_t k = depth; k < ld; ++k) ASSERT_EQ(got[n * ld + k], 0xABCD) << what;
      // A row range lands at the start of out.
      std::vector<bf16_t> part(static_cast<size_t>(sh.out * ld), 0xABCD);
      qg::bf16_tile_rows(v, sh.out / 2, sh.out, part.data(), ld);
      EXPECT_TRUE(
          std::equal(part.begin(), part.begin() + (sh.out - sh.out / 2) * ld, got.begin() + sh.out / 2 * ld))
          << what;
      // What the tile means: int8 q with W = q * scale exactly; int4 hi + lo within 2^-16 |W|.
      const std::vector<float> wf = qg::dequantize(v);
      int bad = 0;
      for (int64_t n = 0; n < sh.out; ++n)
        for (int64_t k = 0; k < sh.in; ++k) {
          const float want = wf[n * sh.in + k];
          float have;
          if (fmt == Weights::Int8) {
            const float q = bf16_to_f32(got[n * ld + k]);
            if (q != std::nearbyint(q) || std::fabs(q) > 127.0f) ++bad;
            have = q * v.scale[n];
          } else {
            have = bf16_to_f32(got[n * ld + k]) + bf16_to_f32(got[n * ld + sh.in + k]);
          }
          if (std::isnan(want) != std::isnan(have)) ++bad;
          if (!std::isnan(want) && !(std::fabs(have - want) <= std::ldexp(std::fabs(want), -16))) ++bad;
          if (fmt == Weights::Int8 && !std::isnan(want) && have != want) ++bad;
        }
      EXPECT_EQ(bad, 0) << what;
    }
}

// The blocked tile is the plain one reordered by oneDNN into BA16a64b2a (its padding zero), on shapes
// whose K and N are and are not multiples of the blocks.
TEST(QuantPrefill, BlockedTileIsOneDnnsReorderOfThePlainTile) {
  using dnnl::memory;
  const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream strm(eng);
  struct Shape {
    int64_t in, out;
  };
  for (Weights fmt : {Weights::Int8, Weights::Int4})
    for (Shape sh : {Shape{32, 1}, Shape{96, 70}, Shape{1024, 128}, Shape{2304, 33}}) {
      if (fmt == Weights::Int8 && sh.in == 96) sh.in = 90;  // int8: K not a multiple of 16
      const std::string what =
          std::string(to_string(fmt)) + " " + std::to_string(sh.in) + "x" + std::to_string(sh.out);
      const std::vector<float> w = random_normal(static_cast<size_t>(sh.in * sh.out), 80 + sh.out, 0.05f);
      const qg::PackedMatrix p(fmt, w.data(), sh.in, sh.out);
      const qg::PackedWeights v = p.view();
      const int64_t depth = qg::bf16_tile_depth(v);
      std::vector<bf16_t> plain(static_cast<size_t>(sh.out * depth));
      qg::bf16_tile_rows_reference(v, 0, sh.out, plain.data(), depth);
      const memory::desc blocked_md({depth, sh.out}, memory::data_type::bf16, memory::format_tag::BA16a64b2a);
      ASSERT_EQ(blocked_md.get_size(), sizeof(bf16_t) * qg::bf16_blocked_tile_size(v, sh.out)) << what;
      std::vector<bf16_t> want(static_cast<size_t>(qg::bf16_blocked_tile_size(v, sh.out)), 0x1234),
          got(want.size(), 0x1234);
      memory src(memory::desc({depth, sh.out}, memory::data_type::bf16, memory::dims{1, depth}), eng,
                 plain.data());
      memory dst(blocked_md, eng, want.data());
      dnnl::reorder(src, dst).execute(strm, src, dst);
      strm.wait();
      qg::bf16_tile_blocked(v, 0, sh.out, got.data());
      EXPECT_TRUE(got == want) << what;
    }
}

TEST(QuantPrefill, BadTileCallsAreRefused) {
  const std::vector<float> w = random_normal(64 * 3, 1, 0.05f);
  const qg::PackedMatrix i4(Weights::Int4, w.data(), 64, 3), b16(Weights::BF16, w.data(), 64, 3);
  std::vector<bf16_t> out(3 * 128);
  expect_throw_with<std::invalid_argument>([&] { qg::bf16_tile_rows(b16.view(), 0, 3, out.data(), 128); },
                                           "must be int8 or int4");
  expect_throw_with<std::invalid_argument>([&] { qg::bf16_tile_rows(i4.view(), 0, 3, out.data(), 127); },
                                           "below the tile depth 128");
  expect_throw_with<std::invalid_argument>([&] { qg::bf16_tile_rows(i4.view(), 2, 4, out.data(), 128); },
                                           "bad row range");
  expect_throw_with<std::invalid_argument>(
      [&] { qg::bf16_tile_rows_reference(i4.view(), 1, 0, out.data(), 128); }, "bad row range");
  expect_throw_with<std::invalid_argument>([&] { qg::bf16_tile_blocked(b16.view(), 0, 3, out.data()); },
                                           "must be int8 or int4");
  expect_throw_with<std::invalid_argument>(
      [&] { QuantLinear(64, 3, w, Weights::Int8, Precision::FP32, Prefill::Bf16Tiles); },
      "the bf16 tiles path needs the bf16 precision");
  expect_throw_with<std::invalid_argument>(
      [&] { QuantLinear(64, 3, w, Weights::Int4, Precision::FP32, Prefill::Dpbf16); },
      "the dpbf16 path needs the bf16 precision");
  expect_throw_with<std::invalid_argument>(
      [&] {
        QuantLinear(48, 3, std::vector<float>(48 * 3, 0.5f), Weights::Int8, Precision::BF16, Prefill::Dpbf16);
      },
      "a multiple of 32");
  expect_throw_with<std::invalid_argument>(
      [&] { QuantLinear(64, 3, w, Weights::Int4, Precision::FP32, Prefill::AmxBf16); },
      "the amx bf16 path needs the bf16 precision");
  if (qg::cpu_has_amx_bf16())
    expect_throw_with<std::invalid_argument>(
        [&] {
          QuantLinear(48, 3, std::vector<float>(48 * 3, 0.5f), Weights::Int8, Precision::BF16,
                      Prefill::AmxBf16);
        },
        "a multiple of 32");
  if (!qg::cpu_has_amx_bf16())
    expect_throw_with<std::invalid_argument>(
        [&] { QuantLinear(64, 3, w, Weights::Int4, Precision::BF16, Prefill::AmxBf16); }, "needs AMX-BF16");
}

// Both prefill paths at the model's widths (the expert's [2I, D] and [D, I], tiles with a tail) and odd
// ones, fp32 rows with a stride and bf16 rows, against x W^T in double.
TEST(QuantPrefill, BothPathsEqualTheSchemeInDouble) {
  struct Case {
    int64_t in, out;
    std::vector<int64_t> rows;
  };
  const Case cases[] = {{2304, 1100, {65}}, {1024, 1030, {130}}, {96, 40, {65, 517}}};
  for (const Case& c : cases) {
    const std::vector<float> wsrc = random_normal(static_cast<size_t>(c.in * c.out), 60 + c.out, 0.04f);
    for (Weights fmt : {Weights::Int8, Weights::Int4}) {
      std::vector<std::unique_ptr<QuantLinear>> paths;
      for (Prefill p : {Prefill::Bf16Tiles, Prefill::Fp32Tiles, Prefill::Dpbf16, Prefill::AmxBf16})
        if ((p != Prefill::Dpbf16 || qg::cpu_has_quant_dpbf16()) &&
            (p != Prefill::AmxBf16 || qg::cpu_has_amx_bf16()))
          paths.push_back(std::make_unique<QuantLinear>(c.in, c.out, wsrc, fmt, Precision::BF16, p));
      const QuantLinear picked(c.in, c.out, wsrc, fmt, Precision::BF16);
      EXPECT_EQ(picked.prefill_path(), QuantLinear::prefill_path_for(fmt, Precision::BF16));
      EXPECT_EQ(QuantLinear::prefill_path_for(fmt, Precision::FP32), Prefill::Fp32Tiles);
      for (int64_t M : c.rows) {
        const int64_t ldx = c.in + 8, ldy = c.out + 4;
        std::vector<float> x = random_normal(static_cast<size_t>(M * ldx), 500 + M);
        std::vector<float> xr = x;  // as the projection reads it: bf16-rounded
        round_bf16_inplace(xr.data(), xr.size());
        std::vector<bf16_t> xb(x.size());
        f32_to_bf16_array(x.data(), xb.data(), xb.size());
        for (const auto& ql : paths) {
          const std::string what = std::string(to_string(fmt)) + " " + layers::to_string(ql->prefill_path()) +
                                   " " + std::to_string(c.in) + "x" + std::to_string(c.out) +
                                   " M=" + std::to_string(M);
          const std::vector<float> wm = ql->dequantized(M);  // W as this path multiplies it
          const std::vector<float> yref = testing::gemm_double(xr, ldx, wm, M, c.in, c.out);
          std::vector<float> y(static_cast<size_t>(M * ldy), 3.0f);
          ql->forward(x.data(), M, ldx, y.data(), ldy);
          expect_close_fp32(xr, ldx, wm, M, c.in, c.out, y.data(), ldy, yref.data(), c.out, what + " f32");
          for (int64_t m = 0; m < M; ++m)
            for (int64_t n = c.out; n < ldy; ++n) ASSERT_EQ(y[m * ldy + n], 3.0f) << what;
          // bf16 rows in and out: the same sums rounded to nearest even as they are stored.
          std::vector<bf16_t> yb(static_cast<size_t>(M * ldy));
          ql->forward(xb.data(), M, ldx, yb.data(), ldy);
          int bad = 0;
          for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < c.out; ++n)
              if (yb[m * ldy + n] != f32_to_bf16(y[m * ldy + n])) ++bad;
          EXPECT_EQ(bad, 0) << what << " bf16";
        }
      }
    }
  }
}

// A NaN weight makes its channel's outputs NaN on the bf16 tiles as on the fp32 ones (int8: its scale
// is NaN and q zero; int4: its group's), and on the widened AMX tiles (its channel in the last, short
// block), the other channels as without it.
TEST(QuantPrefill, NaNWeightsGiveNaNChannelsOnTheBf16Tiles) {
  const int64_t in = 128, out = 1030, M = 80;
  for (Weights fmt : {Weights::Int8, Weights::Int4})
    for (Prefill p : {Prefill::Bf16Tiles, Prefill::AmxBf16}) {
      if (p == Prefill::AmxBf16 && !qg::cpu_has_amx_bf16()) continue;
      const std::string what = std::string(to_string(fmt)) + " " + layers::to_string(p);
      std::vector<float> wsrc = random_normal(static_cast<size_t>(in * out), 33, 0.05f);
      const QuantLinear clean(in, out, wsrc, fmt, Precision::BF16, p);
      wsrc[1027 * in + 70] = std::numeric_limits<float>::quiet_NaN();  // in the tail tile
      const QuantLinear ql(in, out, wsrc, fmt, Precision::BF16, p);
      std::vector<float> x = random_normal(static_cast<size_t>(M * in), 12);
      std::vector<float> y(static_cast<size_t>(M * out)), yc(y.size());
      ql.forward(x.data(), M, in, y.data(), out);
      clean.forward(x.data(), M, in, yc.data(), out);
      int bad = 0;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < out; ++n) {
          const float v = y[m * out + n];
          if (n == 1027 ? !std::isnan(v) : v != yc[m * out + n]) ++bad;
        }
      EXPECT_EQ(bad, 0) << what;
    }
}

// The bf16 tiles keep one primitive per (rows, tile width), at most kMaxPrimitives over many row counts,
// and a row count whose primitives were dropped still computes right.
TEST(QuantPrefill, Bf16TilePrimitivesStayBounded) {
  const int64_t in = 64, out = QuantLinear::kBf16Tile + 20;  // two tiles: two primitives per row count
  const std::vector<float> wsrc = random_normal(static_cast<size_t>(in * out), 92, 0.05f);
  const QuantLinear ql(in, out, wsrc, Weights::Int8, Precision::BF16, Prefill::Bf16Tiles);
  const std::vector<float> wf = ql.dequantized();
  const auto check_rows = [&](int64_t M) {
    std::vector<float> x = random_normal(static_cast<size_t>(M * in), 700 + M);
    round_bf16_inplace(x.data(), x.size());
    std::vector<float> y(static_cast<size_t>(M * out));
    ql.forward(x.data(), M, in, y.data(), out);
    const std::vector<float> yref = testing::gemm_double(x, in, wf, M, in, out);
    expect_close_fp32(x, in, wf, M, in, out, y.data(), out, yref.data(), out, "M=" + std::to_string(M));
  };
  const int64_t first = QuantLinear::kDecodeRows + 1, counts = QuantLinear::kMaxPrimitives;
  for (int64_t M = first; M < first + counts; ++M) {
    check_rows(M);
    EXPECT_EQ(ql.cached_primitives(),
              std::min<size_t>(2 * static_cast<size_t>(M - first + 1), QuantLinear::kMaxPrimitives));
  }
  check_rows(first);
  EXPECT_EQ(ql.cached_primitives(), QuantLinear::kMaxPrimitives);
}

}  // namespace
}  // namespace kda
