// A projection's call as fp32 rows, for the kernels that take fp32 x and y (the bf16 GEMM, the int8 /
// int4 ones): bf16 x widened exactly; fp32 x rounded to bf16 first where round_x (the bf16 precision's
// rounding point of a layer input), or taken as it is; a bf16 y computed into fp32 scratch and rounded
// to nearest even as it is stored. The scratch is the calling thread's, shared by every projection it
// calls: a model holds thousands of projections (a MoE layer's experts), and scratch per object would
// keep each one's largest call resident.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/common/parallel_spans.h"

namespace kda::layers {

class Fp32Rows {
 public:
  Fp32Rows(int64_t in_features, int64_t out_features) : in_(in_features), out_(out_features) {}

  // The calling thread's scratch grown to a call of M rows (both views converted) and touched.
  void reserve(int64_t M) const {
    std::vector<float>& xs = scratch(0);
    std::vector<float>& ys = scratch(1);
    if (static_cast<int64_t>(xs.size()) < M * in_) xs.resize(static_cast<size_t>(M * in_));
    if (static_cast<int64_t>(ys.size()) < M * out_) ys.resize(static_cast<size_t>(M * out_));
  }

  // Calls run(xf, ldxf, yf, ldyf) with the fp32 views of x [M, ldx] and y [M, ldy].
  template <class X, class Y, class Run>
  void with(const X* x, int64_t M, int64_t ldx, Y* y, int64_t ldy, bool round_x, Run run) {
    const float* xf = x_rows(x, M, ldx, round_x);
    const int64_t ldxf = static_cast<const void*>(xf) == static_cast<const void*>(x) ? ldx : in_;
    if constexpr (std::is_same_v<Y, bf16_t>) {
      std::vector<float>& ys = scratch(1);
      ys.resize(static_cast<size_t>(M * out_));
      run(xf, ldxf, ys.data(), out_);
      const float* yf = ys.data();
      parallel_spans(M, out_, [&](int64_t i, int64_t c0, int64_t c1) {
        f32_to_bf16_array(yf + i * out_ + c0, y + i * ldy + c0, static_cast<size_t>(c1 - c0));
      });
    } else {
      run(xf, ldxf, y, ldy);
    }
  }

 private:
  static std::vector<float>& scratch(int which) {
    thread_local std::vector<float> xf, yf;
    return which == 0 ? xf : yf;
  }
  const float* x_rows(const bf16_t* x, int64_t M, int64_t ldx, bool) {
    std::vector<float>& xs = scratch(0);
    xs.resize(static_cast<size_t>(M * in_));
    float* xf = xs.data();
    parallel_spans(M, in_, [&](int64_t i, int64_t c0, int64_t c1) {
      bf16_to_f32_array(x + i * ldx + c0, xf + i * in_ + c0, static_cast<size_t>(c1 - c0));
    });
    return xs.data();
  }
  const float* x_rows(const float* x, int64_t M, int64_t ldx, bool round_x) {
    if (!round_x) return x;
    std::vector<float>& xs = scratch(0);
    xs.resize(static_cast<size_t>(M * in_));
    float* xf = xs.data();
    parallel_spans(M, in_, [&](int64_t i, int64_t c0, int64_t c1) {
      const float* xr = x + i * ldx;
      float* o = xf + i * in_;
      for (int64_t k = c0; k < c1; ++k) o[k] = round_bf16(xr[k]);
    });
    return xs.data();
  }
  int64_t in_ = 0, out_ = 0;
};

}  // namespace kda::layers
