#include "kda/layers/moe/swiglu.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "kda/kernels/gemm/bf16_gemm.h"
#include "kda/kernels/gemm/weight_format.h"
#include "kda/kernels/silu_mul.h"

namespace kda::layers::moe {

namespace {

std::vector<float> stack_rows(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> out;
  out.reserve(a.size() + b.size());
  out.insert(out.end(), a.begin(), a.end());
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

void check_size(const std::vector<float>& v, int64_t n, const char* name) {
  if (static_cast<int64_t>(v.size()) != n)
    throw std::invalid_argument(std::string("SwiGLU MLP: ") + name + " has " + std::to_string(v.size()) +
                                " values, expected " + std::to_string(n));
}

const std::vector<float>& checked(const std::vector<float>& gate, const std::vector<float>& up,
                                  const std::vector<float>& down, int64_t D, int64_t I) {
  if (D < 1 || I < 1)
    throw std::invalid_argument("SwiGLU MLP: hidden " + std::to_string(D) + " and intermediate " +
                                std::to_string(I) + " must be positive");
  check_size(gate, I * D, "gate_proj");
  check_size(up, I * D, "up_proj");
  check_size(down, D * I, "down_proj");
  return gate;
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// Rows parallel where there are enough of them; the GEMMs thread themselves.
constexpr int64_t kParallelElems = 1 << 15;

}  // namespace

SwigluMlp::SwigluMlp(int64_t D, int64_t I, const std::vector<float>& gate, const std::vector<float>& up,
                     const std::vector<float>& down, Precision precision, Weights weights)
    : D_(D),
      I_(I),
      precision_(precision),
      gate_up_(D, 2 * I, stack_rows(checked(gate, up, down, D, I), up), precision, weights),
      down_(I, D, down, precision, weights) {}

SwigluMlp::SwigluMlp(int64_t D, int64_t I, Linear gate_up, Linear down, Precision precision)
    : D_(D), I_(I), precision_(precision), gate_up_(std::move(gate_up)), down_(std::move(down)) {
  if (gate_up_.in_features() != D || gate_up_.out_features() != 2 * I || down_.in_features() != I ||
      down_.out_features() != D)
    throw std::invalid_argument("SwiGLU MLP: gate_up [" + std::to_string(gate_up_.out_features()) + ", " +
                                std::to_string(gate_up_.in_features()) + "] and down [" +
                                std::to_string(down_.out_features()) + ", " +
                                std::to_string(down_.in_features()) + "] for hidden " + std::to_string(D) +
                                " and intermediate " + std::to_string(I));
}

namespace {
// The scratch a SwigluMlp forward of T rows uses: gate|up [T, 2I] and silu*up [T, I], bf16 or fp32.
void grow_scratch(SwigluScratch& s, int64_t T, int64_t I, bool bf16) {
  const size_t nh = static_cast<size_t>(T * 2 * I), na = static_cast<size_t>(T * I);
  if (bf16) {
    if (s.h16.size() < nh) s.h16.resize(nh);
    if (s.a16.size() < na) s.a16.resize(na);
  } else {
    if (s.h.size() < nh) s.h.resize(nh);
    if (s.a.size() < na) s.a.resize(na);
  }
}
}  // namespace

void SwigluMlp::reserve(int64_t T, SwigluScratch& s) const {
  if (T <= 0) return;
  grow_scratch(s, T, I_, precision_ == Precision::BF16);
  gate_up_.reserve(T);
  down_.reserve(T);
}

void SwigluMlp::forward(const float* x, int64_t T, int64_t ldx, float* out, int64_t ldo, bool round_out,
                        SwigluScratch& s) const {
  if (T <= 0) return;
  grow_scratch(s, T, I_, precision_ == Precision::BF16);
  if (precision_ == Precision::BF16) {
    gate_up_.forward(x, T, ldx, s.h16.data(), 2 * I_);
    silu_mul(s.h16.data(), T, I_, s.a16.data());
    down_.forward(s.a16.data(), T, I_, out, ldo);
    if (round_out)
      for (int64_t t = 0; t < T; ++t) round_bf16_inplace(out + t * ldo, static_cast<size_t>(D_));
  } else {
    gate_up_.forward(x, T, ldx, s.h.data(), 2 * I_);
    silu_mul(s.h.data(), T, I_, s.a.data());
    down_.forward(s.a.data(), T, I_, out, ldo);
  }
}

template <class Y>
void SwigluMlp::forward_bf16(const bf16_t* x, int64_t T, int64_t ldx, Y* out, int64_t ldo, bool round_out,
                             SwigluScratch& s) const {
  if (precision_ != Precision::BF16)
    throw std::logic_error("SwiGLU MLP: bf16 rows into an MLP of the fp32 precision");
  if (T <= 0) return;
  grow_scratch(s, T, I_, true);
  gate_up_.forward(x, T, ldx, s.h16.data(), 2 * I_);
  silu_mul(s.h16.data(), T, I_, s.a16.data());
  down_.forward(s.a16.data(), T, I_, out, ldo);
  if constexpr (std::is_same_v<Y, float>)
    if (round_out)
      for (int64_t t = 0; t < T; ++t) round_bf16_inplace(out + t * ldo, static_cast<size_t>(D_));
}

void SwigluMlp::forward(const bf16_t* x, int64_t T, int64_t ldx, float* out, int64_t ldo, bool round_out,
                        SwigluScratch& s) const {
  forward_bf16(x, T, ldx, out, ldo, round_out, s);
}

void SwigluMlp::forward(const bf16_t* x, int64_t T, int64_t ldx, bf16_t* out, int64_t ldo,
                        SwigluScratch& s) const {
  forward_bf16(x, T, ldx, out, ldo, true, s);
}

int SwigluPieces::pieces_for(int64_t I, Weights weights, int want) {
  if (want < 1) throw std::invalid_argument("SwiGLU MLP: " + std::to_string(want) + " pieces asked for");
  // Slices the formats take without padding: int4's groups, and the widened bf16 kernels' input groups
  // (a narrower down input would be padded, read and multiplied as zeros).
  const int64_t multiple =
      std::max(kernels::gemm::weight_format(weights).in_multiple, kernels::gemm::kPackGroup);
  for (int p = static_cast<int>(std::min<int64_t>(want, I)); p > 1; --p)
    if (I % p == 0 && (I / p) % multiple == 0) return p;
  return 1;
}

SwigluPieces::SwigluPieces(int64_t D, int64_t I, const std::vector<float>& gate, const std::vector<float>& up,
                           const std::vector<float>& down, Precision precision, Weights weights,
                           int want_pieces)
    : D_(D), I_(I) {
  checked(gate, up, down, D, I);
  const int P = pieces_for(I, weights, want_pieces);
  const int64_t n = I / P;
  pieces_.reserve(static_cast<size_t>(P));
  std::vector<float> g(static_cast<size_t>(n * D)), u(g.size()), d(g.size());
  for (int p = 0; p < P; ++p) {
    const int64_t i0 = n * p;
    std::copy(gate.begin() + i0 * D, gate.begin() + (i0 + n) * D, g.begin());
    std::copy(up.begin() + i0 * D, up.begin() + (i0 + n) * D, u.begin());
    for (int64_t r = 0; r < D; ++r)
      std::copy(down.begin() + r * I + i0, down.begin() + r * I + i0 + n, d.begin() + r * n);
    pieces_.emplace_back(D, n, g, u, d, precision, weights);
  }
}

SwigluPieces::SwigluPieces(int64_t D, int64_t I, std::vector<SwigluMlp> pieces)
    : D_(D), I_(I), pieces_(std::move(pieces)) {
  const auto P = static_cast<int64_t>(pieces_.size());
  if (P < 1 || I % P != 0)
    throw std::invalid_argument("SwiGLU pieces: " + std::to_string(P) + " pieces for intermediate " +
                                std::to_string(I));
  for (const SwigluMlp& m : pieces_)
    if (m.hidden() != D || m.intermediate() != I / P)
      throw std::invalid_argument("SwiGLU pieces: a piece of hidden " + std::to_string(m.hidden()) +
                                  " and intermediate " + std::to_string(m.intermediate()) + ", expected " +
                                  std::to_string(D) + " and " + std::to_string(I / P));
}

int64_t SwigluPieces::weight_bytes() const {
  int64_t b = 0;
  for (const SwigluMlp& m : pieces_) b += m.weight_bytes();
  return b;
}

void SwigluPieces::forward_piece(int p, const float* x, int64_t T, int64_t ldx, float* part, int64_t ldp,
                                 SwigluScratch& scratch) const {
  pieces_[static_cast<size_t>(p)].forward(x, T, ldx, part, ldp, false, scratch);
}

void SwigluPieces::forward(const float* x, int64_t T, int64_t ldx, float* out, int64_t ldo, bool round_out,
                           SwigluScratch& scratch, std::vector<float>& part) const {
  forward_as(x, T, ldx, out, ldo, round_out, scratch, part);
}

void SwigluPieces::forward(const bf16_t* x, int64_t T, int64_t ldx, float* out, int64_t ldo, bool round_out,
                           SwigluScratch& scratch, std::vector<float>& part) const {
  forward_as(x, T, ldx, out, ldo, round_out, scratch, part);
}

void SwigluPieces::forward(const bf16_t* x, int64_t T, int64_t ldx, bf16_t* out, int64_t ldo,
                           SwigluScratch& scratch) const {
  if (pieces_.size() != 1)
    throw std::logic_error("SwiGLU MLP: bf16 output of an MLP in " + std::to_string(pieces_.size()) +
                           " pieces (their partials are summed in fp32 first)");
  pieces_[0].forward(x, T, ldx, out, ldo, scratch);
}

template <class X>
void SwigluPieces::forward_as(const X* x, int64_t T, int64_t ldx, float* out, int64_t ldo, bool round_out,
                              SwigluScratch& scratch, std::vector<float>& part) const {
  if (T <= 0) return;
  if (pieces_.size() == 1) return pieces_[0].forward(x, T, ldx, out, ldo, round_out, scratch);
  pieces_[0].forward(x, T, ldx, out, ldo, false, scratch);
  if (part.size() < static_cast<size_t>(T * D_)) part.resize(static_cast<size_t>(T * D_));
  for (size_t p = 1; p < pieces_.size(); ++p) {
    pieces_[p].forward(x, T, ldx, part.data(), D_, false, scratch);
    add_part(out, ldo, part.data(), D_, T, D_);
  }
  if (round_out)
    for (int64_t t = 0; t < T; ++t) round_bf16_inplace(out + t * ldo, static_cast<size_t>(D_));
}

void SwigluPieces::reserve(int64_t T, SwigluScratch& scratch, std::vector<float>& part) const {
  if (T <= 0) return;
  for (const SwigluMlp& m : pieces_) m.reserve(T, scratch);
  if (pieces_.size() > 1 && part.size() < static_cast<size_t>(T * D_))
    part.resize(static_cast<size_t>(T * D_));
}

void SwigluPieces::add_part(float* out, int64_t ldo, const float* part, int64_t ldp, int64_t T, int64_t D) {
#pragma omp parallel for schedule(static) if (T * D >= kParallelElems)
  for (int64_t t = 0; t < T; ++t) {
    float* o = out + t * ldo;
    const float* q = part + t * ldp;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] += q[d];
  }
}

void silu_mul_reference(const float* h, int64_t T, int64_t I, float* a, bool round) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const float v = silu(h[t * 2 * I + i]) * h[t * 2 * I + I + i];
      a[t * I + i] = round ? round_bf16(v) : v;
    }
}

void silu_mul(const float* h, int64_t T, int64_t I, float* a) { kernels::silu_mul(h, T, I, a); }

void silu_mul(const bf16_t* h, int64_t T, int64_t I, bf16_t* a) { kernels::silu_mul(h, T, I, a); }

}  // namespace kda::layers::moe
