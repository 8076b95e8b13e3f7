// KimiLinearForCausalLM on the tiny whole-model dumps (tests/data/model_dumps/tiny): every case within the
// spec's fp32 tolerances and its bf16 rule, the decode tail, a chunked prefill and a varlen batch against
// each sequence alone, both MoE combine modes against the float64 reference of each, tensor parallelism,
// and bad input (checkpoints, configs, ids, batches, pools) refused with nothing changed.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/distributed/in_process.h"
#include "kda/io/config.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/kernels/gemm/bf16_amx.h"
#include "kda/models/kimi_linear_case.h"
#include "kda/models/kimi_linear_model.h"
#include "support/model_checkpoint.h"
#include "support/model_dump_case.h"
#include "support/model_reference.h"
#include "support/small_model_config.h"
#include "support/test_support.h"

namespace kda {
namespace {

using models::KimiLinearForCausalLM;
using models::ModelCaseOptions;
using models::ModelOptions;
using models::run_model_case;
using testing::load_model_dump_case;
using testing::model_dump_case_names;
using testing::model_dumps_dir;

ModelOptions opts_of(Precision p, models::MoeCombine combine = models::MoeCombine::Unbiased) {
  ModelOptions o;
  o.precision = p;
  o.moe_combine = combine;
  return o;
}

bool all_finite(const std::vector<float>& v) {
  for (const float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

TEST(KimiLinearModel, TinyDumpsFp32EveryCase) {
  auto model = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), opts_of(Precision::FP32));
  ASSERT_EQ(model->num_layers(), 4);
  EXPECT_EQ(model->kda_layer_ids(), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(model->mla_layer_ids(), (std::vector<int>{3}));
  EXPECT_EQ(model->moe_layer_ids(), (std::vector<int>{1, 2, 3}));
  for (const auto& name : model_dump_case_names()) {
    const auto c = load_model_dump_case(name);
    const auto r = run_model_case(*model, c.input_ids, c.cu_seqlens);
    EXPECT_EQ(r.kda_recurrent_state.size(), 3u);
    EXPECT_EQ(r.mla_ckv.size(), 1u);
    testing::expect_case_fp32(r, c, "fp32 one prefill");
    // One EXTEND over every token: the MoE layers' last routing is the whole case's.
    for (const int id : model->moe_layer_ids()) {
      const auto want = c.npz.at("moe_topk_" + std::to_string(id)).to_i32();
      EXPECT_EQ(model->model().layer(id).moe()->last_topk(), want) << name << " layer " << id;
    }
  }
}

TEST(KimiLinearModel, TinyDumpsBf16WithinTwiceTheEmulation) {
  auto model = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), opts_of(Precision::BF16));
  for (const auto& name : model_dump_case_names()) {
    const auto c = load_model_dump_case(name);
    for (const int tail : {0, 8}) {
      if (tail > 0 && name != "decode_tail") continue;
      ModelCaseOptions o;
      o.decode_tail = tail;
      const auto r = run_model_case(*model, c.input_ids, c.cu_seqlens, o);
      ASSERT_TRUE(all_finite(r.logits)) << name;
      const auto ref = c.f32("logits"), emu = c.f32("logits_bf16");
      const double bound = 2.0 * testing::rel_l2(emu.data(), ref.data(), ref.size());
      const double err = testing::rel_l2(r.logits.data(), ref.data(), ref.size());
      EXPECT_LE(err, bound) << name << " decode tail " << tail;
      EXPECT_GT(err, 0.0) << name << ": bf16 should differ from float64 at all";
    }
  }
}

TEST(KimiLinearModel, DecodeTailAndChunkedPrefillEqualTheReference) {
  auto model = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), opts_of(Precision::FP32));
  {
    const auto c = load_model_dump_case("decode_tail");
    ModelCaseOptions o;
    o.decode_tail = 8;  // the case's 40-token prefill, then 8 DECODE steps
    testing::expect_case_fp32(run_model_case(*model, c.input_ids, c.cu_seqlens, o), c, "decode tail 8");
  }
  for (const auto& name : {"T200", "T65", "varlen_3"}) {
    const auto c = load_model_dump_case(name);
    ModelCaseOptions o;
    o.prefill_chunks = 3;
    testing::expect_case_fp32(run_model_case(*model, c.input_ids, c.cu_seqlens, o), c, "3 prefill chunks");
    if (std::string(name) == "T200") continue;  // (every step shape is a new GEMM shape: keep the run short)
    o.decode_tail = 5;  // chunks then decode steps: every path that continues a sequence
    testing::expect_case_fp32(run_model_case(*model, c.input_ids, c.cu_seqlens, o), c,
                              "3 chunks + 5 decodes");
  }
}

TEST(KimiLinearModel, VarlenBatchEqualsEachSequenceAlone) {
  auto model = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), opts_of(Precision::FP32));
  const auto c = load_model_dump_case("varlen_3");
  const auto batch = run_model_case(*model, c.input_ids, c.cu_seqlens);
  const int64_t V = model->vocab_size(), D = model->hidden_size();
  for (size_t i = 0; i + 1 < c.cu_seqlens.size(); ++i) {
    const int64_t b = c.cu_seqlens[i], e = c.cu_seqlens[i + 1];
    const std::vector<int32_t> ids(c.input_ids.begin() + b, c.input_ids.begin() + e);
    const auto alone = run_model_case(*model, ids, {});
    EXPECT_LE(testing::max_error_ratio(batch.logits.data() + b * V, alone.logits.data(), alone.logits.size(),
                                       1e-4, 1e-4),
              1.0)
        << "sequence " << i;
    EXPECT_LE(testing::max_error_ratio(batch.hidden_final.data() + b * D, alone.hidden_final.data(),
                                       alone.hidden_final.size(), 1e-4, 1e-4),
              1.0)
        << "sequence " << i;
  }
}

// Speculative decoding on the whole model, after a 40-token prefill: a verify row gives the reference's
// logits at its true positions; accepting a path leaves the KDA states and the MLA rows of 43 tokens, from
// which an EXTEND of the rest ends on the reference's final states. A chain (4 tokens, 3 accepted), and a
// tree whose second draft is a wrong sibling of the first.
TEST(KimiLinearModel, VerifyAndAcceptEqualTheReference) {
  auto model = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), opts_of(Precision::FP32));
  const auto c = load_model_dump_case("decode_tail");
  const int64_t D = model->hidden_size(), V = model->vocab_size(), T = 48;
  const auto want = c.f32("logits");
  const auto& ids = c.input_ids;
  for (const bool tree : {false, true}) {
    const std::string what = tree ? "tree" : "chain";
    auto pools = model->make_pools(1, 64, 5, 1);
    const auto req = pools->req_to_token_pool.alloc(1);
    std::vector<float> h(T * D), logits;
    auto expect_rows = [&](const std::vector<int64_t>& rows, const std::vector<int64_t>& pos,
                           const std::string& at) {
      logits.resize(rows.size() * V);
      model->compute_logits(h.data(), static_cast<int64_t>(rows.size()), logits.data());
      for (size_t i = 0; i < rows.size(); ++i) {
        if (pos[i] < 0) continue;  // a wrong draft: no reference row
        EXPECT_LE(testing::max_error_ratio(logits.data() + i * V, want.data() + pos[i] * V, V, 1e-4, 1e-4),
                  1.0)
            << what << " " << at << " row " << i;
      }
    };
    auto pre = model_executor::ForwardBatch::extend(req, {40}, {0});
    model->forward(ids.data(), 40, pre, *pools, h.data());
    std::vector<int32_t> row;
    std::vector<int64_t> pos;
    model_executor::ForwardBatch verify;
    int32_t accept_at = 0;
    if (!tree) {
      row = {ids[40], ids[41], ids[42], ids[43]};
      pos = {40, 41, 42, 43};
      verify = model_executor::ForwardBatch::target_verify(req, {3});
      accept_at = 2;  // tokens 40, 41, 42
    } else {
      // positions: 0 = token 40, 1 = token 41 (parent 40), 2 = a wrong sibling, 3 = token 42 (parent 1),
      // 4 = token 43 (parent 3); accepting position 3 keeps 0, 1, 3.
      row = {ids[40], ids[41], (ids[41] + 1) % static_cast<int32_t>(V), ids[42], ids[43]};
      pos = {40, 41, -1, 42, 43};
      verify = model_executor::ForwardBatch::target_verify(req, {4}, {-1, -1, 0, 2});
      accept_at = 3;
    }
    model->forward(row.data(), static_cast<int64_t>(row.size()), verify, *pools, h.data());
    expect_rows(std::vector<int64_t>(row.size()), pos, "verify");
    const std::vector<int32_t> accepted = {accept_at};
    model->accept(verify, accepted, *pools);
    EXPECT_EQ(pools->req_to_token_pool.seq_len(req[0]), 43) << what;
    auto rest = model_executor::ForwardBatch::extend(req, {5}, {43});
    model->forward(ids.data() + 43, 5, rest, *pools, h.data());
    expect_rows(std::vector<int64_t>(5), {43, 44, 45, 46, 47}, "after accept");
    const int32_t slot = pools->req_to_token_pool.slot_of(req[0]);
    const auto& pc = pools->recurrent_state_pool.config();
    std::vector<float> rec(size_t(pc.num_heads) * pc.head_k_dim * pc.head_v_dim);
    for (const int id : model->kda_layer_ids()) {
      pools->recurrent_state_pool.read_linear_recurrent_layer_cache(id, {&slot, 1}, rec.data(), nullptr);
      const auto ref = c.f32("kda_recurrent_state_" + std::to_string(id));
      EXPECT_LE(testing::max_error_ratio(rec.data(), ref.data(), ref.size(), 1e-5, 1e-5), 1.0)
          << what << " " << id;
    }
    const auto toks = pools->req_to_token_pool.req_to_token(req[0]);
    ASSERT_EQ(toks.size(), 48u);
    const int R = model->config().kv_lora_rank, r = model->config().qk_rope_head_dim;
    std::vector<float> ckv(48 * R), kpe(48 * r);
    pools->token_to_kv_pool->read_kv(3, toks, ckv.data(), kpe.data());
    const auto ref = c.f32("mla_ckv_3");
    EXPECT_LE(testing::max_error_ratio(ckv.data(), ref.data(), ref.size(), 1e-5, 1e-5), 1.0) << what;
  }
}

TEST(KimiLinearModel, BothMoeCombineModesMatchTheirReference) {
  const auto cfg = io::load_model_config(model_dumps_dir());
  const auto w = testing::read_model_weights(model_dumps_dir());
  const auto c = load_model_dump_case("varlen_3");
  for (const auto combine : {models::MoeCombine::Unbiased, models::MoeCombine::Biased}) {
    auto model = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), opts_of(Precision::FP32, combine));
    const auto r = run_model_case(*model, c.input_ids, c.cu_seqlens);
    testing::ModelReferenceOptions ro;
    ro.combine =
        combine == models::MoeCombine::Biased ? testing::RefCombine::Biased : testing::RefCombine::Unbiased;
    const auto ref = testing::reference_model(cfg, w, c.input_ids, c.cu_seqlens, ro);
    const std::vector<float> want(ref.logits.begin(), ref.logits.end());
    EXPECT_LE(testing::max_error_ratio(r.logits.data(), want.data(), want.size(), 1e-4, 1e-4), 1.0)
        << models::to_string(combine);
    if (combine == models::MoeCombine::Biased) {  // the option changes the result
      const auto unbiased = c.f32("logits");
      EXPECT_GT(testing::rel_l2(r.logits.data(), unbiased.data(), unbiased.size()), 1e-3);
    }
  }
}

TEST(KimiLinearModel, MlaOptionsReachTheLayer) {
  const auto c = load_model_dump_case("varlen_3");
  // Both attention forms equal the reference (and so each other) within the fp32 bound.
  for (const auto form : {models::MlaForm::Plain, models::MlaForm::Absorbed}) {
    auto o = opts_of(Precision::FP32);
    o.mla_form = form;
    auto m = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), o);
    testing::expect_case_fp32(run_model_case(*m, c.input_ids, c.cu_seqlens, ModelCaseOptions{3, 1, true}), c,
                              form == models::MlaForm::Plain ? "plain MLA" : "absorbed MLA");
  }
  // kv_norm_eps 1e-6 (the HF remote code's) against the reference with the same eps.
  auto o = opts_of(Precision::FP32);
  o.kv_norm_eps = 1e-6;
  auto m = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), o);
  const auto r = run_model_case(*m, c.input_ids, c.cu_seqlens);
  testing::ModelReferenceOptions ro;
  ro.kv_norm_eps = 1e-6;
  const auto ref =
      testing::reference_model(io::load_model_config(model_dumps_dir()),
                               testing::read_model_weights(model_dumps_dir()), c.input_ids, c.cu_seqlens, ro);
  const std::vector<float> want(ref.mla_ckv.at(3).begin(), ref.mla_ckv.at(3).end());
  EXPECT_LE(testing::max_error_ratio(r.mla_ckv.at(3).data(), want.data(), want.size(), 1e-5, 1e-5), 1.0);
  const std::vector<float> logits(ref.logits.begin(), ref.logits.end());
  EXPECT_LE(testing::max_error_ratio(r.logits.data(), logits.data(), logits.size(), 1e-4, 1e-4), 1.0);
  const auto dflt = c.f32("mla_ckv_3");  // the eps shows in the cache rows
  EXPECT_GT(testing::rel_l2(r.mla_ckv.at(3).data(), dflt.data(), dflt.size()), 1e-7);
}

TEST(KimiLinearModel, TensorParallel2EqualsTp1) {
  const auto c = load_model_dump_case("varlen_3");
  auto one = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), opts_of(Precision::FP32));
  const auto want = run_model_case(*one, c.input_ids, c.cu_seqlens, ModelCaseOptions{3, 2, false});
  distributed::InProcessGroup group(2);
  std::vector<std::vector<float>> logits(2);
  group.run([&](int rank, distributed::Communicator& comm) {
    auto o = opts_of(Precision::FP32);
    o.tp = {rank, 2, &comm};
    auto m = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), o);
    logits[rank] = run_model_case(*m, c.input_ids, c.cu_seqlens, ModelCaseOptions{3, 2, false}).logits;
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_LE(testing::max_error_ratio(logits[r].data(), want.logits.data(), want.logits.size(), 1e-4, 1e-4),
              1.0)
        << "rank " << r;
}

TEST(KimiLinearModel, ActiveParametersOfThe48bModelAreTheSpecs) {
  // The spec: 3.107 B per decoded token (LM head 0.377, experts 1.672, KDA 0.790, MLA 0.204, dense 0.064).
  const auto cfg = io::kimi_linear_48b_config();
  EXPECT_NEAR(static_cast<double>(models::kimi_linear_active_params(cfg)), 3.107e9, 1.5e6);
  // Fewer routed experts change only the router's share; the top-8 stay.
  const double fewer = static_cast<double>(models::kimi_linear_active_params(cfg, 0, 32));
  EXPECT_NEAR(fewer, 3.107e9 - 26.0 * (256 - 32) * (2304 + 1), 1.5e6);
}

TEST(KimiLinearModel, TheHeadInRowBlocksEqualsOneBlock) {
  const auto c = load_model_dump_case("T7");
  for (const auto p : {Precision::FP32, Precision::BF16}) {
    auto one = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), opts_of(p));
    auto o = opts_of(p);
    o.lm_head_block_rows = 100;  // 512 rows: 5 blocks of 100 and one of 12
    auto blocks = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), o);
    EXPECT_EQ(blocks->head_weight_bytes(), one->head_weight_bytes());
    const auto a = run_model_case(*one, c.input_ids, {}), b = run_model_case(*blocks, c.input_ids, {});
    EXPECT_EQ(a.hidden_final, b.hidden_final);
    EXPECT_LE(testing::max_error_ratio(b.logits.data(), a.logits.data(), a.logits.size(), 1e-6, 1e-6), 1.0);
  }
}

TEST(KimiLinearModel, TheHeadIsDenseUnlessAskedToQuantize) {
  const auto c = load_model_dump_case("T7");
  auto dense = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), opts_of(Precision::FP32));
  auto o = opts_of(Precision::FP32);
  o.weights = Weights::Int8;
  auto int8 = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), o);
  EXPECT_EQ(int8->head_weight_bytes(), dense->head_weight_bytes());  // --weights leaves the head dense
  EXPECT_LT(int8->weight_bytes(), dense->weight_bytes());
  o.quantize_lm_head = true;
  auto int8_head = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), o);
  EXPECT_LT(int8_head->head_weight_bytes(), dense->head_weight_bytes() / 3);
  const auto a = run_model_case(*int8, c.input_ids, {}), b = run_model_case(*int8_head, c.input_ids, {});
  EXPECT_EQ(a.hidden_final, b.hidden_final);
  const double d = testing::rel_l2(b.logits.data(), a.logits.data(), a.logits.size());
  EXPECT_GT(d, 0.0);
  EXPECT_LT(d, 2e-2);
}

TEST(KimiLinearModel, TiedEmbeddingsUseEmbedTokensAsTheHead) {
  auto cfg = io::load_model_config(model_dumps_dir());
  auto w = testing::read_model_weights(model_dumps_dir());
  w["lm_head.weight"] = w.at("model.embed_tokens.weight");
  const auto untied = testing::make_temp_dir("model_untied");
  testing::write_model_checkpoint(untied, cfg, w, 2);
  w.erase("lm_head.weight");
  cfg.tie_word_embeddings = true;
  const auto tied = testing::make_temp_dir("model_tied");
  testing::write_model_checkpoint(tied, cfg, w, 2);
  const auto c = load_model_dump_case("T7");
  auto a = KimiLinearForCausalLM::from_pretrained(untied, {});
  auto b = KimiLinearForCausalLM::from_pretrained(tied, {});
  const auto ra = run_model_case(*a, c.input_ids, {}), rb = run_model_case(*b, c.input_ids, {});
  EXPECT_EQ(ra.logits, rb.logits);
  const auto want = c.f32("logits");  // the dumps' own head differs: the tie is not a no-op
  EXPECT_GT(testing::rel_l2(rb.logits.data(), want.data(), want.size()), 1e-2);
}

// In the bf16 precision a dense head is built from bf16 rows as they are (a mapped BF16 lm_head, or the tied
// embedding) and otherwise from fp32 blocks: the same head, so the same logits bit for bit.
TEST(KimiLinearModel, TheHeadFromBf16RowsIsTheHeadFromTheirFp32Values) {
  auto cfg = io::load_model_config(model_dumps_dir());
  auto w = testing::read_model_weights(model_dumps_dir());
  io::StTensor head = w.at("lm_head.weight");
  for (float& v : head.values) v = bf16_to_f32(f32_to_bf16(v));
  const auto write = [&](const char* name, io::StDType head_dtype, bool tied) {
    head.dtype = head_dtype;
    w["lm_head.weight"] = head;
    w["model.embed_tokens.weight"] = head;  // one table for all three: the same hidden states
    io::KimiLinearConfig c = cfg;
    if (tied) {
      w.erase("lm_head.weight");
      c.tie_word_embeddings = true;
    }
    const auto dir = testing::make_temp_dir(name);
    testing::write_model_checkpoint(dir, c, w, 2);
    return dir;
  };
  const auto f32_head = write("head_f32", io::StDType::F32, false);
  const auto bf16_head = write("head_bf16", io::StDType::BF16, false);
  const auto tied = write("head_tied", io::StDType::BF16, true);
  const auto c = load_model_dump_case("T7");
  const auto logits = [&](const std::filesystem::path& dir) {
    return run_model_case(*KimiLinearForCausalLM::from_pretrained(dir, opts_of(Precision::BF16)), c.input_ids,
                          {})
        .logits;
  };
  const auto want = logits(f32_head);
  ASSERT_TRUE(all_finite(want));
  EXPECT_EQ(logits(bf16_head), want);
  EXPECT_EQ(logits(tied), want);
}

// A row's logits do not depend on the rows computed beside it where the head runs on the AMX kernel (a
// decode row alone and the same row in a verify batch agree bit for bit); elsewhere oneDNN's one-row and
// many-row kernels sum in their own orders, within fp32 rounding of each other. The head is counted once.
TEST(KimiLinearModel, ARowsLogitsAreThoseOfItsRowInABatch) {
  auto m = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), opts_of(Precision::BF16));
  const int64_t D = m->hidden_size(), V = m->vocab_size(), M = 5;
  EXPECT_EQ(m->weight_bytes(), m->model().weight_bytes() + m->head_weight_bytes());
  EXPECT_EQ(m->head_weight_bytes(), V * D * static_cast<int64_t>(sizeof(bf16_t)));
  const std::vector<float> h = testing::random_normal(static_cast<size_t>(M * D), 3);
  std::vector<float> batch(static_cast<size_t>(M * V)), one(static_cast<size_t>(V));
  m->compute_logits(h.data(), M, batch.data());
  ASSERT_TRUE(all_finite(batch));
  const bool amx = kernels::gemm::cpu_has_amx_bf16();
  for (int64_t r = 0; r < M; ++r) {
    m->compute_logits(h.data() + r * D, 1, one.data());
    const float* want = batch.data() + r * V;
    if (amx)
      EXPECT_EQ(std::vector<float>(one.begin(), one.end()), std::vector<float>(want, want + V))
          << "row " << r;
    else
      EXPECT_LE(testing::max_error_ratio(one.data(), want, static_cast<size_t>(V), 1e-5, 1e-5), 1.0)
          << "row " << r;
  }
}

TEST(KimiLinearModel, SyntheticIsSeededAndEqualAcrossTensorParallelism) {
  const auto cfg = io::load_model_config(model_dumps_dir());
  ModelOptions o;
  o.vocab = 300;
  o.num_experts = 4;
  const std::vector<int32_t> ids = {1, 5, 299, 7, 0, 42, 8, 9, 10, 11};
  const std::vector<int32_t> cu = {0, 3, 10};
  auto a = KimiLinearForCausalLM::synthetic(cfg, o, 7);
  EXPECT_EQ(a->vocab_size(), 300);
  EXPECT_EQ(a->model().layer(1).moe()->num_experts(), 4);
  EXPECT_LT(a->active_weight_bytes(), a->weight_bytes());
  const auto ra = run_model_case(*a, ids, cu, ModelCaseOptions{2, 1, false});
  ASSERT_TRUE(all_finite(ra.logits));
  const ModelCaseOptions same{2, 1, false};
  EXPECT_EQ(run_model_case(*KimiLinearForCausalLM::synthetic(cfg, o, 7), ids, cu, same).logits, ra.logits);
  EXPECT_NE(run_model_case(*KimiLinearForCausalLM::synthetic(cfg, o, 8), ids, cu, same).logits, ra.logits);
  o.num_layers = 2;  // the first two layers of the pattern: KDA only
  auto two = KimiLinearForCausalLM::synthetic(cfg, o, 7);
  EXPECT_EQ(two->num_layers(), 2);
  EXPECT_TRUE(two->mla_layer_ids().empty());
  EXPECT_EQ(two->make_pools(1, 8)->token_to_kv_pool, nullptr);
  o.num_layers = 0;
  distributed::InProcessGroup group(2);
  std::vector<std::vector<float>> logits(2);
  group.run([&](int rank, distributed::Communicator& comm) {
    auto ro = o;
    ro.tp = {rank, 2, &comm};
    auto m = KimiLinearForCausalLM::synthetic(cfg, ro, 7);
    logits[rank] = run_model_case(*m, ids, cu, ModelCaseOptions{2, 1, false}).logits;
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_LE(testing::max_error_ratio(logits[r].data(), ra.logits.data(), ra.logits.size(), 1e-4, 1e-4), 1.0)
        << "rank " << r;
}

// Minor page faults of one prefill of ids as a fresh request (its pools made beforehand).
int64_t prefill_faults(KimiLinearForCausalLM& m, const std::vector<int32_t>& ids) {
  const auto T = static_cast<int64_t>(ids.size());
  auto pools = m.make_pools(1, T);
  std::vector<float> h(static_cast<size_t>(T * m.hidden_size()), 0.0f);
  const auto reqs = pools->req_to_token_pool.alloc(1);
  auto fb = model_executor::ForwardBatch::extend(reqs, {static_cast<int32_t>(T)}, {0});
  rusage u0{}, u1{};
  getrusage(RUSAGE_SELF, &u0);
  m.forward(ids.data(), T, fb, *pools, h.data());
  getrusage(RUSAGE_SELF, &u1);
  EXPECT_TRUE(all_finite(h));
  return u1.ru_minflt - u0.ru_minflt;
}

// reserve(T) sizes and touches what a T-token prefill uses: a model's first prefill after it faults in
// little, one without it (the thread scratch already grown by the first) its own workspaces. Every layer
// kind (KDA, MLA, dense MLP, MoE), both precisions and the quantized projections' paths.
TEST(KimiLinearModel, ReserveTouchesTheWorkspacesOfTheFirstPrefill) {
  if (testing::kSanitizedMalloc) GTEST_SKIP() << "a sanitizer's allocator faults in its own bookkeeping";
  const auto cfg = kda::testing::small_model_config({1, 2, 3}, {4}, 512);
  constexpr int64_t T = 1024;
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) ids[i] = static_cast<int32_t>((i * 131 + 7) % 512);
  struct Mode {
    Precision precision;
    Weights weights;
  };
  for (const Mode md : {Mode{Precision::FP32, Weights::BF16}, Mode{Precision::BF16, Weights::BF16},
                        Mode{Precision::BF16, Weights::Int8}, Mode{Precision::BF16, Weights::Int4}}) {
    SCOPED_TRACE(std::string(to_string(md.precision)) + " precision, " + to_string(md.weights) + " weights");
    ModelOptions o;
    o.precision = md.precision;
    o.weights = md.weights;
    auto reserved = KimiLinearForCausalLM::synthetic(cfg, o, 7);
    reserved->reserve(T);
    const int64_t after_reserve = prefill_faults(*reserved, ids);
    const int64_t again = prefill_faults(*reserved, ids);
    const int64_t unreserved = prefill_faults(*KimiLinearForCausalLM::synthetic(cfg, o, 7), ids);
    // The model's own workspaces at these widths are thousands of pages; what reserve leaves is the
    // step's small per-call buffers and the fresh pools' pages, as in a second prefill, and in the fp32
    // precision oneDNN's fp32 matmul growing its own scratchpad on its first call at this row count
    // (out of reach: only a GEMM of that size grows it), about a third of the model's.
    const int64_t factor = md.precision == Precision::BF16 ? 4 : 2;
    EXPECT_GT(unreserved, factor * after_reserve)
        << after_reserve << " faults after reserve, " << again << " in a second prefill, " << unreserved
        << " without reserve";
    EXPECT_THROW(reserved->reserve(-1), std::invalid_argument);
  }
}

// --- bad input -------------------------------------------------------------------------------------

class KimiLinearModelBadInput : public ::testing::Test {
 protected:
  static std::filesystem::path copy_of_tiny(const std::string& tag, const testing::TensorMap& w) {
    const auto dir = testing::make_temp_dir(tag);
    testing::write_model_checkpoint(dir, io::load_model_config(model_dumps_dir()), w, 2);
    return dir;
  }
  static std::string error_of(const std::function<void()>& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  }
};

TEST_F(KimiLinearModelBadInput, MissingAndMisShapedTensorsNameTheKey) {
  auto w = testing::read_model_weights(model_dumps_dir());
  const std::string mla_key = "model.layers.3.self_attn.kv_b_proj.weight";
  const std::string norm_key = "model.layers.1.post_attention_layernorm.weight";
  {
    auto broken = w;
    broken.erase(mla_key);
    const auto dir = copy_of_tiny("model_missing", broken);
    const auto msg = error_of([&] { KimiLinearForCausalLM::from_pretrained(dir, {}); });
    EXPECT_NE(msg.find(mla_key), std::string::npos) << msg;
  }
  {
    auto broken = w;
    broken[norm_key].shape = {128, 2};  // 256 values, the wrong shape
    const auto dir = copy_of_tiny("model_misshaped", broken);
    const auto msg = error_of([&] { KimiLinearForCausalLM::from_pretrained(dir, {}); });
    EXPECT_NE(msg.find(norm_key), std::string::npos) << msg;
    EXPECT_NE(msg.find("[128, 2]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[256]"), std::string::npos) << msg;
  }
  {
    auto broken = w;
    broken.erase("lm_head.weight");
    const auto dir = copy_of_tiny("model_no_head", broken);
    const auto msg = error_of([&] { KimiLinearForCausalLM::from_pretrained(dir, {}); });
    EXPECT_NE(msg.find("lm_head.weight"), std::string::npos) << msg;
  }
}

TEST_F(KimiLinearModelBadInput, UnusedTensorsInOneWarning) {
  auto w = testing::read_model_weights(model_dumps_dir());
  w["model.layers.0.self_attn.rotary_emb.inv_freq"] = io::StTensor{{4}, {1, 2, 3, 4}, io::StDType::F32};
  w["model.extra.weight"] = io::StTensor{{2}, {1, 2}, io::StDType::F32};
  const auto dir = copy_of_tiny("model_unused", w);
  ::testing::internal::CaptureStderr();
  auto m = KimiLinearForCausalLM::from_pretrained(dir, {});
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("2 tensors not used"), std::string::npos) << err;
  EXPECT_NE(err.find("model.extra.weight"), std::string::npos) << err;
  EXPECT_NE(err.find("rotary_emb.inv_freq"), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
}

TEST_F(KimiLinearModelBadInput, ConfigsTheSpecDoesNotDefineAreRefusedNamingTheField) {
  const auto w = testing::read_model_weights(model_dumps_dir());
  const auto text = testing::read_file(model_dumps_dir() / "config.json");
  const std::vector<std::pair<std::string, std::string>> edits = {
      {"\"q_lora_rank\": null", "\"q_lora_rank\": 64"},
      {"\"mla_use_nope\": true", "\"mla_use_nope\": false"},
      {"\"moe_router_activation_func\": \"sigmoid\"", "\"moe_router_activation_func\": \"softmax\""},
      {"\"num_expert_group\": 1", "\"num_expert_group\": 2"},
  };
  for (const auto& [from, to] : edits) {
    const auto dir = copy_of_tiny("model_cfg", w);
    std::string t = text;
    const auto pos = t.find(from);
    ASSERT_NE(pos, std::string::npos) << from;
    t.replace(pos, from.size(), to);
    std::ofstream(dir / "config.json") << t;
    const std::string field = from.substr(1, from.find('"', 1) - 1);
    const auto msg = error_of([&] { KimiLinearForCausalLM::from_pretrained(dir, {}); });
    EXPECT_NE(msg.find(field), std::string::npos) << field << ": " << msg;
  }
}

TEST_F(KimiLinearModelBadInput, BadStepsChangeNothing) {
  auto model = KimiLinearForCausalLM::from_pretrained(model_dumps_dir(), opts_of(Precision::FP32));
  const int64_t D = model->hidden_size();
  auto pools = model->make_pools(2, 16);
  auto& rtp = pools->req_to_token_pool;
  const auto reqs = rtp.alloc(2);
  // A first step so that the requests hold state.
  std::vector<int32_t> ids = {1, 2, 3, 4, 5};
  std::vector<float> h(ids.size() * D);
  auto fb = model_executor::ForwardBatch::extend({reqs[0]}, {5}, {0});
  model->forward(ids.data(), 5, fb, *pools, h.data());
  const auto snapshot = [&] {
    std::vector<float> s;
    for (const int id : model->kda_layer_ids()) {
      const auto& pc = pools->recurrent_state_pool.config();
      std::vector<float> r(size_t(pc.num_heads) * pc.head_k_dim * pc.head_v_dim),
          cv(size_t(pc.conv_kernel - 1) * pc.conv_dim);
      const int32_t slot = rtp.slot_of(reqs[0]);
      pools->recurrent_state_pool.read_linear_recurrent_layer_cache(id, {&slot, 1}, r.data(), cv.data());
      s.insert(s.end(), r.begin(), r.end());
      s.insert(s.end(), cv.begin(), cv.end());
    }
    return s;
  };
  const auto before = snapshot();
  const int64_t free_before = pools->token_to_kv_pool->available();
  auto unchanged = [&](const std::string& what) {
    EXPECT_EQ(rtp.seq_len(reqs[0]), 5) << what;
    EXPECT_EQ(rtp.seq_len(reqs[1]), 0) << what;
    EXPECT_EQ(pools->token_to_kv_pool->available(), free_before) << what;
    EXPECT_EQ(snapshot(), before) << what;
  };
  {  // an id >= vocab_size
    std::vector<int32_t> bad = {7, static_cast<int32_t>(model->vocab_size())};
    auto b = model_executor::ForwardBatch::extend({reqs[0]}, {2}, {5});
    const auto msg = error_of([&] { model->forward(bad.data(), 2, b, *pools, h.data()); });
    EXPECT_NE(msg.find("token id 512"), std::string::npos) << msg;
    unchanged("id >= vocab");
  }
  {  // a negative id
    std::vector<int32_t> bad = {-1};
    auto b = model_executor::ForwardBatch::decode({reqs[0]});
    EXPECT_NE(error_of([&] { model->forward(bad.data(), 1, b, *pools, h.data()); }).find("token id -1"),
              std::string::npos);
    unchanged("negative id");
  }
  {  // input ids that disagree with the batch
    auto b = model_executor::ForwardBatch::extend({reqs[0]}, {3}, {5});
    EXPECT_NE(error_of([&] { model->forward(ids.data(), 2, b, *pools, h.data()); }).find("input ids"),
              std::string::npos);
    unchanged("T vs batch");
  }
  {  // a prefix that is not what the request holds
    auto b = model_executor::ForwardBatch::extend({reqs[0]}, {2}, {3});
    const auto msg = error_of([&] { model->forward(ids.data(), 2, b, *pools, h.data()); });
    EXPECT_NE(msg.find("extend_prefix_lens 3"), std::string::npos) << msg;
    unchanged("prefix");
  }
  {  // the MLA pool too small: 16 slots, 5 taken, 12 asked
    std::vector<int32_t> many(12, 3);
    std::vector<float> hh(12 * D);
    auto b = model_executor::ForwardBatch::extend({reqs[1]}, {12}, {0});
    const auto msg = error_of([&] { model->forward(many.data(), 12, b, *pools, hh.data()); });
    EXPECT_NE(msg.find("exhausted"), std::string::npos) << msg;
    unchanged("pool too small");
  }
  {  // cu_seqlens against input_ids
    std::vector<int32_t> cu = {0, 2, 4};
    EXPECT_NE(error_of([&] { run_model_case(*model, ids, cu); }).find("cu_seqlens ends at 4"),
              std::string::npos);
    cu = {0, 3, 2, 5};
    EXPECT_NE(error_of([&] { run_model_case(*model, ids, cu); }).find("cu_seqlens[2]"), std::string::npos);
  }
  // Still usable: the next real step goes on from the 5 tokens.
  std::vector<int32_t> more = {6, 7};
  auto b = model_executor::ForwardBatch::extend({reqs[0]}, {2}, {5});
  model->forward(more.data(), 2, b, *pools, h.data());
  EXPECT_EQ(rtp.seq_len(reqs[0]), 7);
}

}  // namespace
}  // namespace kda
