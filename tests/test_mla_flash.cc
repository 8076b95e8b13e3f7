// The flash-style plain MLA attention (mla_attention_plain: key blocks, online softmax) against its
// reference (mla_attention_plain_reference: a block's scores over every key, then softmax) at the real
// per-head widths: one long prompt (T past 2048, not a multiple of the blocks), several sequences with
// cached prefixes and extends of every size (0, 1, a block, past a key block), a verify tree, keys whose
// scores grow along the sequence (the running max moves at every key block), fp32 and bf16.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/common/isa.h"
#include "kda/kernels/gemm/row_gemv.h"
#include "kda/kernels/online_softmax.h"
#include "kda/kernels/online_softmax_isa.h"
#include "kda/layers/attention/mla/mla_attention.h"
#include "kda/layers/linear.h"
#include "support/compact_rows.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace mla = layers::attention::mla;
using testing::random_normal;

struct SeqSpec {
  int64_t prefix, extend;
  bool tree = false;
};

void check_against(const std::vector<float>& o, const std::vector<float>& oref, int64_t T, int64_t ow,
                   int64_t ldo, bool bf16, bool kv_flips, const std::string& what);

// Runs both kernels on the sequences and compares o elementwise: fp32 within 1e-5 of the row's scale
// (the sums' order differs), bf16 within one bf16 step of |b| more (a sum on either side of a rounding
// boundary).
void compare(const std::vector<SeqSpec>& specs, bool bf16, float ramp, const std::string& what) {
  const mla::MlaDims d{4, 128, 64, 128, 512};
  const int64_t lat = d.kv_lora + d.qk_rope, qw = d.qk_nope + d.qk_rope, ow = d.heads * d.v_head;
  const int64_t ldq = d.heads * qw + 5, ldo = ow + 3;
  int64_t T = 0, L = 0;
  for (const SeqSpec& s : specs) {
    T += s.extend;
    L += s.prefix + s.extend;
  }
  std::vector<float> q = random_normal(static_cast<size_t>(std::max<int64_t>(T, 1) * ldq), 11, 2.0f);
  std::vector<float> latent = random_normal(static_cast<size_t>(std::max<int64_t>(L, 1) * lat), 12);
  std::vector<float> w =
      random_normal(static_cast<size_t>(d.heads * (d.qk_nope + d.v_head) * d.kv_lora), 13, 0.05f);
  if (bf16) {
    round_bf16_inplace(q.data(), q.size());
    round_bf16_inplace(latent.data(), latent.size());
    round_bf16_inplace(w.data(), w.size());
  }
  std::vector<mla::MlaSeq> seqs;
  std::vector<std::vector<uint8_t>> vis(specs.size());
  std::mt19937 rng(7);
  int64_t row = 0, at = 0;
  for (size_t b = 0; b < specs.size(); ++b) {
    const SeqSpec& s = specs[b];
    const int64_t S = s.prefix + s.extend;
    for (int64_t p = 0; p < S; ++p)  // later keys larger: the running max keeps moving
      for (int64_t c = 0; c < lat; ++c)
        latent[(at + p) * lat + c] *= 1.0f + ramp * static_cast<float>(p) / 512;
    if (s.tree) {  // token i's parent a random earlier token (or the prefix): it sees its ancestors, itself
      vis[b].assign(static_cast<size_t>(s.extend * s.extend), 0);
      std::vector<int64_t> parent(static_cast<size_t>(s.extend), -1);
      for (int64_t i = 0; i < s.extend; ++i) {
        parent[i] = i == 0 ? -1 : static_cast<int64_t>(rng() % static_cast<uint32_t>(i + 1)) - 1;
        for (int64_t m = i; m >= 0; m = parent[m]) vis[b][i * s.extend + m] = 1;
      }
    }
    seqs.push_back({row, s.prefix, s.extend, latent.data() + at * lat, s.tree ? vis[b].data() : nullptr});
    row += s.extend;
    at += S;
  }
  std::vector<float> oref(static_cast<size_t>(std::max<int64_t>(T, 1) * ldo), 5.0f);
  mla::MlaAttnArgs a{d, q.data(), ldq, seqs, w.data(), 1.0f / std::sqrt(192.0f), bf16, oref.data(), ldo};
  mla::mla_attention_plain_reference(a);
  // bf16: the expansion through kv_b's sgemm per head, and through kv_b as a bf16 Linear.
  const layers::Linear kv_b(d.kv_lora, d.heads * (d.qk_nope + d.v_head), w, Precision::BF16);
  for (const layers::Linear* linear : {static_cast<const layers::Linear*>(nullptr), &kv_b}) {
    if (linear && !bf16) break;
    std::vector<float> o(oref.size(), 5.0f);
    a.o = o.data();
    a.kv_b = linear;
    mla::mla_attention_plain(a);
    check_against(o, oref, T, ow, ldo, bf16, linear != nullptr, what + (linear ? " kv_b Linear" : ""));
  }
  // A kv_b Linear of other dims is refused before anything is written.
  const layers::Linear wrong(d.kv_lora, d.heads * d.qk_nope,
                             std::vector<float>(d.kv_lora * d.heads * d.qk_nope), Precision::BF16);
  std::vector<float> o(oref.size(), 5.0f);
  a.o = o.data();
  a.kv_b = &wrong;
  testing::expect_throw_with<std::invalid_argument>([&] { mla::mla_attention_plain(a); }, "kv_b's Linear");
  for (float x : o) ASSERT_EQ(x, 5.0f);
}

// o against the reference's oref elementwise (compare's bounds); the padding between rows untouched.
// kv_flips: the two expansions sum kv_b's products in different orders, so a kv value at a rounding
// boundary lands one bf16 step apart; o, a weighted average of the values, then moves by up to 2^-8 of
// their scale (taken as the row's largest |o|), beyond its own rounding.
void check_against(const std::vector<float>& o, const std::vector<float>& oref, int64_t T, int64_t ow,
                   int64_t ldo, bool bf16, bool kv_flips, const std::string& what) {
  // The sums' rounding scales with the values summed, not with a result that cancels: the bound takes
  // the row's largest output as its scale.
  int bad = 0;
  double worst = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    float scale = 0.0f;
    for (int64_t c = 0; c < ow; ++c) scale = std::max(scale, std::fabs(oref[t * ldo + c]));
    for (int64_t c = 0; c < ldo; ++c) {
      const float x = o[t * ldo + c], r = oref[t * ldo + c];
      if (c >= ow) {  // the padding between rows is left as it was
        if (x != 5.0f) ++bad;
        continue;
      }
      const double fp32 = 1e-5 * (1.0 + scale),
                   tol = bf16 ? std::ldexp(std::fabs(r), -7) + fp32 + (kv_flips ? std::ldexp(scale, -8) : 0.0)
                              : fp32;
      if (!(std::fabs(x - r) <= tol)) ++bad;
      worst = std::max(worst, std::fabs(static_cast<double>(x) - r) / fp32);
    }
  }
  std::printf("[mla flash] %s: worst |a - b| / (1e-5 (1 + the row's max |b|)) %.2e\n", what.c_str(), worst);
  EXPECT_EQ(bad, 0) << what;
}

TEST(MlaFlash, OneLongPromptEqualsTheReference) {
  for (bool bf16 : {false, true}) compare({{0, 2100}}, bf16, 0.0f, bf16 ? "T=2100 bf16" : "T=2100 fp32");
}

TEST(MlaFlash, PrefixesAndExtendsOfEverySize) {
  const std::vector<SeqSpec> specs{{0, 300}, {700, 65}, {1500, 1}, {3, 0}, {256, 256}, {0, 1}, {511, 257}};
  for (bool bf16 : {false, true}) compare(specs, bf16, 0.0f, bf16 ? "varlen bf16" : "varlen fp32");
}

TEST(MlaFlash, GrowingScoresMoveTheRunningMax) { compare({{0, 1100}, {900, 130}}, false, 3.0f, "ramp fp32"); }

TEST(MlaFlash, VerifyTreesMaskAsTheReference) {
  compare({{10, 6, true}, {300, 40, true}, {0, 70, true}}, false, 0.0f, "trees fp32");
}

// The online softmax step (kernels/online_softmax.h) of every ISA copy in the build that this CPU runs
// against its reference: rows of several widths (a vector and its tail), rows partly masked, a row masked
// whole on its first block (left untouched) and after one (rescaled by 1), running maxima below and above
// the block's, and scores far enough below the max that exp underflows (0 in both).
TEST(MlaFlash, OnlineSoftmaxStepEqualsTheReference) {
  using Step = void (*)(float*, int64_t, int64_t, float, float*, float*, float*, int64_t);
  std::vector<std::pair<Step, const char*>> copies{{&kernels::online_softmax_block, "dispatch"},
                                                   {&kernels::portable::online_softmax_block, "portable"}};
#if defined(KDA_WITH_AVX2)
  if (isa_available(Isa::Avx2)) copies.emplace_back(&kernels::avx2::online_softmax_block, "avx2");
#endif
#if defined(KDA_WITH_AVX512)
  if (isa_available(Isa::Avx512)) copies.emplace_back(&kernels::avx512::online_softmax_block, "avx512");
#endif
  const int64_t rows = 6, dv = 37;
  for (const auto& [step, name] : copies)
    for (int64_t n : {1, 15, 16, 17, 256}) {
      std::vector<float> s = random_normal(static_cast<size_t>(rows * n), static_cast<uint64_t>(n), 4.0f);
      for (int64_t j = n / 2; j < n; ++j) s[1 * n + j] = -INFINITY;             // a causal tail
      for (int64_t j = 0; j < n; ++j) s[2 * n + j] = s[3 * n + j] = -INFINITY;  // masked whole
      s[4 * n + n - 1] = -2000.0f;                                              // exp underflows
      std::vector<float> mx{-INFINITY, 1.0f, -INFINITY, 0.5f, 30.0f, -2.0f},
          l{0.0f, 2.0f, 0.0f, 3.0f, 1.5f, 7.0f};
      std::vector<float> acc = random_normal(static_cast<size_t>(rows * dv), 99);
      for (int64_t c = 0; c < dv; ++c) acc[2 * dv + c] = 0.0f;
      std::vector<float> s2(s), mx2(mx), l2(l), acc2(acc);
      step(s.data(), n, rows, 0.125f, mx.data(), l.data(), acc.data(), dv);
      kernels::online_softmax_block_reference(s2.data(), n, rows, 0.125f, mx2.data(), l2.data(), acc2.data(),
                                              dv);
      const std::string what = std::string(name) + " n " + std::to_string(n);
      EXPECT_LE(testing::max_error_ratio(s.data(), s2.data(), s.size(), 1e-30, 4e-7), 1.0) << what;
      EXPECT_LE(testing::max_error_ratio(l.data(), l2.data(), l.size(), 1e-30, 1e-6), 1.0) << what;
      EXPECT_LE(testing::max_error_ratio(acc.data(), acc2.data(), acc.size(), 1e-30, 4e-7), 1.0) << what;
      EXPECT_EQ(mx, mx2) << what;
      EXPECT_EQ(mx[2], -INFINITY) << what;  // untouched
      EXPECT_EQ(l[2], 0.0f) << what;
      for (int64_t j = 0; j < n; ++j) {
        EXPECT_EQ(s[2 * n + j], 0.0f) << what;
        EXPECT_EQ(s[3 * n + j], 0.0f) << what;
      }
      for (int64_t j = n / 2; j < n; ++j) EXPECT_EQ(s[1 * n + j], 0.0f) << what;
    }
}

// The absorbed form's decode rows (one new token: the keys, heads and latent columns shared out over the
// threads, u summed in runs of keys) against the plain reference: contexts within one run and across
// several, beside an extend in the same call, 4 heads (a part of a column strip) and the real 32.
// The absorbed decode tests' inputs: `heads` heads at the real widths, the sequences' (prefix, extend), q
// and kv_b's weights drawn from `seed`.
struct DecodeCase {
  mla::MlaDims d;
  std::vector<std::pair<int64_t, int64_t>> specs;
  int64_t lat, qw, ow, T = 0, L = 0;
  std::vector<float> q, w;
  DecodeCase(int heads, std::vector<std::pair<int64_t, int64_t>> sequences, uint64_t seed)
      : d{heads, 128, 64, 128, 512},
        specs(std::move(sequences)),
        lat(d.kv_lora + d.qk_rope),
        qw(d.heads * (d.qk_nope + d.qk_rope)),
        ow(d.heads * d.v_head) {
    for (const auto& [prefix, extend] : specs) T += extend, L += prefix + extend;
    q = random_normal(static_cast<size_t>(T * qw), seed, 2.0f);
    w = random_normal(static_cast<size_t>(d.heads * (d.qk_nope + d.v_head) * d.kv_lora), seed + 2, 0.05f);
  }
  // The sequences over `latent` (every sequence's rows, gathered in order).
  std::vector<mla::MlaSeq> gathered(const std::vector<float>& latent) const {
    std::vector<mla::MlaSeq> seqs;
    for (int64_t row = 0, at = 0; const auto& [prefix, extend] : specs) {
      seqs.push_back({row, prefix, extend, latent.data() + at * lat, nullptr});
      row += extend;
      at += prefix + extend;
    }
    return seqs;
  }
};

TEST(MlaFlash, AbsorbedDecodeRowsEqualThePlainReference) {
  for (const int heads : {4, 32}) {
    const DecodeCase c(heads, {{700, 1}, {0, 1}, {255, 1}, {100, 5}, {1030, 1}}, 21);
    const auto& [d, specs, lat, qw, ow, T, L, q, w] = c;
    const std::vector<float> latent = random_normal(static_cast<size_t>(L * lat), 22);
    const std::vector<mla::MlaSeq> seqs = c.gathered(latent);
    std::vector<float> o(static_cast<size_t>(T * ow)), ref(o);
    mla::MlaAttnArgs a{d, q.data(), qw, seqs, w.data(), 1.0f / std::sqrt(192.0f), false, o.data(), ow};
    mla::mla_attention_absorbed(a);
    a.o = ref.data();
    mla::mla_attention_plain_reference(a);
    EXPECT_LE(testing::max_error_ratio(o.data(), ref.data(), o.size(), 1e-5, 1e-4), 1.0) << heads << " heads";
  }
}

// kv_b held compact for the decode rows (MlaAttnArgs::kv_b_rows: int8 / int4 packed, bf16) gives the bits
// of its fp32 values as w_kvb, decode rows beside an extend; a kv_b_rows of another shape is refused
// before o is written.
TEST(MlaFlash, AbsorbedDecodeRowsFromACompactKvbGiveTheFp32Bits) {
  const DecodeCase c(32, {{300, 1}, {0, 1}, {100, 5}, {70, 1}}, 41);
  const auto& [d, specs, lat, qw, ow, T, L, q, w] = c;
  const std::vector<float> latent = random_normal(static_cast<size_t>(L * lat), 42);
  const std::vector<mla::MlaSeq> seqs = c.gathered(latent);
  const int64_t rows = d.heads * (d.qk_nope + d.v_head), R = d.kv_lora;
  for (const kernels::gemm::RowFormat f :
       {kernels::gemm::RowFormat::BF16, kernels::gemm::RowFormat::Int8, kernels::gemm::RowFormat::Int4}) {
    const auto compact = testing::compact_rows(f, w, rows, R);
    const std::vector<float>& values = compact->values;  // the compact copy's values, fp32
    for (const bool bf16 : {false, true}) {
      std::vector<float> want(static_cast<size_t>(T * ow)), got(want);
      mla::MlaAttnArgs a{d,    q.data(),    qw, seqs, values.data(), 1.0f / std::sqrt(192.0f),
                         bf16, want.data(), ow};
      mla::mla_attention_absorbed(a);
      a.o = got.data();
      a.kv_b_rows = compact->view;
      mla::mla_attention_absorbed(a);
      EXPECT_EQ(got, want) << testing::row_format_name(f) << (bf16 ? ", bf16 mode" : ", fp32 mode");
    }
  }
  std::vector<float> o(static_cast<size_t>(T * ow), 3.0f);
  mla::MlaAttnArgs a{d, q.data(), qw, seqs, w.data(), 1.0f / std::sqrt(192.0f), false, o.data(), ow};
  a.kv_b_rows = {kernels::gemm::RowFormat::F32, w.data(), nullptr, rows - 1, R};
  EXPECT_THROW(mla::mla_attention_absorbed(a), std::invalid_argument);
  EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float v) { return v == 3.0f; }));
}

// A decode row of the absorbed form reading the pool's rows in place (MlaSeq::slots, rows scattered over
// the pool in a random order, fp32 and bf16 pools) gives the bits of the same rows gathered into latent,
// beside an extend that stays gathered; contexts within a block of keys, across runs and 4 and 32 heads.
// Sequences that may not read pool rows are refused before o is written.
TEST(MlaFlash, AbsorbedDecodeRowsReadThePoolInPlaceAsGathered) {
  for (const int heads : {4, 32})
    for (const bool bf16 : {false, true}) {
      const std::string what = std::to_string(heads) + (bf16 ? " heads, bf16 pool" : " heads, fp32 pool");
      const DecodeCase c(heads, {{700, 1}, {0, 1}, {100, 5}, {1030, 1}, {63, 1}}, 31);
      const auto& [d, specs, lat, qw, ow, T, L, q, w] = c;
      // The pool: slot 0 unused, every other slot one position of one sequence, in a random order.
      const int64_t slots = L + 1;
      std::vector<float> pool = random_normal(static_cast<size_t>(slots * lat), 32);
      if (bf16) round_bf16_inplace(pool.data(), pool.size());
      std::vector<bf16_t> pool16(pool.size());
      f32_to_bf16_array(pool.data(), pool16.data(), pool.size());
      std::vector<int32_t> order(static_cast<size_t>(L));
      for (int64_t i = 0; i < L; ++i) order[i] = static_cast<int32_t>(i + 1);
      std::shuffle(order.begin(), order.end(), std::mt19937(5));
      std::vector<float> latent(static_cast<size_t>(L * lat));
      for (int64_t i = 0; i < L; ++i) std::copy_n(pool.data() + order[i] * lat, lat, latent.data() + i * lat);
      std::vector<mla::MlaSeq> gathered, in_place;
      for (int64_t row = 0, at = 0; const auto& [prefix, extend] : specs) {
        gathered.push_back({row, prefix, extend, latent.data() + at * lat, nullptr});
        mla::MlaSeq s = gathered.back();
        if (extend == 1) {
          s.latent = nullptr;
          s.slots = order.data() + at;
          if (bf16)
            s.pool_bf16 = pool16.data();
          else
            s.pool_f32 = pool.data();
        }
        in_place.push_back(s);
        row += extend;
        at += prefix + extend;
      }
      std::vector<float> want(static_cast<size_t>(T * ow), 5.0f), got(want);
      mla::MlaAttnArgs a{d,    q.data(),    qw, gathered, w.data(), 1.0f / std::sqrt(192.0f),
                         bf16, want.data(), ow};
      mla::mla_attention_absorbed(a);
      a.seqs = in_place;
      a.o = got.data();
      mla::mla_attention_absorbed(a);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), sizeof(float) * got.size()), 0) << what;
      // Refused, o untouched: pool rows in the plain form and its reference, for an extend, with no pool
      // or with both, beside latent rows.
      std::vector<float> o(want.size(), 5.0f);
      a.o = o.data();
      testing::expect_throw_with<std::invalid_argument>([&] { mla::mla_attention_plain(a); },
                                                        "only the absorbed form's decode rows");
      testing::expect_throw_with<std::invalid_argument>([&] { mla::mla_attention_plain_reference(a); },
                                                        "only the absorbed form's decode rows");
      const auto refused = [&](mla::MlaSeq s, const char* why) {
        std::vector<mla::MlaSeq> one{s};
        a.seqs = one;
        testing::expect_throw_with<std::invalid_argument>([&] { mla::mla_attention_absorbed(a); }, why);
      };
      mla::MlaSeq s = in_place[0];
      s.extend = 2;
      refused(s, "only the absorbed form's decode rows");
      s = in_place[0];
      s.pool_f32 = nullptr;
      s.pool_bf16 = nullptr;
      refused(s, "no pool");
      s.pool_f32 = pool.data();
      s.pool_bf16 = pool16.data();
      refused(s, "two pools");
      s = in_place[0];
      s.latent = latent.data();
      refused(s, "both latent rows and pool slots");
      s = in_place[0];
      s.slots = nullptr;
      refused(s, "no latent rows");
      for (float x : o) ASSERT_EQ(x, 5.0f) << what;
    }
}

// A scratch kept across calls (as a layer keeps one) gives the bits of a call's own buffers, whatever the
// calls before left in it: a large call, then smaller ones over a scratch filled with NaN (padding and stale
// rows must not be read), then a larger one that grows it, in both kernels.
TEST(MlaFlash, AScratchKeptAcrossCallsGivesTheBitsOfOwnBuffers) {
  const mla::MlaDims d{4, 128, 64, 128, 512};
  const int64_t lat = d.kv_lora + d.qk_rope, qw = d.heads * (d.qk_nope + d.qk_rope), ow = d.heads * d.v_head;
  const std::vector<float> w =
      random_normal(static_cast<size_t>(d.heads * (d.qk_nope + d.v_head) * d.kv_lora), 13, 0.05f);
  mla::MlaScratch scratch;
  const std::vector<std::vector<std::pair<int64_t, int64_t>>> calls{{{0, 600}, {100, 90}},
                                                                    {{0, 70}},
                                                                    {{30, 5}, {0, 1}},
                                                                    {{0, 900}, {500, 200}, {3, 0}},
                                                                    {{700, 1}, {40, 1}}};
  // The plain form and its reference keep their expanded keys and values there, the absorbed form its q~,
  // u and q_pe.
  const std::vector<std::pair<void (*)(const mla::MlaAttnArgs&), const char*>> forms{
      {mla::mla_attention_plain, "plain"},
      {mla::mla_attention_plain_reference, "plain reference"},
      {mla::mla_attention_absorbed, "absorbed"}};
  for (size_t k = 0; k < calls.size(); ++k)
    for (const auto& [form, name] : forms) {
      int64_t T = 0, L = 0;
      for (const auto& [prefix, extend] : calls[k]) T += extend, L += prefix + extend;
      const std::vector<float> q = random_normal(static_cast<size_t>(T * qw), 30 + k, 2.0f);
      const std::vector<float> latent = random_normal(static_cast<size_t>(L * lat), 40 + k);
      std::vector<mla::MlaSeq> seqs;
      for (int64_t row = 0, at = 0; const auto& [prefix, extend] : calls[k]) {
        seqs.push_back({row, prefix, extend, latent.data() + at * lat, nullptr});
        row += extend;
        at += prefix + extend;
      }
      std::vector<float> own(static_cast<size_t>(T * ow), 0.0f), kept(own);
      mla::MlaAttnArgs a{d, q.data(), qw, seqs, w.data(), 1.0f / std::sqrt(192.0f), true, own.data(), ow};
      form(a);
      for (auto* b :
           {&scratch.kt, &scratch.rt, &scratch.v, &scratch.qt, &scratch.u, &scratch.qpe, &scratch.st})
        std::fill(b->begin(), b->end(), NAN);
      std::fill(scratch.kb.begin(), scratch.kb.end(), bf16_t{0x7FC0});  // NaN
      a.o = kept.data();
      a.scratch = &scratch;
      form(a);
      EXPECT_EQ(std::memcmp(own.data(), kept.data(), own.size() * sizeof(float)), 0)
          << "call " << k << " (" << name << ")";
    }
  EXPECT_FALSE(scratch.kt.empty());
  EXPECT_FALSE(scratch.qt.empty());
  EXPECT_EQ(scratch.kb.empty(), !mla::plain_bf16_keys(d, true));  // the bf16 keys where the CPU takes them
}

// A sequence's output rows are the same bits alone and in any batch, in both forms: what the serving
// self-check and the prefix cache rest on (a request re-run alone, or resumed from cached rows, attends
// as it did in its batch). Each sequence's q and latent rows are generated from its own seed.
TEST(MlaFlash, EachSequencesRowsAreTheSameBitsAloneAndInABatch) {
  const mla::MlaDims d{32, 128, 64, 128, 512};  // the real head count: the absorbed form groups heads
  const int64_t lat = d.kv_lora + d.qk_rope, qw = d.heads * (d.qk_nope + d.qk_rope), ow = d.heads * d.v_head;
  const std::vector<float> w =
      random_normal(static_cast<size_t>(d.heads * (d.qk_nope + d.v_head) * d.kv_lora), 13, 0.05f);
  struct Seq {
    std::vector<float> q, latent;
    int64_t prefix, extend;
  };
  // Run the sequences [first, last) as one batch; their o rows, in order.
  auto run = [&](const std::vector<Seq>& all, size_t first, size_t last, bool absorbed) {
    std::vector<float> q, latent;
    std::vector<mla::MlaSeq> seqs;
    int64_t row = 0;
    for (size_t b = first; b < last; ++b) {
      q.insert(q.end(), all[b].q.begin(), all[b].q.end());
      latent.insert(latent.end(), all[b].latent.begin(), all[b].latent.end());
    }
    for (size_t b = first, at = 0; b < last; ++b) {
      seqs.push_back({row, all[b].prefix, all[b].extend, latent.data() + at, nullptr});
      row += all[b].extend;
      at += all[b].latent.size();
    }
    std::vector<float> o(static_cast<size_t>(row * ow), 0.0f);
    const mla::MlaAttnArgs a{d, q.data(), qw, seqs, w.data(), 1.0f / std::sqrt(192.0f), false, o.data(), ow};
    if (absorbed)
      mla::mla_attention_absorbed(a);
    else
      mla::mla_attention_plain(a);
    return o;
  };
  // Decode rows of several sequences (a few, which the threads share row by row, and more than four per
  // thread, which each thread takes whole, with kv_b's products batched over 8-row blocks and the rest), and
  // short extends on cached prefixes (the prefix cache's case).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> batches{
      {{40, 1}, {7, 1}, {700, 1}, {130, 1}, {64, 1}, {1, 1}},
      {{128, 9}, {128, 20}, {128, 5}},
      {{0, 70}, {64, 3}, {200, 1}}};
  std::vector<std::pair<int64_t, int64_t>> many;
  for (int i = 0; i < 4 * omp_get_max_threads() + 3; ++i) many.push_back({(i * 37) % 300, 1});
  batches.push_back(many);
  for (const bool absorbed : {false, true})
    for (size_t k = 0; k < batches.size(); ++k) {
      std::vector<Seq> all;
      for (const auto& [prefix, extend] : batches[k]) {
        const uint64_t seed = 100 + all.size();
        all.push_back({random_normal(static_cast<size_t>(extend * qw), seed, 2.0f),
                       random_normal(static_cast<size_t>((prefix + extend) * lat), seed + 50), prefix,
                       extend});
      }
      const std::vector<float> batch = run(all, 0, all.size(), absorbed);
      size_t at = 0;
      for (size_t b = 0; b < all.size(); ++b) {
        const std::vector<float> alone = run(all, b, b + 1, absorbed);
        const bool same =
            std::equal(alone.begin(), alone.end(), batch.begin() + static_cast<std::ptrdiff_t>(at));
        EXPECT_TRUE(same) << (absorbed ? "absorbed" : "plain") << ", batch " << k << ", sequence " << b;
        at += alone.size();
      }
    }
}

}  // namespace
}  // namespace kda
