#include "kda/layers/quant_linear.h"

#include <algorithm>
#include <cstring>
#include <dnnl.hpp>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kda/common/aligned_scratch.h"
#include "kda/common/isa.h"
#include "kda/kernels/gemm/quant_amx.h"
#include "kda/kernels/gemm/quant_dpbf16.h"
#include "kda/kernels/gemm/quant_tile.h"
#include "kda/kernels/gemm/weight_format.h"
#include "kda/layers/fp32_rows.h"
#include "kda/layers/matmul_cache.h"
#include "kda/layers/onednn_isa.h"

namespace kda::layers {

using dnnl::memory;
namespace qg = kda::kernels::gemm;

QuantLinear::Prefill QuantLinear::prefill_path_for(Weights weights, Precision precision) {
  if (precision != Precision::BF16 || !cpu_has_bf16_gemm()) return Prefill::Fp32Tiles;
  // Without AMX the project's kernels, at the bf16 rate on the scheme's integers (a layer whose input size
  // they do not take falls back: path_for below). With AMX-BF16 the project's kernels on tiles, the weights
  // widened to bf16 between the products (int8's q exactly, int4's with its scales; where the hi + lo tiles
  // double int4's depth on oneDNN's matmul, and oneDNN's tiles are widened per call: docs/performance.md,
  // "int4's prefill on AMX: weights widened to bf16", "int8's prefill on the widened AMX tiles").
  if (!onednn_bf16_uses_amx() && qg::cpu_has_quant_dpbf16()) return Prefill::Dpbf16;
  if (weights != Weights::BF16 && qg::cpu_has_amx_bf16()) return Prefill::AmxBf16;
  return Prefill::Bf16Tiles;
}

namespace {

// The decode rows of the paths whose kernels take over from the packed ones early (0: none of those).
int64_t early_decode_rows(QuantLinear::Prefill p, Weights weights) {
  if (p == QuantLinear::Prefill::AmxBf16)
    return weights == Weights::Int8 ? QuantLinear::kAmxDecodeRowsInt8 : QuantLinear::kAmxBf16DecodeRowsInt4;
  if (p != QuantLinear::Prefill::Dpbf16) return 0;
  return weights == Weights::Int8 ? QuantLinear::kDpbf16DecodeRowsInt8 : QuantLinear::kDpbf16DecodeRowsInt4;
}

// prefill_path_for, where the dpbf16 or amx bf16 kernels take the input size (a multiple of 32; int4's
// always is); else int8's bf16 tiles (what that CPU has without them) and int4's fp32 tiles.
QuantLinear::Prefill path_for(Weights weights, Precision precision, int64_t in) {
  const QuantLinear::Prefill p = QuantLinear::prefill_path_for(weights, precision);
  if ((p != QuantLinear::Prefill::Dpbf16 && p != QuantLinear::Prefill::AmxBf16) || in % 32 == 0) return p;
  return weights == Weights::Int8 ? QuantLinear::Prefill::Bf16Tiles : QuantLinear::Prefill::Fp32Tiles;
}

}  // namespace

int64_t QuantLinear::decode_rows_for(Weights weights, Precision precision, int64_t in) {
  if (const int64_t early = early_decode_rows(path_for(weights, precision, in), weights)) return early;
  if (weights == Weights::Int8 && precision == Precision::BF16 && qg::gemm_runs_amx(weights, in))
    return kAmxDecodeRowsInt8;
  return kDecodeRows;
}

namespace {

// The calling thread's scratch, shared by every QuantLinear it calls: the fp32 path's dequantized tile;
// the bf16 paths' input rows, weight tile and fp32 output.
struct QuantScratch {
  std::vector<float> tile_f32, y_f32;
  std::vector<bf16_t> x_bf16, tile_bf16;
};
QuantScratch& quant_scratch() {
  thread_local QuantScratch s;
  return s;
}
}  // namespace

struct QuantLinear::Impl {
  Impl(Weights weights, const std::vector<float>& w, int64_t in, int64_t out)
      : packed(weights, w.data(), in, out), rows(in, out) {}
  explicit Impl(const qg::PackedMatrix& p) : packed(p), rows(p.view().in, p.view().out) {}
  qg::PackedMatrix packed;
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  mutable dnnl::stream stream{engine};
  // The prefill path's fp32 matmuls, one per (M, tile width, ldx, ldy).
  mutable MatmulCache prims{kMaxPrimitives};
  // A call's x and y as fp32 rows (the calling thread's scratch, as the dequantized tile below).
  Fp32Rows rows;
  mutable std::mutex mu;
};

QuantLinear::QuantLinear(int64_t in_features, int64_t out_features, const std::vector<float>& weight,
                         Weights weights, Precision precision)
    : in_(in_features), out_(out_features), weights_(weights), precision_(precision) {
  if (weights != Weights::Int8 && weights != Weights::Int4)
    throw std::invalid_argument("QuantLinear: weights must be int8 or int4");
  if (in_ <= 0 || out_ <= 0) throw std::invalid_argument("QuantLinear: features must be positive");
  if (static_cast<int64_t>(weight.size()) != in_ * out_)
    throw std::invalid_argument("QuantLinear: weight has " + std::to_string(weight.size()) +
                                " values, expected " + std::to_string(out_) + " x " + std::to_string(in_));
  impl_ = std::make_unique<Impl>(weights, weight, in_, out_);
  prefill_ = path_for(weights, precision, in_);
  decode_rows_ = decode_rows_for(weights, precision, in_);
}

QuantLinear::QuantLinear(int64_t in_features, int64_t out_features, const std::vector<float>& weight,
                         Weights weights, Precision precision, Prefill prefill)
    : QuantLinear((prefill != Prefill::Fp32Tiles && precision != Precision::BF16)
                      ? throw std::invalid_argument(std::string("QuantLinear: the ") + to_string(prefill) +
                                                    " path needs the bf16 precision")
                      : in_features,
                  out_features, weight, weights, precision) {
  if (prefill == Prefill::Dpbf16 && (in_features % 32 != 0 || !qg::cpu_has_quant_dpbf16()))
    throw std::invalid_argument(
        in_features % 32 != 0 ? "QuantLinear: the dpbf16 path needs an input size that is a multiple of 32"
                              : "QuantLinear: the dpbf16 path needs a CPU with AVX512_BF16");
  if (prefill == Prefill::AmxBf16 && (in_features % 32 != 0 || !qg::cpu_has_amx_bf16()))
    throw std::invalid_argument(
        in_features % 32 != 0 ? "QuantLinear: the amx bf16 path needs an input size that is a multiple of 32"
                              : "QuantLinear: the amx bf16 path needs AMX-BF16");
  prefill_ = prefill;
  const int64_t early = early_decode_rows(prefill, weights);
  decode_rows_ = early > 0 ? early : kDecodeRows;
}

QuantLinear::QuantLinear(const qg::PackedMatrix& packed, Precision precision)
    : in_(packed.view().in), out_(packed.view().out), weights_(packed.view().format), precision_(precision) {
  if (weights_ != Weights::Int8 && weights_ != Weights::Int4)
    throw std::invalid_argument("QuantLinear: packed weights must be int8 or int4");
  impl_ = std::make_unique<Impl>(packed);
  prefill_ = path_for(weights_, precision, in_);
  decode_rows_ = decode_rows_for(weights_, precision, in_);
}

QuantLinear::~QuantLinear() = default;
QuantLinear::QuantLinear(QuantLinear&&) noexcept = default;
QuantLinear& QuantLinear::operator=(QuantLinear&&) noexcept = default;

int64_t QuantLinear::weight_bytes() const { return impl_->packed.bytes(); }

const qg::PackedMatrix& QuantLinear::packed() const { return impl_->packed; }

std::vector<float> QuantLinear::dequantized() const { return qg::dequantize(impl_->packed.view()); }

std::vector<float> QuantLinear::dequantized(int64_t M) const {
  std::vector<float> w = dequantized();
  if (prefill_ == Prefill::AmxBf16 && weights_ == Weights::Int4 && M > decode_rows() &&
      M >= qg::kAmxBf16WidenedRows)
    for (float& v : w) v = bf16_to_f32(qg::int4_widened(v));
  return w;
}

template <class X, class Y>
void QuantLinear::forward_as(const X* x, int64_t M, int64_t ldx, Y* y, int64_t ldy) const {
  constexpr bool x16 = std::is_same_v<X, bf16_t>, y16 = std::is_same_v<Y, bf16_t>;
  if ((x16 || y16) && precision_ != Precision::BF16)
    throw std::invalid_argument("QuantLinear::forward: bf16 input or output for an fp32 projection");
  if (M < 0 || ldx < in_ || ldy < out_)
    throw std::invalid_argument("QuantLinear::forward: bad M or row strides");
  if (M == 0) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  const int64_t decode = decode_rows();
  if (M > decode && prefill_ == Prefill::Bf16Tiles) return prefill_bf16(x, M, ldx, y, ldy);
  if (M > decode && (prefill_ == Prefill::Dpbf16 || prefill_ == Prefill::AmxBf16))
    return prefill_dpbf16(x, M, ldx, y, ldy);
  // x and y as fp32 rows: fp32 x rounded to bf16 in the bf16 precision (its rounding point), as is in
  // the fp32 one.
  im.rows.with(x, M, ldx, y, ldy, precision_ == Precision::BF16,
               [&](const float* xf, int64_t ldxf, float* yf, int64_t ldyf) {
                 if (M <= decode) {
                   // kDecodeRows at a time: the AMX kernels' activations of a chunk stay in L2 while
                   // every block of W meets them (one pass over W per chunk; from 128 rows on, whole
                   // calls ran slower than chunks of 64).
                   for (int64_t m = 0; m < M; m += kDecodeRows)
                     qg::gemm(xf + m * ldxf, std::min(kDecodeRows, M - m), ldxf, im.packed.view(),
                              yf + m * ldyf, ldyf);
                 } else {
                   prefill(xf, M, ldxf, yf, ldyf);
                 }
               });
}

// Dequantized tiles of kTile output channels through oneDNN's fp32 matmul (W^T view of the tile's
// [nt, in] rows), each writing its columns of y. Caller holds the mutex.
void QuantLinear::prefill(const float* xf, int64_t M, int64_t ldxf, float* yf, int64_t ldyf) const {
  Impl& im = *impl_;
  // One dequantized weight tile: the calling thread's, shared by every QuantLinear it calls.
  float* tile = aligned(quant_scratch().tile_f32, kTile * in_);
  for (int64_t n0 = 0; n0 < out_; n0 += kTile) {
    const int64_t nt = std::min(kTile, out_ - n0);
    float* wt = tile;
    const int64_t in = in_;
    const qg::PackedWeights w = im.packed.view();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < nt; ++r) qg::dequantize_rows(w, n0 + r, n0 + r + 1, wt + r * in);
    const MatmulCache::Entry& p = im.prims.get({M, nt, ldxf, ldyf, false}, [&] {
      const memory::desc src_md({M, in_}, memory::data_type::f32, memory::dims{ldxf, 1});
      const memory::desc w_md({in_, nt}, memory::data_type::f32, memory::dims{1, in_});
      const memory::desc dst_md({M, nt}, memory::data_type::f32, memory::dims{ldyf, 1});
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, w_md, dst_md), im.engine);
      return MatmulCache::Entry{dnnl::matmul(pd), src_md, w_md, dst_md, {}};
    });
    memory src_m(p.src, im.engine, const_cast<float*>(xf));
    memory w_m(p.weights, im.engine, wt);
    memory dst_m(p.dst, im.engine, yf + n0);
    p.matmul.execute(im.stream, {{DNNL_ARG_SRC, src_m}, {DNNL_ARG_WEIGHTS, w_m}, {DNNL_ARG_DST, dst_m}});
    im.stream.wait();
  }
}

// x as dense bf16 rows ([x, x] for int4's hi, lo depth; fp32 x rounded to nearest even, the bf16
// precision's rounding point of a layer input), then per tile of kBf16Tile channels: the tile written in
// the blocked layout oneDNN's bf16 matmul reads (quant_tile.h; a reorder from a plain tile cost a good
// part of the matmul's own time), the matmul into dense fp32 scratch (a column slice of y as its
// destination took oneDNN 2.6 off its brgemm kernels), then stored into y's columns with int8's channel
// scales (a bf16 y rounded to nearest even as it is stored). Caller holds the mutex.
template <class X, class Y>
void QuantLinear::prefill_bf16(const X* x, int64_t M, int64_t ldx, Y* y, int64_t ldy) const {
  Impl& im = *impl_;
  const qg::PackedWeights w = im.packed.view();
  const int64_t in = in_, depth = qg::bf16_tile_depth(w), tile_n = std::min(kBf16Tile, out_);
  QuantScratch& s = quant_scratch();
  bf16_t* xb = aligned(s.x_bf16, M * depth);
  bf16_t* tile = aligned(s.tile_bf16, qg::bf16_blocked_tile_size(w, tile_n));
  float* yt = aligned(s.y_f32, M * tile_n);
#pragma omp parallel for schedule(static) if (M * in >= (int64_t{1} << 16))
  for (int64_t i = 0; i < M; ++i) {
    if constexpr (std::is_same_v<X, bf16_t>)
      std::memcpy(xb + i * depth, x + i * ldx, sizeof(bf16_t) * in);
    else
      f32_to_bf16_array(x + i * ldx, xb + i * depth, static_cast<size_t>(in));
    if (depth != in) std::memcpy(xb + i * depth + in, xb + i * depth, sizeof(bf16_t) * in);
  }
  for (int64_t n0 = 0; n0 < out_; n0 += kBf16Tile) {
    const int64_t nt = std::min(kBf16Tile, out_ - n0);
    qg::bf16_tile_blocked(w, n0, n0 + nt, tile);
    const MatmulCache::Entry& p = im.prims.get({M, nt, depth, nt, false}, [&] {
      const memory::desc src_md({M, depth}, memory::data_type::bf16, memory::dims{depth, 1});
      const memory::desc w_md({depth, nt}, memory::data_type::bf16, memory::format_tag::BA16a64b2a);
      const memory::desc dst_md({M, nt}, memory::data_type::f32, memory::dims{nt, 1});
      if (w_md.get_size() != static_cast<size_t>(qg::bf16_blocked_tile_size(w, nt)) * sizeof(bf16_t))
        throw std::runtime_error("QuantLinear: oneDNN's BA16a64b2a tile is not the size quant_tile.h writes");
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, w_md, dst_md), im.engine);
      return MatmulCache::Entry{dnnl::matmul(pd), src_md, w_md, dst_md, {}};
    });
    memory src_m(p.src, im.engine, xb);
    memory w_m(p.weights, im.engine, tile);
    memory dst_m(p.dst, im.engine, yt);
    p.matmul.execute(im.stream, {{DNNL_ARG_SRC, src_m}, {DNNL_ARG_WEIGHTS, w_m}, {DNNL_ARG_DST, dst_m}});
    im.stream.wait();
    const float* scale = w.format == Weights::Int8 ? w.scale + n0 : nullptr;
#pragma omp parallel for schedule(static) if (M * nt >= (int64_t{1} << 16))
    for (int64_t i = 0; i < M; i += 16)
      qg::scale_columns(yt + i * nt, nt, std::min<int64_t>(16, M - i), scale, nt, y + i * ldy + n0, ldy);
  }
}

// x as bf16 rows (fp32 x rounded to nearest even, the bf16 precision's rounding point of a layer input;
// bf16 x read in place), then the kernel into y, or into dense fp32 scratch rounded to nearest even into a
// bf16 y. Caller holds the mutex.
template <class X, class Y>
void QuantLinear::prefill_dpbf16(const X* x, int64_t M, int64_t ldx, Y* y, int64_t ldy) const {
  const qg::PackedWeights v = impl_->packed.view();
  const auto gemm = [&](const bf16_t* xb, int64_t ldxb, float* yf, int64_t ldyf) {
    const qg::Int4Weights w4{static_cast<const uint8_t*>(v.data), v.scale, v.in, v.out};
    const qg::Int8Weights w8{static_cast<const int8_t*>(v.data), v.scale, v.in, v.out};
    const bool i8 = v.format == Weights::Int8, amx = prefill_ == Prefill::AmxBf16;
    if (i8)
      (amx ? qg::gemm_int8_amx_bf16 : qg::gemm_int8_dpbf16)(xb, M, ldxb, w8, yf, ldyf);
    else
      (amx ? qg::gemm_int4_amx_bf16 : qg::gemm_int4_dpbf16)(xb, M, ldxb, w4, yf, ldyf);
  };
  std::vector<bf16_t>& xs = quant_scratch().x_bf16;
  std::vector<float>& ys = quant_scratch().y_f32;
  const bf16_t* xb = nullptr;
  int64_t ldxb = ldx;
  if constexpr (std::is_same_v<X, bf16_t>) {
    xb = x;
  } else {
    bf16_t* xr = aligned(xs, M * in_);
#pragma omp parallel for schedule(static) if (M * in_ >= (int64_t{1} << 16))
    for (int64_t i = 0; i < M; ++i) f32_to_bf16_array(x + i * ldx, xr + i * in_, static_cast<size_t>(in_));
    xb = xr;
    ldxb = in_;
  }
  if constexpr (std::is_same_v<Y, float>) {
    gemm(xb, ldxb, y, ldy);
  } else {
    float* yt = aligned(ys, M * out_);
    gemm(xb, ldxb, yt, out_);
#pragma omp parallel for schedule(static) if (M * out_ >= (int64_t{1} << 16))
    for (int64_t i = 0; i < M; i += 16)
      qg::scale_columns(yt + i * out_, out_, std::min<int64_t>(16, M - i), nullptr, out_, y + i * ldy, ldy);
  }
}

void QuantLinear::reserve(int64_t M) const {
  if (M <= 0) return;
  // The sizes the paths above take for M rows (aligned() adds a cache line): every path's rows of x and
  // y as fp32, then the one this projection's prefill takes.
  impl_->rows.reserve(M);
  QuantScratch& s = quant_scratch();
  if (M <= decode_rows()) return;
  const qg::PackedWeights w = impl_->packed.view();
  switch (prefill_) {
    case Prefill::Bf16Tiles: {
      const int64_t tile_n = std::min(kBf16Tile, out_);
      grow_aligned(s.x_bf16, M * qg::bf16_tile_depth(w));
      grow_aligned(s.tile_bf16, qg::bf16_blocked_tile_size(w, tile_n));
      grow_aligned(s.y_f32, M * tile_n);
      break;
    }
    case Prefill::Dpbf16:
    case Prefill::AmxBf16:
      grow_aligned(s.x_bf16, M * in_);
      grow_aligned(s.y_f32, M * out_);
      break;
    default:
      grow_aligned(s.tile_f32, kTile * in_);
  }
}

const char* to_string(QuantLinear::Prefill p) {
  switch (p) {
    case QuantLinear::Prefill::Bf16Tiles:
      return "bf16 tiles";
    case QuantLinear::Prefill::Dpbf16:
      return "dpbf16";
    case QuantLinear::Prefill::AmxBf16:
      return "amx bf16";
    default:
      return "fp32 tiles";
  }
}

size_t QuantLinear::cached_primitives() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->prims.size();
}

void QuantLinear::forward(const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy) const {
  forward_as(x, M, ldx, y, ldy);
}
void QuantLinear::forward(const bf16_t* x, int64_t M, int64_t ldx, float* y, int64_t ldy) const {
  forward_as(x, M, ldx, y, ldy);
}
void QuantLinear::forward(const float* x, int64_t M, int64_t ldx, bf16_t* y, int64_t ldy) const {
  forward_as(x, M, ldx, y, ldy);
}
void QuantLinear::forward(const bf16_t* x, int64_t M, int64_t ldx, bf16_t* y, int64_t ldy) const {
  forward_as(x, M, ldx, y, ldy);
}

}  // namespace kda::layers
