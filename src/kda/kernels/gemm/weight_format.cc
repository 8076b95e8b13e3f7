// The table of weight formats, the GEMM entry points that read it and the reference.
#include "kda/kernels/gemm/weight_format.h"

#include <cstring>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/bf16_gemm.h"
#include "kda/kernels/gemm/bf16_gemm_isa.h"
#include "kda/kernels/gemm/quant_amx.h"
#include "kda/kernels/gemm/quant_gemm.h"
#include "kda/kernels/gemm/quant_gemm_isa.h"

namespace kda::kernels::gemm {
namespace {

Bf16Weights bf16_of(const PackedWeights& w) { return {static_cast<const bf16_t*>(w.data), w.in, w.out}; }
Int8Weights int8_of(const PackedWeights& w) {
  return {static_cast<const int8_t*>(w.data), w.scale, w.in, w.out};
}
Int4Weights int4_of(const PackedWeights& w) {
  return {static_cast<const uint8_t*>(w.data), w.scale, w.in, w.out};
}

// The table's functions per format.
int64_t bf16_bytes(int64_t in, int64_t out) { return 2 * packed_size(in, out); }
int64_t int8_bytes(int64_t in, int64_t out) { return in * out; }
int64_t int4_bytes(int64_t in, int64_t out) { return in / 2 * out; }
int64_t no_scales(int64_t, int64_t) { return 0; }
int64_t int8_scales(int64_t, int64_t out) { return out; }
int64_t int4_scales(int64_t in, int64_t out) { return in / kInt4Group * out; }
int64_t whole_row(int64_t in) { return in; }
int64_t int4_run(int64_t) { return kInt4Group; }
int int4_qmax(int64_t) { return kInt4ActivationMax; }

void bf16_pack(const float* w, int64_t in, int64_t out, uint8_t* data, float*) {
  std::vector<bf16_t> plain(static_cast<size_t>(in * out));
  f32_to_bf16_array(w, plain.data(), plain.size());
  pack(plain.data(), in, out, reinterpret_cast<bf16_t*>(data));
}
void int8_pack(const float* w, int64_t in, int64_t out, uint8_t* data, float* scale) {
  quantize_int8(w, in, out, reinterpret_cast<int8_t*>(data), scale);
}
void int4_pack(const float* w, int64_t in, int64_t out, uint8_t* data, float* scale) {
  quantize_int4(w, in, out, data, scale);
}

void bf16_rows(const PackedWeights& w, int64_t n0, int64_t n1, float* out) {
  widen_rows(bf16_of(w), n0, n1, out);
}
void int8_rows(const PackedWeights& w, int64_t n0, int64_t n1, float* out) {
  dequantize_int8_rows(int8_of(w), n0, n1, out);
}
void int4_rows(const PackedWeights& w, int64_t n0, int64_t n1, float* out) {
  dequantize_int4_rows(int4_of(w), n0, n1, out);
}

// One ISA copy's kernels behind the table's signature.
template <void (*K)(const float*, int64_t, int64_t, const Bf16Weights&, float*, int64_t)>
void bf16_kernel(const Activations& a, int64_t M, const PackedWeights& w, float* y, int64_t ldy) {
  K(a.x, M, a.ldx, bf16_of(w), y, ldy);
}
template <void (*K)(const int16_t*, const float*, int64_t, const Int8Weights&, float*, int64_t, bool),
          bool kVnni>
void int8_kernel(const Activations& a, int64_t M, const PackedWeights& w, float* y, int64_t ldy) {
  K(a.xq, a.sx, M, int8_of(w), y, ldy, kVnni && cpu_has_vnni());
}
template <void (*K)(const int16_t*, const float*, int64_t, const Int4Weights&, float*, int64_t, bool),
          bool kVnni>
void int4_kernel(const Activations& a, int64_t M, const PackedWeights& w, float* y, int64_t ldy) {
  K(a.xq, a.sx, M, int4_of(w), y, ldy, kVnni && cpu_has_vnni());
}

#if defined(KDA_WITH_AVX512)
// The AVX-512 copy's quantized kernels: the AMX tiles where the CPU has them (quant_amx.h) from their row
// counts on, else VNNI or AVX-512BW. int8's give the same bits either way; int4's differ in fp32
// summation order.
void int8_avx512(const Activations& a, int64_t M, const PackedWeights& w, float* y, int64_t ldy) {
  const Int8Weights q = int8_of(w);
  if (M >= kAmxMinRowsInt8 && cpu_has_amx_int8() && amx_takes(q))
    return gemm_int8_amx(a.xq, a.sx, M, q, y, ldy);
  avx512::gemm_int8(a.xq, a.sx, M, q, y, ldy, cpu_has_vnni());
}
void int4_avx512(const Activations& a, int64_t M, const PackedWeights& w, float* y, int64_t ldy) {
  if (M >= kAmxMinRowsInt4 && cpu_has_amx_int8() && cpu_has_amx_bf16())
    return gemm_int4_amx(a.xq, a.sx, M, int4_of(w), y, ldy);
  avx512::gemm_int4(a.xq, a.sx, M, int4_of(w), y, ldy, cpu_has_vnni());
}
#endif

// Each ISA's copies, where the build has them (require_isa() refuses the others before the table is
// read). VNNI is the AVX-512 copy's choice, made per CPU.
struct IsaKernels {
  GemmKernel bf16 = nullptr, int8 = nullptr, int4 = nullptr;
};
constexpr IsaKernels kPortable{bf16_kernel<portable::gemm_bf16>, int8_kernel<portable::gemm_int8, false>,
                               int4_kernel<portable::gemm_int4, false>};
#if defined(KDA_WITH_AVX2)
constexpr IsaKernels kAvx2{bf16_kernel<avx2::gemm_bf16>, int8_kernel<avx2::gemm_int8, false>,
                           int4_kernel<avx2::gemm_int4, false>};
#else
constexpr IsaKernels kAvx2{};
#endif
#if defined(KDA_WITH_AVX512)
constexpr IsaKernels kAvx512{bf16_kernel<avx512::gemm_bf16>, int8_avx512, int4_avx512};
#else
constexpr IsaKernels kAvx512{};
#endif

// Indexed by Weights.
constexpr WeightFormat kFormats[] = {
    {Weights::BF16,
     "bf16",
     1,
     nullptr,
     nullptr,
     bf16_bytes,
     no_scales,
     bf16_pack,
     bf16_rows,
     {kPortable.bf16, kAvx2.bf16, kAvx512.bf16}},
    {Weights::Int8,
     "int8",
     1,
     whole_row,
     activation_qmax,
     int8_bytes,
     int8_scales,
     int8_pack,
     int8_rows,
     {kPortable.int8, kAvx2.int8, kAvx512.int8}},
    {Weights::Int4,
     "int4",
     kInt4Group,
     int4_run,
     int4_qmax,
     int4_bytes,
     int4_scales,
     int4_pack,
     int4_rows,
     {kPortable.int4, kAvx2.int4, kAvx512.int4}},
};

static_assert(std::size(kFormats) == 3 && kFormats[0].format == Weights::BF16 &&
              kFormats[1].format == Weights::Int8 && kFormats[2].format == Weights::Int4);

void check_shape(const WeightFormat& f, int64_t in, int64_t out) {
  if (in <= 0 || out <= 0)
    throw std::invalid_argument(std::string(f.name) + " weights: features must be positive");
  if (in % f.in_multiple != 0)
    throw std::invalid_argument(std::string(f.name) + " weights: the input size " + std::to_string(in) +
                                " is not a multiple of the group size " + std::to_string(f.in_multiple));
}

void check_call(const WeightFormat& f, const float* x, int64_t M, int64_t ldx, const PackedWeights& w,
                const float* y, int64_t ldy) {
  if (w.in <= 0 || w.out <= 0 || w.data == nullptr || (f.activation_run && w.scale == nullptr))
    throw std::invalid_argument(std::string(f.name) + " gemm: empty weights");
  check_shape(f, w.in, w.out);
  if (M < 0 || ldx < w.in || ldy < w.out)
    throw std::invalid_argument(std::string(f.name) + " gemm: bad M or row strides");
  if (M > 0 && (x == nullptr || y == nullptr))
    throw std::invalid_argument(std::string(f.name) + " gemm: null x or y");
}

// x quantized into contiguous [M, in] rows, as the kernels take it: one scale per run of `run` inputs
// (the row, or a group of 32), into q and s.
void quantize_x(const WeightFormat& f, const float* x, int64_t M, int64_t ldx, int64_t in,
                std::vector<int16_t>& q, std::vector<float>& s) {
  const int64_t run = f.activation_run(in), R = in / run;
  const int qmax = f.activation_qmax(in);
  q.resize(static_cast<size_t>(M * in));
  s.resize(static_cast<size_t>(M * R));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r)
      s[m * R + r] = quantize_activations(x + m * ldx + r * run, run, qmax, q.data() + m * in + r * run);
}

}  // namespace

const WeightFormat& weight_format(Weights w) {
  const auto i = static_cast<size_t>(w);
  if (i >= std::size(kFormats)) throw std::invalid_argument("unknown weight format");
  return kFormats[i];
}

PackedMatrix::PackedMatrix(Weights format, const float* w, int64_t in, int64_t out) {
  const WeightFormat& f = weight_format(format);
  check_shape(f, in, out);
  if (w == nullptr) throw std::invalid_argument(std::string(f.name) + " weights: no values");
  data_ = allocate_weights(static_cast<size_t>(f.data_bytes(in, out)));
  const auto scales = static_cast<size_t>(f.scale_count(in, out));
  if (scales > 0) scale_ = allocate_weights(sizeof(float) * scales);
  f.pack(w, in, out, static_cast<uint8_t*>(data_.get()), static_cast<float*>(scale_.get()));
  view_ = {format, nullptr, nullptr, in, out};
  point_at_own();
}

PackedMatrix::PackedMatrix(const PackedWeights& view, std::shared_ptr<const void> owner)
    : owner_(std::move(owner)), view_(view) {
  const WeightFormat& f = weight_format(view.format);
  check_shape(f, view.in, view.out);
  if (!owner_ || view.data == nullptr || (f.scale_count(view.in, view.out) > 0 && view.scale == nullptr))
    throw std::invalid_argument(std::string(f.name) +
                                " weights: a borrowed view needs its bytes and an owner");
}

PackedMatrix::PackedMatrix(const PackedMatrix& o) : owner_(o.owner_), view_(o.view_) {
  if (!owner_) {
    data_ = copy_of(o.data_, static_cast<size_t>(o.data_bytes()));
    scale_ = copy_of(o.scale_, sizeof(float) * static_cast<size_t>(o.scale_count()));
    point_at_own();
  }
}

WeightBuffer PackedMatrix::copy_of(const WeightBuffer& from, size_t n) {
  if (!from) return {};
  WeightBuffer b = allocate_weights(n);
  std::memcpy(b.get(), from.get(), n);
  return b;
}

PackedMatrix& PackedMatrix::operator=(const PackedMatrix& o) {
  if (this != &o) {
    data_ = o.owner_ ? WeightBuffer() : copy_of(o.data_, static_cast<size_t>(o.data_bytes()));
    scale_ =
        o.owner_ ? WeightBuffer() : copy_of(o.scale_, sizeof(float) * static_cast<size_t>(o.scale_count()));
    owner_ = o.owner_;
    view_ = o.view_;
    if (!owner_) point_at_own();
  }
  return *this;
}

void PackedMatrix::point_at_own() {
  view_.data = static_cast<const uint8_t*>(data_.get());
  view_.scale = static_cast<const float*>(scale_.get());
}

int64_t PackedMatrix::data_bytes() const {
  return weight_format(view_.format).data_bytes(view_.in, view_.out);
}
int64_t PackedMatrix::scale_count() const {
  return weight_format(view_.format).scale_count(view_.in, view_.out);
}

void dequantize_rows(const PackedWeights& w, int64_t n0, int64_t n1, float* out) {
  weight_format(w.format).dequantize_rows(w, n0, n1, out);
}

std::vector<float> dequantize(const PackedWeights& w) {
  std::vector<float> out(static_cast<size_t>(w.in * w.out));
  dequantize_rows(w, 0, w.out, out.data());
  return out;
}

void gemm(const float* x, int64_t M, int64_t ldx, const PackedWeights& w, float* y, int64_t ldy, Isa isa) {
  const WeightFormat& f = weight_format(w.format);
  check_call(f, x, M, ldx, w, y, ldy);
  require_isa(isa);
  if (M == 0) return;
  Activations a{x, ldx, nullptr, nullptr};
  if (f.activation_run) {
    // Per-thread scratch: a call from the serving loop does not allocate (nor fault in fresh pages)
    // every time.
    thread_local std::vector<int16_t> xq;
    thread_local std::vector<float> sx;
    quantize_x(f, x, M, ldx, w.in, xq, sx);
    a.xq = xq.data();
    a.sx = sx.data();
  }
  f.gemm[static_cast<int>(isa)](a, M, w, y, ldy);
}

void gemm(const float* x, int64_t M, int64_t ldx, const PackedWeights& w, float* y, int64_t ldy) {
  gemm(x, M, ldx, w, y, ldy, best_isa());
}

bool gemm_runs_amx(Weights format, int64_t in) {
#if defined(KDA_WITH_AVX512)
  if (best_isa() != Isa::Avx512 || !cpu_has_amx_int8()) return false;
  if (format == Weights::Int8) return amx_takes(Int8Weights{nullptr, nullptr, in, 1});
  return format == Weights::Int4 && cpu_has_amx_bf16();
#else
  (void)format;
  (void)in;
  return false;
#endif
}

void gemm_reference(const float* x, int64_t M, int64_t ldx, const PackedWeights& w, float* y, int64_t ldy) {
  const WeightFormat& f = weight_format(w.format);
  check_call(f, x, M, ldx, w, y, ldy);
  if (M == 0) return;
  const std::vector<float> wf = dequantize(w);
  std::vector<float> xd(static_cast<size_t>(M * w.in));
  if (f.activation_run) {
    std::vector<int16_t> q;
    std::vector<float> s;
    quantize_x(f, x, M, ldx, w.in, q, s);
    const int64_t run = f.activation_run(w.in), R = w.in / run;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < w.in; ++k)
        xd[m * w.in + k] = static_cast<float>(q[m * w.in + k]) * s[m * R + k / run];
  } else {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < w.in; ++k) xd[m * w.in + k] = x[m * ldx + k];
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < w.out; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < w.in; ++k) acc += xd[m * w.in + k] * wf[n * w.in + k];
      y[m * ldy + n] = acc;
    }
}

}  // namespace kda::kernels::gemm
