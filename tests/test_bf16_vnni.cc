// The AVX512_BF16 decode GEMM (kernels/gemm/bf16_vnni.h): bit for bit its reference on random shapes
// (row counts from 1 to past a pass, inputs and channels with and without a whole last block, strided rows,
// fp32 and bf16 out), and bit for bit oneDNN's bf16 matmul on the same weights in the layout oneDNN
// reorders them into, at the model's projection shapes and row counts from a decode row to a prefill
// chunk: the property that lets a Linear send its decode rows to it without a row's bits depending on
// its batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <dnnl.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/bf16_vnni.h"
#include "kda/layers/bf16_vnni_rows.h"
#include "kda/layers/onednn_isa.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace kg = kernels::gemm;

#define SKIP_WITHOUT_BF16() \
  if (!kg::cpu_has_bf16_vnni()) GTEST_SKIP() << "this CPU (or build) has no AVX512_BF16"

uint32_t bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

// Counts the outputs of y (rows of N with stride ld) whose bits differ from want's.
template <class T>
int64_t differing(const std::vector<T>& y, const std::vector<T>& want, int64_t M, int64_t N, int64_t ld) {
  int64_t bad = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      if (std::memcmp(&y[m * ld + n], &want[m * ld + n], sizeof(T)) != 0) ++bad;
  return bad;
}

TEST(Bf16Vnni, EqualsItsReferenceBitForBit) {
  SKIP_WITHOUT_BF16();
  struct Case {
    int64_t M, K, N;
  };
  const Case cases[] = {{1, 16, 1},    {1, 32, 17},    {2, 48, 64},    {3, 2304, 65},  {5, 128, 200},
                        {6, 1024, 64}, {7, 1024, 129}, {13, 256, 576}, {16, 2304, 96}, {17, 64, 33},
                        {48, 144, 80}, {49, 512, 64},  {64, 16, 300},  {100, 96, 130}};
  uint64_t seed = 1;
  for (const Case& c : cases) {
    for (const int64_t pad : {int64_t{0}, int64_t{5}}) {
      const int64_t ldx = c.K + pad, ldy = c.N + pad;
      const std::vector<bf16_t> x = testing::random_bf16(static_cast<size_t>(c.M * ldx), ++seed);
      const std::vector<bf16_t> w = testing::random_bf16(static_cast<size_t>(c.N * c.K), ++seed);
      std::vector<bf16_t> packed(static_cast<size_t>(kg::bf16_vnni_size(c.K, c.N)));
      kg::pack_bf16_vnni(w.data(), c.K, c.N, packed.data());
      // Chunks of 16 inputs (one chunk where K <= 32), or of about half of K (the last one shorter where
      // K is not twice a multiple of 16).
      const int64_t chunk = pad == 0 ? (c.K > 32 ? 16 : 0) : std::max<int64_t>(16, c.K / 32 * 16);
      std::vector<float> want(static_cast<size_t>(c.M * ldy), -7.0f), y = want;
      kg::gemm_bf16_vnni_reference(x.data(), c.M, ldx, packed.data(), c.K, c.N, want.data(), ldy, chunk);
      kg::gemm_bf16_vnni(x.data(), c.M, ldx, packed.data(), c.K, c.N, y.data(), ldy, chunk);
      const std::string at = "M " + std::to_string(c.M) + " K " + std::to_string(c.K) + " N " +
                             std::to_string(c.N) + " pad " + std::to_string(pad) + " chunk " +
                             std::to_string(chunk);
      EXPECT_EQ(differing(y, want, c.M, c.N, ldy), 0) << at;
      for (int64_t m = 0; m < c.M; ++m)  // the stride's gap untouched
        for (int64_t n = c.N; n < ldy; ++n) ASSERT_EQ(y[m * ldy + n], -7.0f) << at;
      // bf16 out: the fp32 sums rounded to nearest even.
      std::vector<bf16_t> yb(static_cast<size_t>(c.M * ldy), bf16_t{0x1234}), wantb = yb;
      for (int64_t m = 0; m < c.M; ++m)
        for (int64_t n = 0; n < c.N; ++n) wantb[m * ldy + n] = f32_to_bf16(want[m * ldy + n]);
      kg::gemm_bf16_vnni(x.data(), c.M, ldx, packed.data(), c.K, c.N, yb.data(), ldy, chunk);
      EXPECT_EQ(differing(yb, wantb, c.M, ldy, ldy), 0) << at << " (bf16 out)";
    }
  }
}

TEST(Bf16Vnni, TheReferenceAddsTheOddInputFirstAndTakesDenormalsAsZero) {
  // One output channel, K = 16: pair 0 makes the sum 1; pair 1's products are -1 (even input) and
  // t = 1.5 * 2^-24 (odd). Odd first: 1 + t rounds to 1 + 2^-23, minus 1 leaves 2^-23. Even first: 1 - 1 = 0,
  // then t. The orders differ, and vdpbf16ps adds the odd product first.
  const float t = 1.5f * 0x1p-24f;
  std::vector<bf16_t> w(16 * 64, bf16_t{0}), x(16, bf16_t{0});
  w[0] = f32_to_bf16(1.0f);
  w[128] = f32_to_bf16(-1.0f);
  w[129] = f32_to_bf16(t);
  x[0] = x[2] = x[3] = f32_to_bf16(1.0f);
  float y = 0.0f;
  kg::gemm_bf16_vnni_reference(x.data(), 1, 16, w.data(), 16, 1, &y, 1, 0);
  EXPECT_EQ(bits(y), bits(0x1p-23f));
  if (kg::cpu_has_bf16_vnni()) {
    float yk = 0.0f;
    kg::gemm_bf16_vnni(x.data(), 1, 16, w.data(), 16, 1, &yk, 1, 0);
    EXPECT_EQ(bits(yk), bits(y)) << "this CPU's vdpbf16ps sums a pair in another order";
  }
  // A denormal input counts as zero, whatever it meets.
  x[3] = 0x0001;  // the smallest denormal bf16
  w[129] = f32_to_bf16(0x1p100f);
  kg::gemm_bf16_vnni_reference(x.data(), 1, 16, w.data(), 16, 1, &y, 1, 0);
  EXPECT_EQ(y, 0.0f);
}

TEST(Bf16Vnni, RefusesBadArgumentsBeforeWriting) {
  SKIP_WITHOUT_BF16();
  std::vector<bf16_t> x(64 * 64, bf16_t{0}), w(64 * 64, bf16_t{0});
  std::vector<float> y(64, 3.0f);
  EXPECT_THROW(kg::gemm_bf16_vnni(x.data(), 1, 24, w.data(), 24, 8, y.data(), 8, 0), std::invalid_argument);
  EXPECT_THROW(kg::gemm_bf16_vnni(x.data(), 1, 8, w.data(), 16, 8, y.data(), 8, 0), std::invalid_argument);
  EXPECT_THROW(kg::gemm_bf16_vnni(x.data(), 1, 16, w.data(), 16, 8, y.data(), 4, 0), std::invalid_argument);
  EXPECT_THROW(kg::gemm_bf16_vnni(x.data(), -1, 16, w.data(), 16, 8, y.data(), 8, 0), std::invalid_argument);
  EXPECT_THROW(kg::gemm_bf16_vnni(x.data(), 1, 16, w.data(), 16, 0, y.data(), 8, 0), std::invalid_argument);
  EXPECT_THROW(kg::gemm_bf16_vnni(x.data(), 1, 32, w.data(), 32, 8, y.data(), 8, 24), std::invalid_argument);
  for (float v : y) EXPECT_EQ(v, 3.0f);
}

// oneDNN's bf16 matmul y[M, N] = x W^T with W [N, K] reordered into the layout its matmul picks (as
// layers::Linear does); `layout` gets W in that layout, the test checks it is the kernel's.
struct OneDnn {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{eng};
  dnnl::memory w;
  int64_t K, N;
  OneDnn(const std::vector<bf16_t>& wt, int64_t k, int64_t n) : K(k), N(n) {
    using dnnl::memory;
    const memory::desc any({K, N}, memory::data_type::bf16, memory::format_tag::any);
    const memory::desc src({256, K}, memory::data_type::bf16, memory::format_tag::ab);
    const memory::desc dst({256, N}, memory::data_type::f32, memory::format_tag::ab);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, any, dst), eng);
    w = memory(pd.weights_desc(), eng);
    // W^T as oneDNN's {K, N} with N-major strides: element (k, n) at n * K + k, W's own layout.
    memory plain({{K, N}, memory::data_type::bf16, memory::dims{1, K}}, eng, const_cast<bf16_t*>(wt.data()));
    dnnl::reorder(plain, w).execute(stream, plain, w);
    stream.wait();
  }
  void run(const std::vector<bf16_t>& x, int64_t M, std::vector<float>& y) {
    using dnnl::memory;
    const memory::desc src({M, K}, memory::data_type::bf16, memory::format_tag::ab);
    const memory::desc wd({K, N}, memory::data_type::bf16, memory::format_tag::any);
    const memory::desc dst({M, N}, memory::data_type::f32, memory::format_tag::ab);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, wd, dst), eng);
    if (pd.weights_desc() != w.get_desc())
      throw std::runtime_error("oneDNN picked another layout for M rows");
    memory xs(src, eng, const_cast<bf16_t*>(x.data())), ys(dst, eng, y.data());
    dnnl::matmul(pd).execute(stream, {{DNNL_ARG_SRC, xs}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, ys}});
    stream.wait();
  }
};

TEST(Bf16Vnni, EqualsOneDnnsMatmulBitForBitAtEveryRowCount) {
  SKIP_WITHOUT_BF16();
  struct Shape {
    int64_t K, N;
  };
  if (layers::onednn_bf16_uses_amx()) GTEST_SKIP() << "oneDNN multiplies with AMX tiles here";
  // The model's projection shapes, inputs that end in a short chunk (576, 1152), and outputs that end in a
  // part of the layout's 64-column block (the LM head's blocks: the probe reorders that block on its own).
  const Shape shapes[] = {{2304, 4096}, {2304, 2048}, {1024, 2304}, {4096, 2304}, {2304, 576}, {128, 4096},
                          {576, 256},   {1152, 64},   {9216, 128},  {2304, 1000}, {576, 40}};
  uint64_t seed = 100;
  for (const Shape& s : shapes) {
    const int64_t chunk = layers::onednn_bf16_k_chunk(s.K, s.N);
    ASSERT_GE(chunk, 0) << "no chunk of inputs gives oneDNN's bits at K " << s.K;
    const std::vector<bf16_t> wt = testing::random_bf16(static_cast<size_t>(s.N * s.K), ++seed);
    OneDnn dnn(wt, s.K, s.N);
    // The layout the kernel reads: oneDNN's reordered W equals pack_bf16_vnni's.
    std::vector<bf16_t> packed(static_cast<size_t>(kg::bf16_vnni_size(s.K, s.N)));
    kg::pack_bf16_vnni(wt.data(), s.K, s.N, packed.data());
    ASSERT_EQ(dnn.w.get_desc().get_size(), packed.size() * sizeof(bf16_t)) << "oneDNN's layout for K " << s.K;
    ASSERT_EQ(std::memcmp(dnn.w.get_data_handle(), packed.data(), packed.size() * sizeof(bf16_t)), 0)
        << "oneDNN's layout for K " << s.K << ", N " << s.N << " is not the kernel's";
    for (const int64_t M : {1, 2, 5, 16, 33, 64, 300}) {
      const std::vector<bf16_t> x = testing::random_bf16(static_cast<size_t>(M * s.K), ++seed);
      std::vector<float> want(static_cast<size_t>(M * s.N)), y(want.size());
      dnn.run(x, M, want);
      kg::gemm_bf16_vnni(x.data(), M, s.K, packed.data(), s.K, s.N, y.data(), s.N, chunk);
      EXPECT_EQ(differing(y, want, M, s.N, s.N), 0)
          << "K " << s.K << " N " << s.N << " M " << M << " chunk " << chunk;
    }
  }
}

}  // namespace
}  // namespace kda
