#include "kda/layers/linear.h"

#include <algorithm>
#include <cstring>
#include <dnnl.hpp>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kda/common/isa.h"
#include "kda/common/weight_buffer.h"
#include "kda/kernels/gemm/bf16_amx_block.h"
#include "kda/kernels/gemm/bf16_vnni.h"
#include "kda/kernels/gemm/weight_format.h"
#include "kda/layers/bf16_vnni_rows.h"
#include "kda/layers/fp32_rows.h"
#include "kda/layers/matmul_cache.h"
#include "kda/layers/onednn_isa.h"
#include "kda/layers/quant_linear.h"

namespace kda::layers {

using dnnl::memory;

struct Linear::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  mutable dnnl::stream stream{engine};
  // The weight, in the layout(s) oneDNN's matmul asks for, reordered from the W^T view of [out, in] once:
  // with a plain layout that its kernel does not take, every call would repack W, a cost at every M and
  // the largest at the decode sizes (M = 1..64), where the GEMM itself is one pass over W. The first
  // is the layout for dense input rows at a mid-sized M; a call shape that wants another (strided rows
  // take a plain-layout kernel) gets a copy, or replaces it while no primitive uses it yet.
  std::vector<dnnl::memory> w;
  // w's first memory's bytes (weight_buffer.h: huge pages from 2 MiB); freed with it, unless vnni_w holds it.
  WeightBuffer w_buf;
  // One primitive per (M, ldx, ldy, output type), with the weight memory it takes.
  mutable MatmulCache prims{kMaxPrimitives};
  mutable std::mutex mu;
  std::unique_ptr<QuantLinear> quant;  // int8 / int4 weights: every call goes there
  // Bf16Gemm::Widened: W in bf16, packed for the kernels (no oneDNN copy), and the fp32 rows of a call.
  std::unique_ptr<kernels::gemm::PackedMatrix> w_packed;
  std::unique_ptr<Fp32Rows> widened;
  // bf16 on AVX512_BF16 without AMX: calls of up to kVnniMaxRows rows go to the decode kernel on W in
  // oneDNN's layout (bf16_vnni_rows.h; the same bits as oneDNN's matmul), with oneDNN's chunk of inputs;
  // -1: never. vnni_w holds that layout's memory whatever later calls do to w.
  int64_t vnni_chunk = -1;
  dnnl::memory vnni_w;
  // Bf16Gemm::OneDnnAmx: calls of up to kAmxRows rows go to the AMX decode kernel on vnni_w.
  bool amx_rows = false;
};

namespace {

memory::desc plain_weight_md(int64_t in, int64_t out, memory::data_type dt) {
  return memory::desc({in, out}, dt, memory::dims{1, in});  // W^T view of [out, in]
}

// The matmul for one call shape, W's layout left to oneDNN (format `any`): wdt is the type of W and x.
dnnl::matmul::primitive_desc matmul_pd(const dnnl::engine& eng, int64_t M, int64_t in, int64_t out,
                                       int64_t ldx, int64_t ldy, memory::data_type wdt, bool y_bf16) {
  const memory::desc src_md({M, in}, wdt, memory::dims{ldx, 1});
  const memory::desc w_md({in, out}, wdt, memory::format_tag::any);
  const auto ydt = y_bf16 ? memory::data_type::bf16 : memory::data_type::f32;
  const memory::desc dst_md({M, out}, ydt, memory::dims{ldy, 1});
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src_md, w_md, dst_md), eng);
}

}  // namespace

Linear::Linear(int64_t in_features, int64_t out_features, const std::vector<float>& weight,
               Precision precision, Weights weights, Bf16Gemm bf16_gemm)
    : in_(in_features),
      out_(out_features),
      precision_(precision),
      weights_(weights),
      impl_(std::make_unique<Impl>()) {
  if (in_ <= 0 || out_ <= 0) throw std::invalid_argument("Linear: features must be positive");
  if (static_cast<int64_t>(weight.size()) != in_ * out_)
    throw std::invalid_argument("Linear: weight has " + std::to_string(weight.size()) + " values, expected " +
                                std::to_string(out_) + " x " + std::to_string(in_));
  if (weights != Weights::BF16) {
    if (bf16_gemm != Bf16Gemm::Auto)
      throw std::invalid_argument(
          "Linear: a bf16 GEMM choice is only for bf16 projections with bf16 weights");
    impl_->quant = std::make_unique<QuantLinear>(in_, out_, weight, weights, precision);
    return;
  }
  init_dense(weight.data(), nullptr, bf16_gemm);
}

Linear::Linear(int64_t in_features, int64_t out_features, const bf16_t* weight, Precision precision,
               Bf16Gemm bf16_gemm)
    : in_(in_features), out_(out_features), precision_(precision), impl_(std::make_unique<Impl>()) {
  if (in_ <= 0 || out_ <= 0) throw std::invalid_argument("Linear: features must be positive");
  if (weight == nullptr) throw std::invalid_argument("Linear: null bf16 weight");
  init_dense(nullptr, weight, bf16_gemm);
}

// W dense (bf16 weights) from fp32 values (wf) or bf16 ones (wb), [out, in] row-major either way: into
// oneDNN's layout, or the widened kernels' blocks.
void Linear::init_dense(const float* wf, const bf16_t* wb, Bf16Gemm bf16_gemm) {
  const bool bf16_dense = precision_ == Precision::BF16;
  if (bf16_gemm != Bf16Gemm::Auto && !bf16_dense)
    throw std::invalid_argument("Linear: a bf16 GEMM choice is only for bf16 projections with bf16 weights");
  const size_t n = static_cast<size_t>(in_ * out_);
  std::vector<float> widened;  // bf16 values where the fp32 forms need them
  if (bf16_dense) {
    bf16_gemm_ = bf16_gemm != Bf16Gemm::Auto ? bf16_gemm
                 : cpu_has_bf16_gemm()       ? Bf16Gemm::OneDnnVnni
                                             : Bf16Gemm::Widened;
  }
  if (wb != nullptr && (!bf16_dense || bf16_gemm_ == Bf16Gemm::Widened)) {
    widened.resize(n);
    bf16_to_f32_array(wb, widened.data(), n);
    wf = widened.data();
    wb = nullptr;
  }
  if (bf16_gemm_ == Bf16Gemm::Widened) {
    impl_->w_packed = std::make_unique<kernels::gemm::PackedMatrix>(Weights::BF16, wf, in_, out_);
    impl_->widened = std::make_unique<Fp32Rows>(in_, out_);
    return;
  }
  const auto dt = bf16_dense ? memory::data_type::bf16 : memory::data_type::f32;
  std::vector<bf16_t> w_bf16;
  void* plain = const_cast<float*>(wf);
  if (wb != nullptr) {
    plain = const_cast<bf16_t*>(wb);  // read only: the reorder's source
  } else if (bf16_dense) {
    w_bf16.resize(n);
    f32_to_bf16_array(wf, w_bf16.data(), n);
    plain = w_bf16.data();
  }
  Impl& im = *impl_;
  const memory::desc w_md = matmul_pd(im.engine, 256, in_, out_, in_, out_, dt, false).weights_desc();
  im.w_buf = allocate_weights(w_md.get_size());
  im.w.emplace_back(w_md, im.engine, im.w_buf.get());
  memory src(plain_weight_md(in_, out_, dt), im.engine, plain);
  dnnl::reorder(src, im.w[0]).execute(im.stream, src, im.w[0]);
  im.stream.wait();
  const bool vnni_layout = in_vnni_layout(im.w[0].get_desc(), in_, out_);
  if (bf16_gemm_ == Bf16Gemm::OneDnnVnni) {
    im.vnni_chunk = vnni_layout ? onednn_bf16_k_chunk(in_, out_) : -1;
    if (im.vnni_chunk >= 0) {
      im.vnni_w = im.w[0];
    } else if (bf16_gemm == Bf16Gemm::OneDnnVnni) {
      throw std::invalid_argument("Linear: the bf16 decode kernel cannot give oneDNN's bits on this CPU");
    } else {
      bf16_gemm_ = Bf16Gemm::OneDnn;  // Auto
    }
  }
  // Where oneDNN multiplies with AMX tiles, its kernels read W below the memory's rate at the decode row
  // counts and sum a row by its batch; the AMX decode kernel reads the same copy in one pass.
  const bool amx = vnni_layout && onednn_bf16_uses_amx() && kernels::gemm::bf16_amx_block_takes(in_);
  if (bf16_gemm == Bf16Gemm::OneDnnAmx && !amx)
    throw std::invalid_argument(
        "Linear: the AMX decode kernel does not run here (oneDNN without AMX tiles, or " +
        std::to_string(in_) + " inputs, not a multiple of 32)");
  if (amx &&
      (bf16_gemm == Bf16Gemm::OneDnnAmx || (bf16_gemm == Bf16Gemm::Auto && bf16_gemm_ == Bf16Gemm::OneDnn))) {
    bf16_gemm_ = Bf16Gemm::OneDnnAmx;
    im.amx_rows = true;
    im.vnni_w = im.w[0];
  }
}

Linear::Linear(const kernels::gemm::PackedMatrix& packed, Precision precision)
    : in_(packed.view().in),
      out_(packed.view().out),
      precision_(precision),
      weights_(packed.view().format),
      impl_(std::make_unique<Impl>()) {
  if (weights_ != Weights::BF16) {
    impl_->quant = std::make_unique<QuantLinear>(packed, precision);
    return;
  }
  if (precision_ != Precision::BF16)
    throw std::invalid_argument(
        "Linear: packed bf16 weights (the widened kernels' blocks) need the bf16 precision");
  bf16_gemm_ = Bf16Gemm::Widened;
  impl_->w_packed = std::make_unique<kernels::gemm::PackedMatrix>(packed);
  impl_->widened = std::make_unique<Fp32Rows>(in_, out_);
}

Linear::~Linear() = default;
Linear::Linear(Linear&&) noexcept = default;
Linear& Linear::operator=(Linear&&) noexcept = default;

const kernels::gemm::PackedMatrix* Linear::packed() const {
  if (impl_->quant) return &impl_->quant->packed();
  return impl_->w_packed.get();
}

void Linear::check(int64_t M, int64_t ldx, int64_t ldy, bool bf16_io) const {
  if (bf16_io && precision_ != Precision::BF16)
    throw std::invalid_argument("Linear::forward: bf16 input or output for an fp32 projection");
  if (M < 0 || ldx < in_ || ldy < out_) throw std::invalid_argument("Linear::forward: bad M or row strides");
}

// The bf16 input scratch of the calling thread, shared by every Linear it calls (a model holds thousands
// of projections: scratch per object would keep each one's largest call resident).
static std::vector<bf16_t>& x_bf16_scratch() {
  thread_local std::vector<bf16_t> v;
  return v;
}

// Packs fp32 rows to dense bf16 rows in the scratch; in the bf16 mode the values are bf16 already, so the
// conversion is exact. The scratch is the calling thread's: no lock needed.
const bf16_t* Linear::to_bf16(const float* x, int64_t M, int64_t ldx) const {
  std::vector<bf16_t>& scratch = x_bf16_scratch();
  scratch.resize(static_cast<size_t>(M * in_));
  bf16_t* xb = scratch.data();
  const int64_t in = in_;
#pragma omp parallel for schedule(static) if (M * in >= (int64_t{1} << 16))
  for (int64_t i = 0; i < M; ++i) f32_to_bf16_array(x + i * ldx, xb + i * in, static_cast<size_t>(in));
  return xb;
}

// bf16 rows with a stride copied to dense rows in the scratch: oneDNN 2.6 runs strided bf16 sources
// through its generic gemm kernel, slower than its brgemm one by far more than the copy costs (at the
// gate's shape, the bottleneck); strided fp32 sources take the same kernel as dense ones. Caller holds
// the mutex.
const bf16_t* Linear::dense(const bf16_t* x, int64_t M, int64_t ldx) const {
  if (ldx == in_) return x;
  std::vector<bf16_t>& scratch = x_bf16_scratch();
  scratch.resize(static_cast<size_t>(M * in_));
  bf16_t* xb = scratch.data();
  for (int64_t i = 0; i < M; ++i) std::memcpy(xb + i * in_, x + i * ldx, sizeof(bf16_t) * in_);
  return xb;
}

template <class X, class Y>
void Linear::forward_as(const X* x, int64_t M, int64_t ldx, Y* y, int64_t ldy) const {
  constexpr bool x16 = std::is_same_v<X, bf16_t>, y16 = std::is_same_v<Y, bf16_t>;
  check(M, ldx, ldy, x16 || y16);
  if (M == 0) return;
  if (impl_->quant) return impl_->quant->forward(x, M, ldx, y, ldy);
  // The decode rows of OneDnnVnni and OneDnnAmx, on oneDNN's copy of W: no shared state, no lock.
  const bool amx_rows = impl_->amx_rows && M <= kernels::gemm::kAmxRows;
  if (amx_rows || (impl_->vnni_chunk >= 0 && M <= kVnniMaxRows)) {
    const auto* w = static_cast<const bf16_t*>(impl_->vnni_w.get_data_handle());
    const bf16_t* xb = nullptr;
    int64_t ldb = in_;
    if constexpr (x16) {
      xb = x;
      ldb = ldx;
    } else {
      xb = to_bf16(x, M, ldx);
    }
    if (amx_rows)
      kernels::gemm::gemm_bf16_amx_rows(xb, M, ldb, w, in_, out_, y, ldy);
    else
      kernels::gemm::gemm_bf16_vnni(xb, M, ldb, w, in_, out_, y, ldy, impl_->vnni_chunk);
    return;
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->widened) {
    const kernels::gemm::PackedWeights w = impl_->w_packed->view();
    impl_->widened->with(x, M, ldx, y, ldy, true,
                         [&](const float* xf, int64_t ldxf, float* yf, int64_t ldyf) {
                           kernels::gemm::gemm(xf, M, ldxf, w, yf, ldyf);
                         });
    return;
  }
  if constexpr (x16) {
    run(dense(x, M, ldx), M, in_, y, y16, ldy);
  } else if (precision_ == Precision::FP32) {
    run(x, M, ldx, y, y16, ldy);
  } else {
    run(to_bf16(x, M, ldx), M, in_, y, y16, ldy);
  }
}

void Linear::forward(const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy) const {
  forward_as(x, M, ldx, y, ldy);
}
void Linear::forward(const bf16_t* x, int64_t M, int64_t ldx, float* y, int64_t ldy) const {
  forward_as(x, M, ldx, y, ldy);
}
void Linear::forward(const float* x, int64_t M, int64_t ldx, bf16_t* y, int64_t ldy) const {
  forward_as(x, M, ldx, y, ldy);
}
void Linear::forward(const bf16_t* x, int64_t M, int64_t ldx, bf16_t* y, int64_t ldy) const {
  forward_as(x, M, ldx, y, ldy);
}

void Linear::reserve(int64_t M) const {
  if (M <= 0) return;
  if (impl_->quant) return impl_->quant->reserve(M);
  if (impl_->widened) return impl_->widened->reserve(M);
  // to_bf16 / dense: the bf16 precision's input rows (the vnni kernel's few rows as well).
  if (precision_ != Precision::BF16) return;
  std::vector<bf16_t>& scratch = x_bf16_scratch();
  if (static_cast<int64_t>(scratch.size()) < M * in_) scratch.resize(static_cast<size_t>(M * in_));
}

int64_t Linear::weight_bytes() const {
  if (impl_->quant) return impl_->quant->weight_bytes();
  if (impl_->widened) return impl_->w_packed->bytes();  // with its padding
  return in_ * out_ * (precision_ == Precision::BF16 ? 2 : 4);
}

size_t Linear::cached_primitives() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->prims.size();
}

// Caller holds the mutex.
void Linear::run(const void* x, int64_t M, int64_t ldx, void* y, bool y_bf16, int64_t ldy) const {
  Impl& im = *impl_;
  const MatmulCache::Entry& p = im.prims.get({M, out_, ldx, ldy, y_bf16}, [&] {
    // Let matmul pick W's layout for this shape; the same for every M seen so far.
    const auto pd = matmul_pd(im.engine, M, in_, out_, ldx, ldy, im.w[0].get_desc().data_type(), y_bf16);
    auto same = [&](const memory& m) { return m.get_desc() == pd.weights_desc(); };
    auto w = std::find_if(im.w.begin(), im.w.end(), same);
    if (w == im.w.end()) {
      memory copy(pd.weights_desc(), im.engine);
      dnnl::reorder(im.w[0], copy).execute(im.stream, im.w[0], copy);
      im.stream.wait();
      if (im.prims.size() == 0) {
        im.w.clear();
        if (im.vnni_chunk < 0 && !im.amx_rows) im.w_buf.reset();
      }
      im.w.push_back(copy);
      w = im.w.end() - 1;
    }
    return MatmulCache::Entry{dnnl::matmul(pd), pd.src_desc(), pd.weights_desc(), pd.dst_desc(), *w};
  });
  memory src_m(p.src, im.engine, const_cast<void*>(x));
  memory dst_m(p.dst, im.engine, y);
  p.matmul.execute(im.stream, {{DNNL_ARG_SRC, src_m}, {DNNL_ARG_WEIGHTS, p.w}, {DNNL_ARG_DST, dst_m}});
  im.stream.wait();
}

}  // namespace kda::layers
