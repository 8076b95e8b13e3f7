// Head-sharded tensor parallelism of KimiDeltaAttention, with ranks as threads of one process
// (InProcessGroup): TP 2 and TP 4 equal TP 1 within the fp32 tolerance for EXTEND, DECODE and varlen
// batches with initial states, and for the prefill -> decode invariance; per-rank pool memory is 1/N.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "kda/distributed/in_process.h"
#include "kda/distributed/shard_layout.h"
#include "kda/io/config.h"
#include "kda/io/npy.h"
#include "kda/io/safetensors.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/models/kimi_linear.h"
#include "kda/runtime/layer_runner.h"
#include "support/test_support.h"

namespace kda {
namespace {

using ::testing::HasSubstr;

struct Mini {
  io::KimiLinearConfig cfg = io::load_config(testing::dumps_dir());
  io::Checkpoint ckpt{testing::dumps_dir()};
};

// Runs the case on `tp` thread-ranks; returns every rank's result (each holds the whole output and
// the whole states).
std::vector<runtime::LayerResult> run_tp(const Mini& m, const runtime::LayerCase& c, int tp, int decode_tail,
                                         Precision p = Precision::FP32) {
  distributed::InProcessGroup group(tp);
  std::vector<runtime::LayerResult> out(tp);
  std::vector<std::string> errors(tp);
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r)
    threads.emplace_back([&, r] {
      try {
        auto comm = group.member(r);
        auto layer = models::KimiDeltaAttention::from_checkpoint(m.ckpt, m.cfg, 0, p, {r, tp, comm.get()});
        out[r] = runtime::run_layer_case(*layer, m.cfg, c, decode_tail, kernels::KernelImpl::Auto);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < tp; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return out;
}

void expect_close(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_LE(testing::max_error_ratio(a.data(), b.data(), a.size(), 1e-5, 1e-5), 1.0) << what;
}

class TpCase : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {};

TEST_P(TpCase, EqualsTp1) {
  const auto& [name, tp, tail] = GetParam();
  Mini m;
  const auto c = runtime::LayerCase::from_npz(io::read_npz(testing::dumps_dir() / (name + ".npz")), m.cfg);
  const auto ref = run_tp(m, c, 1, tail).front();
  const auto got = run_tp(m, c, tp, tail);
  for (int r = 0; r < tp; ++r) {
    expect_close(got[r].out, ref.out, "out, rank " + std::to_string(r));
    expect_close(got[r].recurrent_state, ref.recurrent_state, "recurrent state, rank " + std::to_string(r));
    expect_close(got[r].conv_state, ref.conv_state, "conv state, rank " + std::to_string(r));
  }
}

// EXTEND only (tail 0), and prefill -> decode (tail 8: the last 8 tokens of each sequence as DECODE
// steps), on varlen batches with initial states.
INSTANTIATE_TEST_SUITE_P(Mini, TpCase,
                         ::testing::Combine(::testing::Values("varlen_initstate", "unbalanced_5_17_1_41",
                                                              "single_T128_initstate"),
                                            ::testing::Values(2, 4), ::testing::Values(0, 8)),
                         [](const auto& i) {
                           return std::get<0>(i.param) + "_tp" + std::to_string(std::get<1>(i.param)) +
                                  "_tail" + std::to_string(std::get<2>(i.param));
                         });

TEST(TensorParallel, Bf16MatchesTp1) {
  Mini m;
  const auto c =
      runtime::LayerCase::from_npz(io::read_npz(testing::dumps_dir() / "varlen_initstate.npz"), m.cfg);
  const auto ref = run_tp(m, c, 1, 8, Precision::BF16).front();
  const auto got = run_tp(m, c, 2, 8, Precision::BF16);
  // bf16 rounds after the all-reduce; the partial sums differ in order only.
  EXPECT_LE(testing::rel_l2(got[0].out.data(), ref.out.data(), ref.out.size()), 5e-3);
}

TEST(TensorParallel, InvarianceHoldsUnderTp) {
  Mini m;
  const auto c =
      runtime::LayerCase::from_npz(io::read_npz(testing::dumps_dir() / "varlen_initstate.npz"), m.cfg);
  const auto full = run_tp(m, c, 2, 0);
  const auto tail = run_tp(m, c, 2, 8);
  expect_close(tail[0].out, full[0].out, "invariance out");
  expect_close(tail[0].recurrent_state, full[0].recurrent_state, "invariance state");
}

TEST(TensorParallel, PerRankPoolIsOneNth) {
  Mini m;
  for (int tp : {1, 2, 4}) {
    mem_cache::RecurrentStatePoolConfig pc{.layer_ids = {0},
                                           .size = 8,
                                           .num_heads = m.cfg.num_heads / tp,
                                           .head_k_dim = 128,
                                           .head_v_dim = 128,
                                           .conv_kernel = 4,
                                           .conv_dim = 3 * m.cfg.projection_size() / tp,
                                           .conv_dtype = Precision::FP32};
    mem_cache::RecurrentStatePool pool(pc);
    mem_cache::RecurrentStatePoolConfig full = pc;
    full.num_heads = m.cfg.num_heads;
    full.conv_dim = 3 * m.cfg.projection_size();
    EXPECT_EQ(pool.bytes() * tp, mem_cache::RecurrentStatePool(full).bytes()) << "tp " << tp;
  }
}

TEST(TensorParallel, ShardsHoldOnlyTheirSlices) {
  Mini m;
  const auto full = models::KdaLayerWeights::load(m.ckpt, m.cfg, 0);
  for (int tp : {2, 4})
    for (int r = 0; r < tp; ++r) {
      const auto a = models::KdaLayerWeights::load(m.ckpt, m.cfg, 0, r, tp);  // read from the mapping
      const auto b = full.shard(m.cfg, r, tp);                                // sliced in memory
      EXPECT_EQ(a.q_proj, b.q_proj);
      EXPECT_EQ(a.o_proj, b.o_proj);
      EXPECT_EQ(a.A_log, b.A_log);
      EXPECT_EQ(a.v_conv1d, b.v_conv1d);
      EXPECT_EQ(a.b_proj, b.b_proj);
      EXPECT_EQ(a.f_a_proj, full.f_a_proj);  // replicated
      EXPECT_EQ(a.q_proj.size() * tp, full.q_proj.size());
    }
}

TEST(TensorParallel, ShardLayoutRoundTrips) {
  const distributed::StateDims d{3, 4, 2, 2, 3};
  std::vector<float> rec(3 * 4 * 2 * 2), conv(3 * 3 * 3 * 4 * 2);
  for (size_t i = 0; i < rec.size(); ++i) rec[i] = static_cast<float>(i);
  for (size_t i = 0; i < conv.size(); ++i) conv[i] = static_cast<float>(i);
  for (int tp : {1, 2, 4}) {
    std::vector<float> rp, cp;
    for (int r = 0; r < tp; ++r) {
      const auto a = distributed::shard_recurrent(rec, d, r, tp), b = distributed::shard_conv(conv, d, r, tp);
      rp.insert(rp.end(), a.begin(), a.end());
      cp.insert(cp.end(), b.begin(), b.end());
    }
    EXPECT_EQ(distributed::unshard_recurrent(rp, d, tp), rec);
    EXPECT_EQ(distributed::unshard_conv(cp, d, tp), conv);
  }
  // Rank 1 of 2 holds head 2..3 of sequence 0 first: elements 8..15.
  EXPECT_EQ(distributed::shard_recurrent(rec, d, 1, 2)[0], 8.0f);
  // Conv rank 1 of 2: channels 4..7 of q (P = 8), then of k at offset 8 + 4 = 12.
  const auto c1 = distributed::shard_conv(conv, d, 1, 2);
  EXPECT_EQ(c1[0], 4.0f);
  EXPECT_EQ(c1[4], 12.0f);
}

TEST(TensorParallel, UnevenHeadsAreAnError) {
  Mini m;
  try {
    models::KdaLayerWeights::load(m.ckpt, m.cfg, 0, 0, 3);
    ADD_FAILURE() << "3 ranks over 4 heads accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("divisible"));
  }
}

}  // namespace
}  // namespace kda
