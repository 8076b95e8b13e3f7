#include "kda/layers/attention/mla/mla_attention.h"

#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/f32_block.h"
#include "kda/kernels/online_softmax.h"

namespace kda::layers::attention::mla {
namespace {

// Queries per work item: a block of a sequence's new tokens shares one pass over its keys.
constexpr int64_t kQueryBlock = 64;
// Keys per step of the flash-style plain kernel: a block's scores stay in L1/L2.
constexpr int64_t kKeyBlock = 256;

// Row-major C = alpha op(A) op(B) + beta C through oneDNN (single-threaded inside a parallel region).
void sgemm(char ta, char tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  const dnnl_status_t st = dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  if (st != dnnl_success)
    throw std::runtime_error("MLA attention: oneDNN sgemm failed (status " + std::to_string(st) + ")");
}

// Row ii of a query block (new token i0 + ii) sees keys [0, prefix + i0 + ii]; with a visibility matrix,
// only those of the new tokens it names. Softmax in fp32, max-subtracted; masked entries become 0 so the
// block's value GEMM can run over every key.
void causal_softmax(float* scores, int64_t ld, int64_t rows, const MlaSeq& seq, int64_t i0) {
  for (int64_t ii = 0; ii < rows; ++ii) {
    float* s = scores + ii * ld;
    const int64_t i = i0 + ii, n = seq.prefix + i + 1;
    if (seq.visible)
      for (int64_t m = 0; m < i; ++m)
        if (!seq.visible[i * seq.extend + m]) s[seq.prefix + m] = -INFINITY;
    float m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - m);
      sum += s[j];
    }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; ++j) s[j] *= inv;
    std::fill(s + n, s + ld, 0.0f);
  }
}

struct WorkItem {
  int64_t seq, head, i0, i1;
};

std::vector<WorkItem> work_items(const MlaAttnArgs& a) {
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < static_cast<int64_t>(a.seqs.size()); ++b)
    for (int64_t h = 0; h < a.dims.heads; ++h)
      for (int64_t i0 = 0; i0 < a.seqs[b].extend; i0 += kQueryBlock)
        items.push_back({b, h, i0, std::min(a.seqs[b].extend, i0 + kQueryBlock)});
  return items;
}

void check_args(const MlaAttnArgs& a) {
  for (const MlaSeq& s : a.seqs)
    if (s.prefix < 0 || s.extend < 0 || (s.prefix + s.extend > 0 && !s.latent))
      throw std::invalid_argument("MLA attention: a sequence with prefix " + std::to_string(s.prefix) +
                                  ", extend " + std::to_string(s.extend) + " and no latent rows");
}

// Runs body(item, thread scratch) over the items in parallel; the first exception is rethrown after the
// region (none may escape it).
template <class Body>
void parallel_items(const std::vector<WorkItem>& items, Body&& body) {
  std::exception_ptr err;
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < static_cast<int64_t>(items.size()); ++k) {
      try {
        body(items[static_cast<size_t>(k)], scratch);
      } catch (...) {
#pragma omp critical(mla_attention_error)
        if (!err) err = std::current_exception();
      }
    }
  }
  if (err) std::rethrow_exception(err);
}

// A query block's pass over one key block [j0, j0 + kn) in the online softmax: scores s (scaled), masked
// as causal_softmax masks them, then the step of kernels/online_softmax.h: per row the running max mx and
// sum l, the output rows acc [nb, dv] rescaled to the new max; s left as the block's weights exp(s - max)
// (0 where masked).
void online_softmax_block(float* s, int64_t kn, int64_t nb, const MlaSeq& seq, int64_t i0, int64_t j0,
                          float* mx, float* l, float* acc, int64_t dv) {
  for (int64_t ii = 0; ii < nb; ++ii) {
    float* r = s + ii * kn;
    const int64_t i = i0 + ii, last = seq.prefix + i;  // the last key row ii sees
    for (int64_t jj = std::max<int64_t>(0, last + 1 - j0); jj < kn; ++jj) r[jj] = -INFINITY;
    if (seq.visible)
      for (int64_t jj = std::max<int64_t>(0, seq.prefix - j0); jj < kn && j0 + jj < last; ++jj)
        if (!seq.visible[i * seq.extend + (j0 + jj - seq.prefix)]) r[jj] = -INFINITY;
  }
  kernels::online_softmax_block(s, kn, nb, mx, l, acc, dv);
}

// The expansion through kv_b, shared by both plain kernels: one sequence's keys and values (a threaded
// GEMM per head) in the layouts the flash kernel's block GEMMs (gemm_f32_block) read in place: each head's
// nope keys transposed, kt [dn, ldk] (a column per key), the rope keys every head shares transposed, rt [dr,
// ldk], and each head's values v [S, ldv]; the expanded keys and values bf16-rounded in the bf16 mode (the
// layer's rounding point: kv_b's output), the rope keys as the cache holds them.
struct PlainKv {
  int64_t ldk = 0, ldv = 0;
  const float *kt = nullptr, *rt = nullptr, *v = nullptr;
};

// b holding at least n values; grown without keeping its old values, never shrunk.
float* at_least(std::vector<float>& b, size_t n) {
  if (b.size() < n) {
    b.clear();
    b.shrink_to_fit();
    b.resize(n);
  }
  return b.data();
}

// The three buffers' values for one sequence of S keys (the layouts above).
struct PlainKvSize {
  size_t kt, rt, v;
};
PlainKvSize plain_kv_size(const MlaDims& d, int64_t S) {
  const int64_t ldk = kernels::gemm::f32_block_ld(S), ldv = kernels::gemm::f32_block_ld(d.v_head);
  return {static_cast<size_t>(int64_t{d.heads} * d.qk_nope * ldk), static_cast<size_t>(d.qk_rope * ldk),
          static_cast<size_t>(int64_t{d.heads} * S * ldv)};
}

std::vector<PlainKv> expand_plain(const MlaAttnArgs& a, MlaScratch& scratch) {
  const MlaDims& d = a.dims;
  const int64_t Hm = d.heads, dn = d.qk_nope, dr = d.qk_rope, dv = d.v_head, R = d.kv_lora, lat = R + dr;
  // Every sequence's share of the three buffers, then the buffers once.
  std::vector<PlainKv> out(a.seqs.size());
  std::vector<size_t> kt_at(a.seqs.size()), rt_at(a.seqs.size()), v_at(a.seqs.size());
  size_t kt_n = 0, rt_n = 0, v_n = 0;
  for (size_t b = 0; b < a.seqs.size(); ++b) {
    const MlaSeq& s = a.seqs[b];
    const int64_t S = s.prefix + s.extend;
    if (s.extend == 0 || S == 0) continue;
    out[b].ldk = kernels::gemm::f32_block_ld(S);
    out[b].ldv = kernels::gemm::f32_block_ld(dv);
    kt_at[b] = kt_n, rt_at[b] = rt_n, v_at[b] = v_n;
    const PlainKvSize n = plain_kv_size(d, S);
    kt_n += n.kt;
    rt_n += n.rt;
    v_n += n.v;
  }
  float* const kt_all = at_least(scratch.kt, kt_n);
  float* const rt_all = at_least(scratch.rt, rt_n);
  float* const v_all = at_least(scratch.v, v_n);
  for (size_t b = 0; b < a.seqs.size(); ++b) {
    const MlaSeq& s = a.seqs[b];
    const int64_t S = s.prefix + s.extend;
    if (s.extend == 0 || S == 0) continue;
    PlainKv& p = out[b];
    p.kt = kt_all + kt_at[b];
    p.rt = rt_all + rt_at[b];
    p.v = v_all + v_at[b];
    for (int64_t h = 0; h < Hm; ++h) {
      const float* w_uk = a.w_kvb + h * (dn + dv) * R;  // [dn, R]
      const float* w_uv = w_uk + dn * R;                // [dv, R]
      float* kt = kt_all + kt_at[b] + h * dn * p.ldk;
      float* v = v_all + v_at[b] + h * S * p.ldv;
      sgemm('N', 'T', dn, S, R, 1.0f, w_uk, R, s.latent, lat, 0.0f, kt, p.ldk);
      sgemm('N', 'T', S, dv, R, 1.0f, s.latent, lat, w_uv, R, 0.0f, v, p.ldv);
      if (a.bf16) {
        for (int64_t c = 0; c < dn; ++c) round_bf16_inplace(kt + c * p.ldk, static_cast<size_t>(S));
        for (int64_t j = 0; j < S; ++j) round_bf16_inplace(v + j * p.ldv, static_cast<size_t>(dv));
      }
    }
    float* rt = rt_all + rt_at[b];
    for (int64_t j = 0; j < S; ++j)
      for (int64_t c = 0; c < dr; ++c) rt[c * p.ldk + j] = s.latent[j * lat + R + c];
  }
  return out;
}

}  // namespace

bool prefer_absorbed(const MlaDims& d, int64_t prefix, int64_t extend) {
  const double R = d.kv_lora, dn = d.qk_nope, dr = d.qk_rope, dv = d.v_head;
  const double S = static_cast<double>(prefix + extend), E = static_cast<double>(extend);
  const double s_avg = static_cast<double>(prefix) + 0.5 * (E + 1.0);
  const double plain = S * R * (dn + dv) + E * s_avg * (dn + dr + dv);
  const double absorbed = E * R * (dn + dv) + E * s_avg * (2.0 * R + dr);
  return absorbed < plain;
}

// Flash-style: a query block walks its keys in blocks of kKeyBlock with an online softmax (running max
// and sum per row, fp32), so the scores in memory are [block, kKeyBlock], never a row per key. The block
// GEMMs read the expanded keys and values in place and allocate nothing (f32_block.h says why).
void reserve_plain(const MlaDims& dims, int64_t keys, MlaScratch& scratch) {
  if (keys <= 0) return;
  const PlainKvSize n = plain_kv_size(dims, keys);
  at_least(scratch.kt, n.kt);
  at_least(scratch.rt, n.rt);
  at_least(scratch.v, n.v);
}

void mla_attention_plain(const MlaAttnArgs& a) {
  check_args(a);
  const MlaDims& d = a.dims;
  const int64_t dn = d.qk_nope, dr = d.qk_rope, dv = d.v_head;
  const int64_t qw = dn + dr;
  MlaScratch own;
  const std::vector<PlainKv> kv = expand_plain(a, a.scratch != nullptr ? *a.scratch : own);
  parallel_items(work_items(a), [&](const WorkItem& w, std::vector<float>& buf) {
    const MlaSeq& s = a.seqs[static_cast<size_t>(w.seq)];
    const PlainKv& p = kv[static_cast<size_t>(w.seq)];
    const int64_t nb = w.i1 - w.i0, ns = s.prefix + w.i1;  // keys the block's last query sees
    buf.resize(static_cast<size_t>(nb * kKeyBlock + nb * dv + 2 * nb));
    float* scores = buf.data();
    float* acc = scores + nb * kKeyBlock;
    float* mx = acc + nb * dv;
    float* l = mx + nb;
    std::fill(acc, acc + nb * dv, 0.0f);
    std::fill(mx, mx + nb, -INFINITY);
    std::fill(l, l + nb, 0.0f);
    const float* q = a.q + (s.q_row + w.i0) * a.ldq + w.head * qw;
    const float* kt = p.kt + w.head * dn * p.ldk;
    const float* v = p.v + w.head * (s.prefix + s.extend) * p.ldv;
    for (int64_t j0 = 0; j0 < ns; j0 += kKeyBlock) {
      const int64_t kn = std::min(kKeyBlock, ns - j0);
      kernels::gemm::gemm_f32_block(nb, kn, dn, a.scale, q, a.ldq, kt + j0, p.ldk, 0.0f, scores, kn);
      kernels::gemm::gemm_f32_block(nb, kn, dr, a.scale, q + dn, a.ldq, p.rt + j0, p.ldk, 1.0f, scores, kn);
      online_softmax_block(scores, kn, nb, s, w.i0, j0, mx, l, acc, dv);
      kernels::gemm::gemm_f32_block(nb, dv, kn, 1.0f, scores, kn, v + j0 * p.ldv, p.ldv, 1.0f, acc, dv);
    }
    float* o = a.o + (s.q_row + w.i0) * a.ldo + w.head * dv;
    for (int64_t ii = 0; ii < nb; ++ii) {
      const float inv = 1.0f / l[ii];
      for (int64_t c = 0; c < dv; ++c) o[ii * a.ldo + c] = acc[ii * dv + c] * inv;
      if (a.bf16) round_bf16_inplace(o + ii * a.ldo, static_cast<size_t>(dv));
    }
  });
}

// The reference: a query block's scores over every key it sees at once, [block, keys], then softmax.
void mla_attention_plain_reference(const MlaAttnArgs& a) {
  check_args(a);
  const MlaDims& d = a.dims;
  const int64_t dn = d.qk_nope, dr = d.qk_rope, dv = d.v_head, qw = dn + dr;
  MlaScratch own;
  const std::vector<PlainKv> kv = expand_plain(a, a.scratch != nullptr ? *a.scratch : own);
  parallel_items(work_items(a), [&](const WorkItem& w, std::vector<float>& scores) {
    const MlaSeq& s = a.seqs[static_cast<size_t>(w.seq)];
    const PlainKv& p = kv[static_cast<size_t>(w.seq)];
    const int64_t nb = w.i1 - w.i0, ns = s.prefix + w.i1;  // keys the block's last query sees
    scores.resize(static_cast<size_t>(nb * ns));
    const float* q = a.q + (s.q_row + w.i0) * a.ldq + w.head * qw;
    const float* kt = p.kt + w.head * dn * p.ldk;
    const float* v = p.v + w.head * (s.prefix + s.extend) * p.ldv;
    sgemm('N', 'N', nb, ns, dn, a.scale, q, a.ldq, kt, p.ldk, 0.0f, scores.data(), ns);
    sgemm('N', 'N', nb, ns, dr, a.scale, q + dn, a.ldq, p.rt, p.ldk, 1.0f, scores.data(), ns);
    causal_softmax(scores.data(), ns, nb, s, w.i0);
    float* o = a.o + (s.q_row + w.i0) * a.ldo + w.head * dv;
    sgemm('N', 'N', nb, dv, ns, 1.0f, scores.data(), ns, v, p.ldv, 0.0f, o, a.ldo);
    if (a.bf16)
      for (int64_t ii = 0; ii < nb; ++ii) round_bf16_inplace(o + ii * a.ldo, static_cast<size_t>(dv));
  });
}

// The absorbed form: a work item is a query block of one sequence and a group of heads, whose q~ rows are
// stacked into one [G * nb, R] matrix against the sequence's latent rows, which every head shares. So a
// decode step (nb = 1) multiplies a [G, R] block by the latent rows once per group, not once per head
// (one pass over the cache per group instead of a matrix-vector product per head).
//
// Three passes. 1: q~ of every item, head by head (threads split the heads): each head's W_UK [dn, R] is
// read from memory once per call and stays in the caches for every item, where an item at a time read
// every head's, the layer's whole kv_b (8 MB in fp32 at the real shapes), once per sequence: a decode
// batch of 16 read it 16 times. 2: per item, the scores, softmax and u = sum_s p_s c_hat_s. 3: o = W_UV u,
// head by head as pass 1. Every GEMM is the one a pass over items would run (the same operands and shape),
// so the results do not depend on the order.
void mla_attention_absorbed(const MlaAttnArgs& a) {
  check_args(a);
  const MlaDims& d = a.dims;
  const int64_t Hm = d.heads, dn = d.qk_nope, dr = d.qk_rope, dv = d.v_head, R = d.kv_lora;
  const int64_t lat = R + dr, qw = dn + dr;
  // Head groups: up to kMaxStacked stacked rows per item, and at most a thread's share of the heads, so
  // that one sequence's blocks keep every thread busy. G depends on the block and the thread count only,
  // never on the rest of the batch: the stacked GEMMs' M (and so oneDNN's blocking and sums) is the same
  // for a sequence alone as in any batch, so its rows are the same bits (the prefix cache and the serving
  // self-check rest on it).
  constexpr int64_t kMaxStacked = 256;
  const int64_t threads = std::max(1, omp_get_max_threads());
  const int64_t per_thread = (Hm + threads - 1) / threads;
  struct Item {
    int64_t seq, i0, i1, h0, h1;
    int64_t at;  // where its stacked [G * nb, R] q~ and u start in qt and u below
  };
  std::vector<Item> items;
  int64_t stacked = 0;
  for (int64_t b = 0; b < static_cast<int64_t>(a.seqs.size()); ++b)
    for (int64_t i0 = 0; i0 < a.seqs[b].extend; i0 += kQueryBlock) {
      const int64_t i1 = std::min(a.seqs[b].extend, i0 + kQueryBlock), nb = i1 - i0;
      const int64_t G = std::max<int64_t>(1, std::min({Hm, kMaxStacked / nb, per_thread}));
      for (int64_t h0 = 0; h0 < Hm; h0 += G) {
        const int64_t h1 = std::min(Hm, h0 + G);
        items.push_back({b, i0, i1, h0, h1, stacked});
        stacked += (h1 - h0) * nb;
      }
    }
  if (items.empty()) return;
  // Each item's q~, u ([M, R], row (g, ii)) and q_pe ([M, dr]), M = its heads x its queries.
  MlaScratch own;
  MlaScratch& sc = a.scratch ? *a.scratch : own;
  float* const qt = at_least(sc.qt, static_cast<size_t>(stacked * R));
  float* const u = at_least(sc.u, static_cast<size_t>(stacked * R));
  float* const qpe = at_least(sc.qpe, static_cast<size_t>(stacked * dr));
  // Items that hold head h, in order (an item's heads are contiguous, groups in head order).
  std::vector<std::vector<int64_t>> by_head(static_cast<size_t>(Hm));
  for (int64_t k = 0; k < static_cast<int64_t>(items.size()); ++k)
    for (int64_t h = items[static_cast<size_t>(k)].h0; h < items[static_cast<size_t>(k)].h1; ++h)
      by_head[static_cast<size_t>(h)].push_back(k);
  std::exception_ptr err;
  const auto keep = [&err] {
#pragma omp critical(mla_attention_error)
    if (!err) err = std::current_exception();
  };
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t h = 0; h < Hm; ++h) {
      try {
        const float* w_uk = a.w_kvb + h * (dn + dv) * R;  // [dn, R]
        for (const int64_t k : by_head[static_cast<size_t>(h)]) {
          const Item& w = items[static_cast<size_t>(k)];
          const MlaSeq& s = a.seqs[static_cast<size_t>(w.seq)];
          const int64_t nb = w.i1 - w.i0, r0 = w.at + (h - w.h0) * nb;
          const float* q = a.q + (s.q_row + w.i0) * a.ldq + h * qw;
          sgemm('N', 'N', nb, R, dn, 1.0f, q, a.ldq, w_uk, R, 0.0f, qt + r0 * R, R);
          for (int64_t ii = 0; ii < nb; ++ii) std::copy_n(q + ii * a.ldq + dn, dr, qpe + (r0 + ii) * dr);
        }
      } catch (...) {
        keep();
      }
    }
    // (the implicit barrier: every q~ written)
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < static_cast<int64_t>(items.size()); ++k) {
      try {
        const Item& w = items[static_cast<size_t>(k)];
        const MlaSeq& s = a.seqs[static_cast<size_t>(w.seq)];
        const int64_t nb = w.i1 - w.i0, ns = s.prefix + w.i1, M = (w.h1 - w.h0) * nb;
        scores.resize(static_cast<size_t>(M * ns));
        const float* qk = qt + w.at * R;
        sgemm('N', 'T', M, ns, R, a.scale, qk, R, s.latent, lat, 0.0f, scores.data(), ns);
        sgemm('N', 'T', M, ns, dr, a.scale, qpe + w.at * dr, dr, s.latent + R, lat, 1.0f, scores.data(), ns);
        for (int64_t h = w.h0; h < w.h1; ++h)
          causal_softmax(scores.data() + (h - w.h0) * nb * ns, ns, nb, s, w.i0);
        sgemm('N', 'N', M, R, ns, 1.0f, scores.data(), ns, s.latent, lat, 0.0f, u + w.at * R, R);
      } catch (...) {
        keep();
      }
    }
#pragma omp for schedule(static)
    for (int64_t h = 0; h < Hm; ++h) {
      try {
        const float* w_uv = a.w_kvb + (h * (dn + dv) + dn) * R;  // [dv, R]
        for (const int64_t k : by_head[static_cast<size_t>(h)]) {
          const Item& w = items[static_cast<size_t>(k)];
          const MlaSeq& s = a.seqs[static_cast<size_t>(w.seq)];
          const int64_t nb = w.i1 - w.i0;
          float* o = a.o + (s.q_row + w.i0) * a.ldo + h * dv;
          sgemm('N', 'T', nb, dv, R, 1.0f, u + (w.at + (h - w.h0) * nb) * R, R, w_uv, R, 0.0f, o, a.ldo);
          if (a.bf16)
            for (int64_t ii = 0; ii < nb; ++ii) round_bf16_inplace(o + ii * a.ldo, static_cast<size_t>(dv));
        }
      } catch (...) {
        keep();
      }
    }
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace kda::layers::attention::mla
