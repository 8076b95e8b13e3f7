#include "kda/layers/attention/mla/mla_attention.h"

#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/bf16_amx_block.h"
#include "kda/kernels/gemm/bf16_vnni.h"
#include "kda/kernels/gemm/f32_block.h"
#include "kda/kernels/online_softmax.h"
#include "kda/layers/linear.h"

namespace kda::layers::attention::mla {
namespace {

// Queries per work item: a block of a sequence's new tokens shares one pass over its keys.
constexpr int64_t kQueryBlock = 64;
// Keys per step of the flash-style plain kernel: a block's scores stay in L1/L2.
constexpr int64_t kKeyBlock = 256;
static_assert(kKeyBlock % kernels::gemm::kVnniBlockN == 0,
              "a key block starts a block of the bf16 keys' layout");

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

// The scores row s of new token i over the sequence's keys: the new tokens a verify tree hides from it
// (its visibility matrix, if any) set to -inf.
void mask_tree(float* s, const MlaSeq& seq, int64_t i) {
  if (!seq.visible) return;
  for (int64_t m = 0; m < i; ++m)
    if (!seq.visible[i * seq.extend + m]) s[seq.prefix + m] = -INFINITY;
}

// Row ii of a query block (new token i0 + ii) sees keys [0, prefix + i0 + ii]; with a visibility matrix,
// only those of the new tokens it names. Softmax in fp32, max-subtracted; masked entries become 0 so the
// block's value GEMM can run over every key.
void causal_softmax(float* scores, int64_t ld, int64_t rows, const MlaSeq& seq, int64_t i0) {
  for (int64_t ii = 0; ii < rows; ++ii) {
    float* s = scores + ii * ld;
    const int64_t i = i0 + ii, n = seq.prefix + i + 1;
    mask_tree(s, seq, i);
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

// causal_softmax's result through the vectorised step of kernels/online_softmax.h (one block spanning each
// row; the same masks, the same max-subtracted fp32 softmax, exp within 1.5 ulp of libm's): the absorbed
// form's, whose decode steps over a long context spend a large part of their time in exp otherwise.
// stats: 2 * rows values of scratch.
void causal_softmax_vec(float* scores, int64_t ld, int64_t rows, const MlaSeq& seq, int64_t i0,
                        std::vector<float>& stats) {
  for (int64_t ii = 0; ii < rows; ++ii) {
    float* s = scores + ii * ld;
    const int64_t i = i0 + ii, n = seq.prefix + i + 1;
    mask_tree(s, seq, i);
    std::fill(s + n, s + ld, -INFINITY);
  }
  stats.assign(static_cast<size_t>(2 * rows), 0.0f);
  float* mx = stats.data();
  float* l = mx + rows;
  std::fill(mx, mx + rows, -INFINITY);
  kernels::online_softmax_block(scores, ld, rows, 1.0f, mx, l, nullptr, 0);
  for (int64_t ii = 0; ii < rows; ++ii) {
    float* s = scores + ii * ld;
    const float inv = 1.0f / l[ii];
    for (int64_t j = 0; j < seq.prefix + i0 + ii + 1; ++j) s[j] *= inv;
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

// pool_rows: the caller is the absorbed form, whose decode rows may read the pool's rows in place.
void check_args(const MlaAttnArgs& a, bool pool_rows) {
  for (const MlaSeq& s : a.seqs) {
    const auto bad = [&s](const std::string& why) {
      throw std::invalid_argument("MLA attention: a sequence with prefix " + std::to_string(s.prefix) +
                                  ", extend " + std::to_string(s.extend) + " " + why);
    };
    if (s.prefix < 0 || s.extend < 0) bad("(negative)");
    if (s.prefix + s.extend == 0) continue;
    if (s.slots == nullptr) {
      if (!s.latent) bad("and no latent rows");
      continue;
    }
    if (s.latent) bad("has both latent rows and pool slots");
    if (!pool_rows || s.extend != 1)
      bad("reads pool rows in place, which only the absorbed form's decode rows (extend 1) do");
    if ((s.pool_f32 == nullptr) == (s.pool_bf16 == nullptr))
      bad(s.pool_f32 ? "has pool slots in two pools (fp32 and bf16)" : "has pool slots and no pool");
  }
  const int64_t kv_out = int64_t{a.dims.heads} * (a.dims.qk_nope + a.dims.v_head);
  if (a.kv_b != nullptr && (a.kv_b->in_features() != a.dims.kv_lora || a.kv_b->out_features() != kv_out))
    throw std::invalid_argument("MLA attention: kv_b's Linear is [" + std::to_string(a.kv_b->out_features()) +
                                ", " + std::to_string(a.kv_b->in_features()) + "], the dims want [" +
                                std::to_string(kv_out) + ", " + std::to_string(a.dims.kv_lora) + "]");
}

// A thread's buffers across its work items.
struct ThreadBuffers {
  std::vector<float> f;
  std::vector<bf16_t> b;
};

// Runs body(item, thread buffers) over the items in parallel; the first exception is rethrown after the
// region (none may escape it).
template <class Body>
void parallel_items(const std::vector<WorkItem>& items, Body&& body) {
  std::exception_ptr err;
#pragma omp parallel
  {
    ThreadBuffers scratch;
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

// A query block's pass over one key block [j0, j0 + kn) in the online softmax: scores s (times scale), masked
// as causal_softmax masks them, then the step of kernels/online_softmax.h: per row the running max mx and
// sum l, the output rows acc [nb, dv] rescaled to the new max; s left as the block's weights exp(s - max)
// (0 where masked).
void online_softmax_block(float* s, int64_t kn, int64_t nb, const MlaSeq& seq, int64_t i0, int64_t j0,
                          float scale, float* mx, float* l, float* acc, int64_t dv) {
  for (int64_t ii = 0; ii < nb; ++ii) {
    float* r = s + ii * kn;
    const int64_t i = i0 + ii, last = seq.prefix + i;  // the last key row ii sees
    for (int64_t jj = std::max<int64_t>(0, last + 1 - j0); jj < kn; ++jj) r[jj] = -INFINITY;
    if (seq.visible)
      for (int64_t jj = std::max<int64_t>(0, seq.prefix - j0); jj < kn && j0 + jj < last; ++jj)
        if (!seq.visible[i * seq.extend + (j0 + jj - seq.prefix)]) r[jj] = -INFINITY;
  }
  kernels::online_softmax_block(s, kn, nb, scale, mx, l, acc, dv);
}

// The expansion through kv_b, shared by both plain kernels: one sequence's keys and values (a threaded
// GEMM per head, or one bf16 GEMM over every head through MlaAttnArgs::kv_b) in the layouts the flash
// kernel's block GEMMs read in place, the expanded keys and values bf16-rounded in the bf16 mode (the layer's
// rounding point: kv_b's output), the rope keys as the cache holds them. Each head's values v [S, ldv]; the
// keys either
// - fp32 for gemm_f32_block: each head's nope keys transposed, kt [dn, ldk] (a column per key), and the rope
//   keys every head shares transposed, rt [dr, ldk]; or
// - bf16 for gemm_bf16_vnni (plain_bf16_keys): each head's [k_nope | k_pe] rows packed, kb [(dn + dr) * ldb]
//   with ldb the keys rounded up to the layout's block of 64 (padding keys 0); kt then holds one head's
//   nope keys at a time, on their way to kb.
struct PlainKv {
  int64_t ldk = 0, ldv = 0, ldb = 0;
  const float *kt = nullptr, *rt = nullptr, *v = nullptr;
  const bf16_t* kb = nullptr;
};

// b holding at least n values; grown without keeping its old values, never shrunk.
template <class T>
T* at_least(std::vector<T>& b, size_t n) {
  if (b.size() < n) {
    b.clear();
    b.shrink_to_fit();
    b.resize(n);
  }
  return b.data();
}

// The four buffers' values for one sequence of S keys (the layouts above; kt one head's with bf16 keys).
struct PlainKvSize {
  size_t kt, rt, v, kb, kv;
};
int64_t packed_keys(int64_t S) {
  return (S + kernels::gemm::kVnniBlockN - 1) / kernels::gemm::kVnniBlockN * kernels::gemm::kVnniBlockN;
}
PlainKvSize plain_kv_size(const MlaDims& d, int64_t S, bool bf16_keys, bool rows16) {
  const int64_t ldk = kernels::gemm::f32_block_ld(S), ldv = kernels::gemm::f32_block_ld(d.v_head);
  const size_t v = static_cast<size_t>(int64_t{d.heads} * S * ldv);
  if (bf16_keys && rows16)
    return {0, 0, v, static_cast<size_t>(int64_t{d.heads} * (d.qk_nope + d.qk_rope) * packed_keys(S)),
            static_cast<size_t>(int64_t{d.heads} * (d.qk_nope + d.v_head) * S)};
  if (bf16_keys)
    return {static_cast<size_t>(d.qk_nope * ldk), 0, v,
            static_cast<size_t>(int64_t{d.heads} * (d.qk_nope + d.qk_rope) * packed_keys(S)), 0};
  return {static_cast<size_t>(int64_t{d.heads} * d.qk_nope * ldk), static_cast<size_t>(d.qk_rope * ldk), v, 0,
          0};
}

// The rope keys' dr / 2 pair rows of block nb of one head's packed keys (blk, n of its keys real): copied
// from `rope` (head 0's kb, already packed) or, without it, taken from the latent rows.
void pack_rope(bf16_t* blk, int64_t nb, int64_t n, const float* latent, int64_t lat, int64_t R,
               const bf16_t* rope, int64_t dn, int64_t dr) {
  constexpr int64_t B = kernels::gemm::kVnniBlockN;
  const int64_t K = dn + dr;
  bf16_t* rb = blk + dn * B;
  if (rope != nullptr) {
    std::copy(rope + nb * B * K + dn * B, rope + nb * B * K + K * B, rb);
    return;
  }
  std::fill(rb, rb + dr * B, bf16_t{0});
  for (int64_t c = 0; c < n; ++c) {
    const float* k = latent + (nb * B + c) * lat + R;
    for (int64_t e = 0; e < dr; ++e) rb[(e / 2) * 2 * B + 2 * c + e % 2] = f32_to_bf16(k[e]);
  }
}

// One head's keys in gemm_bf16_vnni's layout (bf16_vnni.h: blocks of 64 keys, each (dn + dr) / 2 rows of 64
// keys x 2 inputs): the pairs of the nope keys kt [dn, ldk] (rounded to bf16 here), then those of the rope
// keys (pack_rope). Threads split the blocks.
void pack_keys(const float* kt, int64_t ldk, const float* latent, int64_t lat, int64_t R, const bf16_t* rope,
               int64_t dn, int64_t dr, int64_t S, int64_t ldb, bf16_t* kb) {
  constexpr int64_t B = kernels::gemm::kVnniBlockN;
  const int64_t K = dn + dr;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < ldb / B; ++nb) {
    bf16_t* blk = kb + nb * B * K;
    const int64_t n = std::min(B, S - nb * B);  // keys of this block; the rest padding
    for (int64_t p = 0; p < dn / 2; ++p) {
      const float* r0 = kt + 2 * p * ldk + nb * B;
      const float* r1 = r0 + ldk;
      bf16_t* d = blk + p * 2 * B;
      for (int64_t c = 0; c < n; ++c) {
        d[2 * c] = f32_to_bf16(r0[c]);
        d[2 * c + 1] = f32_to_bf16(r1[c]);
      }
      std::fill(d + 2 * n, d + 2 * B, bf16_t{0});
    }
    pack_rope(blk, nb, n, latent, lat, R, rope, dn, dr);
  }
}

// The same from kv_b's bf16 output rows kv [S, ldkv] (head h's k_nope at column h (dn + dv), its v after
// it): a key's input pairs are its row's consecutive 32-bit words. Its values widened into v [S, ldv].
void pack_keys_from_rows(const bf16_t* kv, int64_t ldkv, const float* latent, int64_t lat, int64_t R,
                         const bf16_t* rope, int64_t dn, int64_t dr, int64_t dv, int64_t S, int64_t ldb,
                         bf16_t* kb, float* v, int64_t ldv) {
  constexpr int64_t B = kernels::gemm::kVnniBlockN;
  const int64_t K = dn + dr;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < ldb / B; ++nb) {
    bf16_t* blk = kb + nb * B * K;
    const int64_t n = std::min(B, S - nb * B);
    for (int64_t c = 0; c < n; ++c) {
      const bf16_t* row = kv + (nb * B + c) * ldkv;
      for (int64_t p = 0; p < dn / 2; ++p)
        std::memcpy(blk + p * 2 * B + 2 * c, row + 2 * p, 2 * sizeof(bf16_t));
      bf16_to_f32_array(row + dn, v + (nb * B + c) * ldv, static_cast<size_t>(dv));
    }
    if (n < B)
      for (int64_t p = 0; p < dn / 2; ++p)
        std::fill(blk + p * 2 * B + 2 * n, blk + (p + 1) * 2 * B, bf16_t{0});
    pack_rope(blk, nb, n, latent, lat, R, rope, dn, dr);
  }
}

std::vector<PlainKv> expand_plain(const MlaAttnArgs& a, bool bf16_keys, MlaScratch& scratch) {
  const MlaDims& d = a.dims;
  const int64_t Hm = d.heads, dn = d.qk_nope, dr = d.qk_rope, dv = d.v_head, R = d.kv_lora, lat = R + dr;
  // Every sequence's share of the buffers, then the buffers once (with bf16 keys kt is one head's, reused).
  std::vector<PlainKv> out(a.seqs.size());
  // With kv_b as a bf16 Linear (MlaAttnArgs::kv_b) a sequence's kv_b output lands in scratch.kv, reused
  // by the next sequence, and kt is not needed.
  const bool rows16 = bf16_keys && a.kv_b != nullptr;
  const int64_t ldkv = int64_t{Hm} * (dn + dv);
  std::vector<size_t> kt_at(a.seqs.size()), rt_at(a.seqs.size()), v_at(a.seqs.size()), kb_at(a.seqs.size());
  size_t kt_n = 0, rt_n = 0, v_n = 0, kb_n = 0, kv_n = 0;
  for (size_t b = 0; b < a.seqs.size(); ++b) {
    const MlaSeq& s = a.seqs[b];
    const int64_t S = s.prefix + s.extend;
    if (s.extend == 0 || S == 0) continue;
    out[b].ldk = kernels::gemm::f32_block_ld(S);
    out[b].ldv = kernels::gemm::f32_block_ld(dv);
    out[b].ldb = packed_keys(S);
    const PlainKvSize n = plain_kv_size(d, S, bf16_keys, rows16);
    kt_at[b] = bf16_keys ? 0 : kt_n, rt_at[b] = rt_n, v_at[b] = v_n, kb_at[b] = kb_n;
    kt_n = bf16_keys ? std::max(kt_n, n.kt) : kt_n + n.kt;
    kv_n = std::max(kv_n, n.kv);
    rt_n += n.rt;
    v_n += n.v;
    kb_n += n.kb;
  }
  float* const kt_all = at_least(scratch.kt, kt_n);
  float* const rt_all = at_least(scratch.rt, rt_n);
  float* const v_all = at_least(scratch.v, v_n);
  bf16_t* const kb_all = at_least(scratch.kb, kb_n);
  bf16_t* const kv = at_least(scratch.kv, kv_n);
  for (size_t b = 0; b < a.seqs.size(); ++b) {
    const MlaSeq& s = a.seqs[b];
    const int64_t S = s.prefix + s.extend;
    if (s.extend == 0 || S == 0) continue;
    PlainKv& p = out[b];
    p.v = v_all + v_at[b];
    if (bf16_keys)
      p.kb = kb_all + kb_at[b];
    else
      p.kt = kt_all + kt_at[b], p.rt = rt_all + rt_at[b];
    if (rows16) {
      a.kv_b->forward(s.latent, S, lat, kv, ldkv);
      for (int64_t h = 0; h < Hm; ++h)
        pack_keys_from_rows(kv + h * (dn + dv), ldkv, s.latent, lat, R, h == 0 ? nullptr : kb_all + kb_at[b],
                            dn, dr, dv, S, p.ldb, kb_all + kb_at[b] + h * (dn + dr) * p.ldb,
                            v_all + v_at[b] + h * S * p.ldv, p.ldv);
      continue;
    }
    for (int64_t h = 0; h < Hm; ++h) {
      const float* w_uk = a.w_kvb + h * (dn + dv) * R;  // [dn, R]
      const float* w_uv = w_uk + dn * R;                // [dv, R]
      float* kt = kt_all + kt_at[b] + (bf16_keys ? 0 : h * dn * p.ldk);
      float* v = v_all + v_at[b] + h * S * p.ldv;
      sgemm('N', 'T', dn, S, R, 1.0f, w_uk, R, s.latent, lat, 0.0f, kt, p.ldk);
      sgemm('N', 'T', S, dv, R, 1.0f, s.latent, lat, w_uv, R, 0.0f, v, p.ldv);
      if (a.bf16)
        for (int64_t j = 0; j < S; ++j) round_bf16_inplace(v + j * p.ldv, static_cast<size_t>(dv));
      if (bf16_keys) {
        bf16_t* kb = kb_all + kb_at[b] + h * (dn + dr) * p.ldb;
        pack_keys(kt, p.ldk, s.latent, lat, R, h == 0 ? nullptr : kb_all + kb_at[b], dn, dr, S, p.ldb, kb);
      } else if (a.bf16) {
        for (int64_t c = 0; c < dn; ++c) round_bf16_inplace(kt + c * p.ldk, static_cast<size_t>(S));
      }
    }
    if (bf16_keys) continue;
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

bool plain_bf16_keys(const MlaDims& dims, bool bf16) {
  return bf16 && kernels::gemm::cpu_has_bf16_vnni() && dims.qk_nope % 2 == 0 && dims.qk_rope % 2 == 0 &&
         kernels::gemm::bf16_vnni_takes(dims.qk_nope + dims.qk_rope);
}

// Flash-style: a query block walks its keys in blocks of kKeyBlock with an online softmax (running max
// and sum per row, fp32), so the scores in memory are [block, kKeyBlock], never a row per key. The block
// GEMMs read the expanded keys and values in place and allocate nothing (f32_block.h says why).
void reserve_plain(const MlaDims& dims, int64_t keys, bool bf16, bool kv_b_linear, MlaScratch& scratch) {
  if (keys <= 0) return;
  const PlainKvSize n = plain_kv_size(dims, keys, plain_bf16_keys(dims, bf16), kv_b_linear);
  at_least(scratch.kt, n.kt);
  at_least(scratch.rt, n.rt);
  at_least(scratch.v, n.v);
  at_least(scratch.kb, n.kb);
  at_least(scratch.kv, n.kv);
}

void mla_attention_plain(const MlaAttnArgs& a) {
  check_args(a, false);
  const MlaDims& d = a.dims;
  const int64_t dn = d.qk_nope, dr = d.qk_rope, dv = d.v_head;
  const int64_t qw = dn + dr;
  MlaScratch own;
  const bool bf16_keys = plain_bf16_keys(d, a.bf16);
  // The bf16 scores on AMX tiles where the CPU has them (several times vdpbf16ps's rate), which read the
  // same packed keys.
  const bool amx = bf16_keys && kernels::gemm::bf16_amx_block_takes(qw);
  const std::vector<PlainKv> kv = expand_plain(a, bf16_keys, a.scratch != nullptr ? *a.scratch : own);
  parallel_items(work_items(a), [&](const WorkItem& w, ThreadBuffers& tb) {
    const MlaSeq& s = a.seqs[static_cast<size_t>(w.seq)];
    const PlainKv& p = kv[static_cast<size_t>(w.seq)];
    const int64_t nb = w.i1 - w.i0, ns = s.prefix + w.i1;  // keys the block's last query sees
    std::vector<float>& buf = tb.f;
    buf.resize(static_cast<size_t>(nb * kKeyBlock + nb * dv + 2 * nb));
    float* scores = buf.data();
    float* acc = scores + nb * kKeyBlock;
    float* mx = acc + nb * dv;
    float* l = mx + nb;
    std::fill(acc, acc + nb * dv, 0.0f);
    std::fill(mx, mx + nb, -INFINITY);
    std::fill(l, l + nb, 0.0f);
    const float* q = a.q + (s.q_row + w.i0) * a.ldq + w.head * qw;
    const float* v = p.v + w.head * (s.prefix + s.extend) * p.ldv;
    const bf16_t* qb = nullptr;
    if (bf16_keys) {  // the block's queries in bf16 (exact: q is a GEMM output, rounded in the bf16 mode)
      tb.b.resize(static_cast<size_t>(nb * qw));
      for (int64_t ii = 0; ii < nb; ++ii)
        f32_to_bf16_array(q + ii * a.ldq, tb.b.data() + ii * qw, static_cast<size_t>(qw));
      qb = tb.b.data();
    }
    for (int64_t j0 = 0; j0 < ns; j0 += kKeyBlock) {
      const int64_t kn = std::min(kKeyBlock, ns - j0);
      if (bf16_keys) {  // key block j0 starts a block of the layout (kKeyBlock is a multiple of its 64)
        const bf16_t* kb = p.kb + (w.head * p.ldb + j0) * qw;
        if (amx)
          kernels::gemm::gemm_bf16_amx_block(qb, nb, qw, kb, qw, kn, scores, kn);
        else
          kernels::gemm::gemm_bf16_vnni(qb, nb, qw, kb, qw, kn, scores, kn, 0);
      } else {
        const float* kt = p.kt + w.head * dn * p.ldk;
        kernels::gemm::gemm_f32_block(nb, kn, dn, 1.0f, q, a.ldq, kt + j0, p.ldk, 0.0f, scores, kn);
        kernels::gemm::gemm_f32_block(nb, kn, dr, 1.0f, q + dn, a.ldq, p.rt + j0, p.ldk, 1.0f, scores, kn);
      }
      online_softmax_block(scores, kn, nb, s, w.i0, j0, a.scale, mx, l, acc, dv);
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
  check_args(a, false);
  const MlaDims& d = a.dims;
  const int64_t dn = d.qk_nope, dr = d.qk_rope, dv = d.v_head, qw = dn + dr;
  MlaScratch own;
  const std::vector<PlainKv> kv = expand_plain(a, false, a.scratch != nullptr ? *a.scratch : own);
  parallel_items(work_items(a), [&](const WorkItem& w, ThreadBuffers& tb) {
    std::vector<float>& scores = tb.f;
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

void pool_rows_f32(const int32_t* slots, const float* pool_f32, const bf16_t* pool_bf16, int64_t row_len,
                   int64_t j0, int64_t n, int64_t c0, int64_t cols, float* dst, int64_t ld) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t at = int64_t{slots[j0 + j]} * row_len + c0;
    if (pool_f32)
      std::copy_n(pool_f32 + at, cols, dst + j * ld);
    else
      bf16_to_f32_array(pool_bf16 + at, dst + j * ld, static_cast<size_t>(cols));
  }
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
  check_args(a, true);
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
  // A sequence of one new token (a decode row) is one item of every head instead, whose scores and u the
  // threads share (decode_item below): its keys split for the scores, the heads for the softmax, the
  // latent columns for u. Each value is still summed by one thread in a fixed order, so its bits depend
  // neither on the batch nor on the thread count.
  struct Item {
    int64_t seq, i0, i1, h0, h1;
    int64_t at;  // where its stacked [G * nb, R] q~ and u start in qt and u below
    bool decode;
  };
  std::vector<Item> items;
  std::vector<int64_t> decodes;  // the decode items, in order
  int64_t stacked = 0, decode_keys = 0;
  for (int64_t b = 0; b < static_cast<int64_t>(a.seqs.size()); ++b) {
    const MlaSeq& s = a.seqs[static_cast<size_t>(b)];
    if (s.extend == 1) {
      decodes.push_back(static_cast<int64_t>(items.size()));
      items.push_back({b, 0, 1, 0, Hm, stacked, true});
      stacked += Hm;
      decode_keys = std::max(decode_keys, s.prefix + 1);
      continue;
    }
    for (int64_t i0 = 0; i0 < s.extend; i0 += kQueryBlock) {
      const int64_t i1 = std::min(s.extend, i0 + kQueryBlock), nb = i1 - i0;
      const int64_t G = std::max<int64_t>(1, std::min({Hm, kMaxStacked / nb, per_thread}));
      for (int64_t h0 = 0; h0 < Hm; h0 += G) {
        const int64_t h1 = std::min(Hm, h0 + G);
        items.push_back({b, i0, i1, h0, h1, stacked, false});
        stacked += (h1 - h0) * nb;
      }
    }
  }
  if (items.empty()) return;
  // A decode item's products with W_UK and W_UV read kv_b row by row in the format it is held in (row_gemv.h:
  // the same values as w_kvb, fewer bytes); oneDNN's sgemm at one row read it well under the bandwidth.
  const kernels::gemm::RowMatrix kvb =
      a.kv_b_rows.data != nullptr
          ? a.kv_b_rows
          : kernels::gemm::RowMatrix{kernels::gemm::RowFormat::F32, a.w_kvb, nullptr, Hm * (dn + dv), R};
  if (kvb.rows != Hm * (dn + dv) || kvb.cols != R)
    throw std::invalid_argument("mla_attention_absorbed: kv_b_rows is [" + std::to_string(kvb.rows) + ", " +
                                std::to_string(kvb.cols) + "], the heads need [" +
                                std::to_string(Hm * (dn + dv)) + ", " + std::to_string(R) + "]");
  // Each item's q~, u ([M, R], row (g, ii)) and q_pe ([M, dr]), M = its heads x its queries.
  MlaScratch own;
  MlaScratch& sc = a.scratch ? *a.scratch : own;
  float* const qt = at_least(sc.qt, static_cast<size_t>(stacked * R));
  float* const u = at_least(sc.u, static_cast<size_t>(stacked * R));
  float* const qpe = at_least(sc.qpe, static_cast<size_t>(stacked * dr));
  // A decode item's buffers (decode_item below): q~ and q_pe transposed ([R + dr, Hm]), the scores key by
  // key ([keys, Hm]) and the softmax weights head by head ([Hm, keys]). With many decode rows each thread
  // takes whole rows in a buffer of its own (no barrier per row: a batch of 16 short rows spent more time
  // in the four barriers of each than in its sums), while the threads' buffers stay small; otherwise
  // (few rows, or long contexts' rows, long enough to share) the threads share one buffer and each row.
  const size_t dec_size = static_cast<size_t>((lat + 2 * decode_keys) * Hm);
  constexpr size_t kSoloBufferBytes = size_t{64} << 20;
  const bool solo_decodes = static_cast<int64_t>(decodes.size()) >= 4 * threads &&
                            dec_size * sizeof(float) * static_cast<size_t>(threads) <= kSoloBufferBytes;
  float* const dec =
      decodes.empty() ? nullptr : at_least(sc.st, dec_size * static_cast<size_t>(solo_decodes ? threads : 1));
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
  // A decode item's scores, softmax and u into dec (its q~ transposed, scores and softmax weights):
  // shared, by every thread of the region (worksharing loops, each ending in a barrier), or solo, by the
  // calling thread alone. The same blocks and sums either way, each value summed by one thread in one
  // order: the bits do not depend on which.
  constexpr int64_t kDecodeKeys = 64, kDecodeCols = 64;  // keys and latent columns per share
  constexpr int64_t kDecodeRun = 256;                    // keys per run of u's sums
  const auto each = [](bool shared, int64_t n, int64_t step, const auto& body) {
    if (shared) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; i += step) body(i);
    } else {
      for (int64_t i = 0; i < n; i += step) body(i);
    }
  };
  const auto decode_item = [&](const Item& w, bool shared, float* dec, std::vector<float>& stats,
                               std::vector<float>& rows) {
    const MlaSeq& s = a.seqs[static_cast<size_t>(w.seq)];
    const int64_t ns = s.prefix + 1;
    float* const qT = dec;                   // [R + dr, Hm]: q~ then q_pe, transposed
    float* const sT = qT + lat * Hm;         // [ns, Hm]
    float* const pw = sT + ns * Hm;          // [Hm, ns]
    each(shared, lat, 16, [&](int64_t r0) {  // 16 columns at a time: their lines stay in L1 over the heads
      const int64_t r1 = std::min(lat, r0 + 16);
      for (int64_t h = 0; h < Hm; ++h)
        for (int64_t r = r0; r < r1; ++r)
          qT[r * Hm + h] = r < R ? qt[(w.at + h) * R + r] : qpe[(w.at + h) * dr + (r - R)];
    });
    each(shared, ns, kDecodeKeys, [&](int64_t j0) {
      try {
        const int64_t n = std::min(kDecodeKeys, ns - j0);
        const float* l0 = s.latent ? s.latent + j0 * lat : nullptr;
        if (!l0) {
          pool_rows_f32(s.slots, s.pool_f32, s.pool_bf16, lat, j0, n, 0, lat,
                        at_least(rows, static_cast<size_t>(n * lat)), lat);
          l0 = rows.data();
        }
        kernels::gemm::gemm_f32_block(n, Hm, R, a.scale, l0, lat, qT, Hm, 0.0f, sT + j0 * Hm, Hm);
        kernels::gemm::gemm_f32_block(n, Hm, dr, a.scale, l0 + R, lat, qT + R * Hm, Hm, 1.0f, sT + j0 * Hm,
                                      Hm);
      } catch (...) {
        keep();
      }
    });
    each(shared, Hm, 1, [&](int64_t h) {
      try {
        float* p = pw + h * ns;
        for (int64_t j = 0; j < ns; ++j) p[j] = sT[j * Hm + h];
        causal_softmax_vec(p, ns, 1, s, 0, stats);
      } catch (...) {
        keep();
      }
    });
    each(shared, R, kDecodeCols, [&](int64_t c0) {
      try {
        // In runs of kDecodeRun keys, each run's sums added to u's: a run's strip of latent columns stays in
        // L2 while the heads' row tiles pass it (over every key it would be streamed once per row tile).
        const int64_t n = std::min(kDecodeCols, R - c0), ldb = kernels::gemm::f32_block_ld(n);
        for (int64_t k0 = 0; k0 < ns; k0 += kDecodeRun) {
          const int64_t kn = std::min(kDecodeRun, ns - k0);
          if (s.latent) {
            kernels::gemm::gemm_f32_block(Hm, n, kn, 1.0f, pw + k0, ns, s.latent + k0 * lat + c0, lat,
                                          k0 == 0 ? 0.0f : 1.0f, u + w.at * R + c0, R);
          } else {  // the run's strip from the pool's rows
            pool_rows_f32(s.slots, s.pool_f32, s.pool_bf16, lat, k0, kn, c0, n,
                          at_least(rows, static_cast<size_t>(kn * ldb)), ldb);
            kernels::gemm::gemm_f32_block(Hm, n, kn, 1.0f, pw + k0, ns, rows.data(), ldb,
                                          k0 == 0 ? 0.0f : 1.0f, u + w.at * R + c0, R);
          }
        }
      } catch (...) {
        keep();
      }
    });
  };
#pragma omp parallel
  {
    // A head's decode rows, met by its slices of kv_b in one batched product (row_gemv.h).
    std::vector<const float*> xs;
    std::vector<float*> ys;
#pragma omp for schedule(static)
    for (int64_t h = 0; h < Hm; ++h) {
      try {
        const float* w_uk = a.w_kvb + h * (dn + dv) * R;  // [dn, R]
        xs.clear();
        ys.clear();
        for (const int64_t k : by_head[static_cast<size_t>(h)]) {
          const Item& w = items[static_cast<size_t>(k)];
          const MlaSeq& s = a.seqs[static_cast<size_t>(w.seq)];
          const int64_t nb = w.i1 - w.i0, r0 = w.at + (h - w.h0) * nb;
          const float* q = a.q + (s.q_row + w.i0) * a.ldq + h * qw;
          if (w.decode) {
            xs.push_back(q);
            ys.push_back(qt + r0 * R);
          } else {
            sgemm('N', 'N', nb, R, dn, 1.0f, q, a.ldq, w_uk, R, 0.0f, qt + r0 * R, R);
          }
          for (int64_t ii = 0; ii < nb; ++ii) std::copy_n(q + ii * a.ldq + dn, dr, qpe + (r0 + ii) * dr);
        }
        kernels::gemm::gemm_rows_xw(kvb, h * (dn + dv), dn, static_cast<int64_t>(xs.size()), xs.data(),
                                    ys.data());
      } catch (...) {
        keep();
      }
    }
    // (the implicit barrier: every q~ written)
    std::vector<float> scores, stats;  // scores: also a decode row's block of pool rows
    if (solo_decodes) {
      float* const own = dec + dec_size * static_cast<size_t>(omp_get_thread_num());
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < decodes.size(); ++i)
        decode_item(items[static_cast<size_t>(decodes[i])], false, own, stats, scores);
    } else {
      for (const int64_t k : decodes) decode_item(items[static_cast<size_t>(k)], true, dec, stats, scores);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < static_cast<int64_t>(items.size()); ++k) {
      try {
        const Item& w = items[static_cast<size_t>(k)];
        if (w.decode) continue;
        const MlaSeq& s = a.seqs[static_cast<size_t>(w.seq)];
        const int64_t nb = w.i1 - w.i0, ns = s.prefix + w.i1, M = (w.h1 - w.h0) * nb;
        scores.resize(static_cast<size_t>(M * ns));
        const float* qk = qt + w.at * R;
        sgemm('N', 'T', M, ns, R, a.scale, qk, R, s.latent, lat, 0.0f, scores.data(), ns);
        sgemm('N', 'T', M, ns, dr, a.scale, qpe + w.at * dr, dr, s.latent + R, lat, 1.0f, scores.data(), ns);
        for (int64_t h = w.h0; h < w.h1; ++h)
          causal_softmax_vec(scores.data() + (h - w.h0) * nb * ns, ns, nb, s, w.i0, stats);
        sgemm('N', 'N', M, R, ns, 1.0f, scores.data(), ns, s.latent, lat, 0.0f, u + w.at * R, R);
      } catch (...) {
        keep();
      }
    }
#pragma omp for schedule(static)
    for (int64_t h = 0; h < Hm; ++h) {
      try {
        const float* w_uv = a.w_kvb + (h * (dn + dv) + dn) * R;  // [dv, R]
        xs.clear();
        ys.clear();
        for (const int64_t k : by_head[static_cast<size_t>(h)]) {
          const Item& w = items[static_cast<size_t>(k)];
          const MlaSeq& s = a.seqs[static_cast<size_t>(w.seq)];
          const int64_t nb = w.i1 - w.i0;
          float* o = a.o + (s.q_row + w.i0) * a.ldo + h * dv;
          if (w.decode) {
            xs.push_back(u + (w.at + (h - w.h0)) * R);
            ys.push_back(o);
            continue;
          }
          sgemm('N', 'T', nb, dv, R, 1.0f, u + (w.at + (h - w.h0) * nb) * R, R, w_uv, R, 0.0f, o, a.ldo);
          if (a.bf16)
            for (int64_t ii = 0; ii < nb; ++ii) round_bf16_inplace(o + ii * a.ldo, static_cast<size_t>(dv));
        }
        kernels::gemm::gemm_rows_wx(kvb, h * (dn + dv) + dn, dv, static_cast<int64_t>(xs.size()), xs.data(),
                                    ys.data());
        if (a.bf16)
          for (float* o : ys) round_bf16_inplace(o, static_cast<size_t>(dv));
      } catch (...) {
        keep();
      }
    }
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace kda::layers::attention::mla
