// The ceilings that `kda bench` measures its rows against, in the same process: oneDNN GEMM rates
// (through the layer's own Linear, and as a plain call), memcpy and read bandwidth, the cores' FMA peak.
#pragma once

#include <cstddef>
#include <cstdint>
#include <dnnl.hpp>
#include <vector>

#include "kda/bench/inputs.h"
#include "kda/common/precision.h"
#include "kda/common/weight_buffer.h"
#include "kda/common/weights.h"
#include "kda/layers/linear.h"

namespace kda::bench {

// The GEMM ceiling: oneDNN matmul at M x N x K through the same Linear the layer uses.
struct GemmCeiling {
  int64_t M, N, K;
  layers::Linear lin;
  std::vector<float> x, y;
  GemmCeiling(Precision p, int64_t m, int64_t n, int64_t k)
      : M(m),
        N(n),
        K(k),
        lin(k, n, bench_randn(static_cast<size_t>(n * k), 1, 0.02f), p, Weights::BF16,
            p == Precision::BF16 ? layers::Bf16Gemm::OneDnn : layers::Bf16Gemm::Auto),
        x(bench_randn(m * k, 2)),
        y(m * n) {
    if (p == Precision::BF16) round_bf16_inplace(x.data(), x.size());
  }
  void run() { lin.forward(x.data(), M, y.data()); }
  double gflops(double seconds) const { return 2.0 * M * N * K / seconds / 1e9; }
};

// The same fp32 GEMM as one plain oneDNN matmul call on row-major operands (W^T as stored), which repacks
// W on every call as a BLAS sgemm call does: the rate the yardstick was first quoted at. Shown
// for reference; the kernels are held to the higher pre-packed rate above.
struct PlainGemm {
  int64_t M, N, K;
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  std::vector<float> x, w, y;
  dnnl::memory xm, wm, ym;
  dnnl::matmul mm;
  PlainGemm(int64_t m, int64_t n, int64_t k)
      : M(m), N(n), K(k), x(bench_randn(m * k, 2)), w(bench_randn(n * k, 1, 0.02f)), y(m * n) {
    using dnnl::memory;
    const memory::desc xd({M, K}, memory::data_type::f32, memory::dims{K, 1});
    const memory::desc wd({K, N}, memory::data_type::f32, memory::dims{1, K});
    const memory::desc yd({M, N}, memory::data_type::f32, memory::dims{N, 1});
    mm = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(xd, wd, yd), eng));
    xm = memory(xd, eng, x.data());
    wm = memory(wd, eng, w.data());
    ym = memory(yd, eng, y.data());
  }
  void run() {
    mm.execute(strm, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym}});
    strm.wait();
  }
  double gflops(double seconds) const { return 2.0 * M * N * K / seconds / 1e9; }
};

// Bytes read + written per second by memcpy over `bytes` (both directions counted, as the state
// bandwidth of the recurrent kernel counts the state read and written once), on all OpenMP threads.
double copy_gbps(size_t bytes);

// Read bandwidth: every thread sums its part of a buffer larger than the caches (the weights of a decode
// step are read, not written) into independent vector accumulators (one accumulator over one stream reads
// well below what the decode kernels stream). The buffer is in huge pages where the OS gives them, as the
// weights are (allocate_weights): on 4 KiB pages the same loops read below what the kernels stream from
// the weights. The runs alternate two read patterns, 4 streams per thread in lockstep and one stream, so
// that a caller's best over its runs is the better of the two on this host (which is better differs
// between hosts: docs/performance.md, "The read ceiling on huge pages"). Timed by the caller, in turns with
// what it bounds.
struct ReadBandwidth {
  WeightBuffer buf;
  size_t n = 0;  // floats
  float sink = 0.0f;
  int64_t runs = 0;
  explicit ReadBandwidth(size_t bytes);
  void run();
  double gbps(double seconds) const { return static_cast<double>(n * sizeof(float)) / seconds / 1e9; }
};

// The cores' fp32 multiply-add peak: every thread runs independent chains of 16-wide FMAs on registers
// for ~0.3 s. It tells which kind of host a run landed on: this VM has been seen on hosts that retire
// two 512-bit FMAs per cycle and on hosts that retire one (the same code then runs at half the rate),
// so absolute times only compare between runs on the same kind.
// Compiled for AVX-512 (the target attribute, not the build's flags) and run only where the CPU has it.
// NaN where the CPU has no AVX-512 (not measured).
double fma_peak_gflops();

}  // namespace kda::bench
