#include "kda/layers/linear.h"

#include <cstring>
#include <dnnl.hpp>
#include <mutex>
#include <stdexcept>
#include <string>

namespace kda::layers {

using dnnl::memory;

struct Linear::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  mutable dnnl::stream stream{engine};
  std::vector<float> w_f32;    // [out, in]
  std::vector<bf16_t> w_bf16;  // [out, in]
  // One primitive per (M, ldx, ldy): created on first use, reused after.
  struct Key {
    int64_t m, ldx, ldy;
    bool operator<(const Key& o) const {
      return m != o.m ? m < o.m : (ldx != o.ldx ? ldx < o.ldx : ldy < o.ldy);
    }
  };
  mutable std::map<Key, dnnl::matmul> prims;
  mutable std::vector<bf16_t> x_bf16;  // bf16 input scratch
  mutable std::mutex mu;
};

Linear::Linear(int64_t in_features, int64_t out_features, const std::vector<float>& weight,
               Precision precision)
    : in_(in_features), out_(out_features), precision_(precision), impl_(std::make_unique<Impl>()) {
  if (in_ <= 0 || out_ <= 0) throw std::invalid_argument("Linear: features must be positive");
  if (static_cast<int64_t>(weight.size()) != in_ * out_)
    throw std::invalid_argument("Linear: weight has " + std::to_string(weight.size()) + " values, expected " +
                                std::to_string(out_) + " x " + std::to_string(in_));
  if (precision_ == Precision::FP32) {
    impl_->w_f32 = weight;
  } else {
    impl_->w_bf16.resize(weight.size());
    f32_to_bf16_array(weight.data(), impl_->w_bf16.data(), weight.size());
  }
}

Linear::~Linear() = default;
Linear::Linear(Linear&&) noexcept = default;
Linear& Linear::operator=(Linear&&) noexcept = default;

void Linear::forward(const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy) const {
  if (M < 0 || ldx < in_ || ldy < out_) throw std::invalid_argument("Linear::forward: bad M or row strides");
  if (M == 0) return;
  if (precision_ == Precision::FP32) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    run(x, M, ldx, y, ldy);
    return;
  }
  // Pack the input to dense bf16 rows; in the bf16 mode the values are bf16 already, so the conversion
  // is exact.
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->x_bf16.resize(static_cast<size_t>(M * in_));
  bf16_t* xb = impl_->x_bf16.data();
  const int64_t in = in_;
#pragma omp parallel for schedule(static) if (M * in >= (int64_t{1} << 16))
  for (int64_t i = 0; i < M; ++i) f32_to_bf16_array(x + i * ldx, xb + i * in, static_cast<size_t>(in));
  run(xb, M, in_, y, ldy);
}

void Linear::forward(const bf16_t* x, int64_t M, int64_t ldx, float* y, int64_t ldy) const {
  if (precision_ != Precision::BF16)
    throw std::invalid_argument("Linear::forward: bf16 input to an fp32 projection");
  if (M < 0 || ldx < in_ || ldy < out_) throw std::invalid_argument("Linear::forward: bad M or row strides");
  if (M == 0) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  run(x, M, ldx, y, ldy);
}

// Caller holds the mutex.
void Linear::run(const void* x, int64_t M, int64_t ldx, float* y, int64_t ldy) const {
  const bool bf16 = precision_ == Precision::BF16;
  const auto wdt = bf16 ? memory::data_type::bf16 : memory::data_type::f32;
  memory::desc src_md({M, in_}, wdt, memory::dims{ldx, 1});
  memory::desc wei_md({in_, out_}, wdt, memory::dims{1, in_});  // W^T view of [out, in]
  memory::desc dst_md({M, out_}, memory::data_type::f32, memory::dims{ldy, 1});
  const Impl::Key key{M, ldx, ldy};
  auto it = impl_->prims.find(key);
  if (it == impl_->prims.end()) {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, wei_md, dst_md), impl_->engine);
    it = impl_->prims.emplace(key, dnnl::matmul(pd)).first;
  }
  void* wptr = bf16 ? static_cast<void*>(impl_->w_bf16.data()) : static_cast<void*>(impl_->w_f32.data());
  memory src_m(src_md, impl_->engine, const_cast<void*>(x));
  memory wei_m(wei_md, impl_->engine, wptr);
  memory dst_m(dst_md, impl_->engine, y);
  it->second.execute(impl_->stream,
                     {{DNNL_ARG_SRC, src_m}, {DNNL_ARG_WEIGHTS, wei_m}, {DNNL_ARG_DST, dst_m}});
  impl_->stream.wait();
}

}  // namespace kda::layers
