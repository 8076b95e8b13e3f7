// MLA attention (NoPE) over the latent cache, in two forms with one signature (kimi-linear-model.md,
// "MLA attention (NoPE)"):
//
// - plain (the reference form): each sequence's attended tokens are expanded through kv_b,
//   kv_s = W_kvb c_hat_s (k_nope | v per head), then score = (q_nope . k_nope + q_pe . k_pe) * scale,
//   o = sum_s softmax(score)_s v_s.
// - absorbed: W_UK folded into the query, q~ = W_UK[h]^T q_nope (R values), score = (q~ . c_hat_s +
//   q_pe . k_pe_s) * scale, u = sum_s p_s c_hat_s, o = W_UV[h] u. Exact here because nothing is rotated.
//
// Cost per head, for E new tokens over a sequence of S = prefix + E tokens (s_avg = prefix + E/2
// attended tokens per query on average, causal): plain expands every attended token, S * R * (dn + dv),
// then E * s_avg * (dn + dr + dv); absorbed projects each query in and out, E * R * (dn + dv), then
// E * s_avg * (2R + dr). The expansion dominates when E is small beside S (decode, a short extend on a
// long cached prefix), the per-token latent width 2R + dr (1088) vs dn + dr + dv (320) when E is close
// to S (a whole-prompt prefill): prefer_absorbed() compares the two. Timing both forms of the layer at the
// real shapes (Hm 32, R 512, dn 128, dr 64, dv 128; fp32 and bf16; a 2048-token prefill, decode at 1k-8k
// of context in batches of 1 and 16, extends of 128 and 512 tokens on a 4k prefix) agrees with the model:
// absorbed wins decode by an order of magnitude, plain wins the whole-prompt prefill and the 512-token
// extend, and the 128-token extend on 4k, which the model calls absorbed, is a near tie.
//
// Both forms: softmax in fp32, max-subtracted, causal within a sequence (new token i sits at position
// prefix + i and sees positions 0..prefix + i; with a visibility matrix, the prefix and the new tokens it
// names). bf16: o is rounded before o_proj in both; the plain
// form rounds kv (a GEMM output, a spec rounding point); the absorbed form has no kv and keeps its own
// intermediates (q~, u) fp32. GEMM-shaped work goes through oneDNN's sgemm and the block GEMMs of
// kernels/gemm (f32_block.h, bf16_vnni.h, bf16_amx_block.h), OpenMP over (sequence, head, query block); the
// absorbed form's decode rows (one new token each) share their keys, heads and latent columns out over the
// threads instead.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/row_gemv.h"

namespace kda::layers {
class Linear;
}

namespace kda::layers::attention::mla {

struct MlaDims {
  int heads = 0;    // Hm on this rank
  int qk_nope = 0;  // dn
  int qk_rope = 0;  // dr
  int v_head = 0;   // dv
  int kv_lora = 0;  // R
};

// One sequence of the batch: its new tokens are rows [q_row, q_row + extend) of q and o; latent holds
// all its prefix + extend tokens' cache rows (c_hat | k_pe, R + dr values each) in position order.
struct MlaSeq {
  int64_t q_row = 0;
  int64_t prefix = 0;
  int64_t extend = 0;
  const float* latent = nullptr;
  // Speculative verify trees: [extend, extend] row-major, visible[i * extend + m] != 0 when new token i
  // attends to new token m (its ancestors and itself; every m <= i). Null: causal (a chain).
  const uint8_t* visible = nullptr;
  // In place of latent, for a decode row (extend 1) of the absorbed form only: the rows where the KV pool
  // keeps them, position s at row slots[s] of pool_f32 or of pool_bf16 (one of the two; rows of R + dr
  // values). The decode row reads them a block at a time in their stored width, where a gather into
  // latent writes every row in fp32 and reads it back (a long context's rows from memory three times).
  const int32_t* slots = nullptr;
  const float* pool_f32 = nullptr;
  const bf16_t* pool_bf16 = nullptr;
};

// Where the plain form keeps the keys and values it expands through kv_b for a call (every head's, of each
// sequence). A layer that passes the same one to every call touches those pages once, not on every
// prefill; without one (nullptr) a call expands into buffers of its own, freed on return.
struct MlaScratch {
  std::vector<float> kt, rt, v;
  std::vector<bf16_t> kb;  // the plain form's bf16 keys (plain_bf16_keys): every head's, of each sequence
  std::vector<bf16_t> kv;  // the plain form's kv_b output of one sequence through MlaAttnArgs::kv_b
  std::vector<float> qt, u, qpe;  // the absorbed form's q~, u and q_pe of a call's every query and head
  std::vector<float> st;          // the absorbed form's decode rows: q~ transposed, scores, softmax weights
};

// Whether mla_attention_plain multiplies queries by keys in bf16 (vdpbf16ps, or AMX tiles where the CPU has
// them; fp32 sums): in the bf16 mode on a CPU with AVX512_BF16, where q (a GEMM output), the expanded
// k_nope (kv_b's output) and k_pe (a cache entry) are bf16 values already, so each product is exact and
// only the order of the fp32 sums changes. The keys are then packed per head as [k_nope | k_pe] in the
// layout of gemm_bf16_vnni (kernels/gemm/bf16_vnni.h), which gemm_bf16_amx_block reads as it is; the
// values stay fp32 (the softmax weights they meet are not rounded).
bool plain_bf16_keys(const MlaDims& dims, bool bf16);

// `scratch` grown to the plain form's expanded keys and values of one sequence of `keys` keys (in the
// layout that `bf16` picks, plain_bf16_keys; with kv_b_linear, MlaAttnArgs::kv_b's output too), and
// touched: a layer sizes it at load for its longest prefill (KimiMLAAttention::reserve).
void reserve_plain(const MlaDims& dims, int64_t keys, bool bf16, bool kv_b_linear, MlaScratch& scratch);

struct MlaAttnArgs {
  MlaDims dims;
  const float* q = nullptr;  // [T, heads * (dn + dr)], row stride ldq: per head q_nope | q_pe
  int64_t ldq = 0;
  std::span<const MlaSeq> seqs;
  const float* w_kvb = nullptr;  // [heads * (dn + dv), R]: the kv_b weights the layer multiplies by
  float scale = 0.0f;            // 1 / sqrt(dn + dr)
  bool bf16 = false;             // the bf16 mode's rounding points
  float* o = nullptr;            // [T, heads * dv], row stride ldo; rows of the sequences' new tokens written
  int64_t ldo = 0;
  MlaScratch* scratch = nullptr;  // the plain form's expanded keys and values, the absorbed form's q~ and u
                                  // (above); not shared between threads
  // Optional, the bf16 mode: kv_b as a bf16 Linear of exactly w_kvb's values (bf16 weights). Where
  // plain_bf16_keys holds, the plain form then expands a sequence's keys and values in one bf16 GEMM over
  // every head (exact products, fp32 sums, each output rounded to bf16 as kv_b's output is) in place of an
  // fp32 sgemm per head, which runs at a fraction of the bf16 GEMM's rate.
  const Linear* kv_b = nullptr;
  // Optional: kv_b as the absorbed form's decode rows read it (row_gemv.h), w_kvb's values exactly in a
  // compact format (the int8 / int4 packing or bf16), [heads * (dn + dv), R]. None (data null): w_kvb's
  // fp32 rows. Either way the decode rows' products are the same (row_gemv.h widens each row to them).
  kernels::gemm::RowMatrix kv_b_rows = {};
};

// The plain form flash-style: each (sequence, head, block of 64 queries) walks its keys in blocks of 256
// with an online softmax (a running max and sum per query, fp32; the output rows rescaled when the max
// grows), so no score row spans every key; the scores in bf16 where plain_bf16_keys says so.
// mla_attention_plain_reference is the same form with a block's scores over all the keys it sees, then a
// plain softmax: the reference the tests compare it with (the same sums up to fp32 rounding order).
// Rows [j0, j0 + n) of a sequence's pool rows (position s at row slots[s] of pool_f32 or, where it is
// null, of pool_bf16; rows of row_len values), columns [c0, c0 + cols) of each, into dst [n, ld] as fp32:
// the gather a layer runs into MlaSeq::latent, and the absorbed form's decode rows a block at a time.
void pool_rows_f32(const int32_t* slots, const float* pool_f32, const bf16_t* pool_bf16, int64_t row_len,
                   int64_t j0, int64_t n, int64_t c0, int64_t cols, float* dst, int64_t ld);

// Each takes latent rows for every sequence, but mla_attention_absorbed also a decode row's pool rows
// (MlaSeq::slots); std::invalid_argument for a sequence without the rows it needs, before o is written.
void mla_attention_plain(const MlaAttnArgs& a);
void mla_attention_plain_reference(const MlaAttnArgs& a);
void mla_attention_absorbed(const MlaAttnArgs& a);

// Whether the absorbed form does less work for a sequence of `extend` new tokens after `prefix` cached
// ones (the cost model above).
bool prefer_absorbed(const MlaDims& d, int64_t prefix, int64_t extend);

}  // namespace kda::layers::attention::mla
