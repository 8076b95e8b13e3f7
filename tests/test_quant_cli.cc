// --weights through the CLI (kda run, verify, simulate, bench's option) and tensor parallelism with
// quantized projections (each rank quantizes its own shard).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "kda/distributed/in_process.h"
#include "kda/io/config.h"
#include "kda/io/npy.h"
#include "kda/io/safetensors.h"
#include "kda/models/kimi_linear.h"
#include "kda/runtime/layer_runner.h"
#include "support/test_support.h"

namespace kda {
namespace {

using ::testing::HasSubstr;

testing::CommandResult run_kda(const std::string& args) {
  return testing::run_command(std::string(KDA_BINARY_PATH) + " " + args + " 2>&1");
}

TEST(QuantCli, VerifyPassesWithQuantizedWeights) {
  for (const char* w : {"int8", "int4"}) {
    const auto r = run_kda("verify --dumps " + testing::dumps_dir().string() + " --weights " + w + " --json");
    ASSERT_EQ(r.code, 0) << r.output;
    const auto j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["ok"], true);
    EXPECT_EQ(j["weights"], w);
    ASSERT_FALSE(j["cases"].empty());
    const auto& first = j["cases"][0]["checks"][0];
    EXPECT_THAT(first["check"].get<std::string>(), HasSubstr(std::string("1.1x the ") + w + " scheme's"));
    EXPECT_GT(first["limit"].get<double>(), 1e-4);  // the scheme's error is a real one, not a tolerance
  }
}

TEST(QuantCli, RunWritesTheQuantizedLayersOutputs) {
  const auto dir = testing::dumps_dir();
  const auto tmp = testing::make_temp_dir("quant_run");
  const auto cfg = io::load_config(dir);
  const io::Checkpoint ckpt(dir);
  const auto c = runtime::LayerCase::from_npz(io::read_npz(dir / "T65.npz"), cfg);
  for (Weights w : {Weights::Int8, Weights::Int4}) {
    const auto out = tmp / (std::string(to_string(w)) + ".npz");
    const auto r =
        run_kda("run --model " + dir.string() + " --layer 0 --input " + (dir / "T65.npz").string() +
                " --output " + out.string() + " --precision bf16 --weights " + to_string(w));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr(std::string(to_string(w)) + " weights"));
    auto layer = models::KimiDeltaAttention::from_checkpoint(ckpt, cfg, 0, Precision::BF16, {}, w);
    const auto want = runtime::run_layer_case(*layer, cfg, c, 0, kernels::KernelImpl::Auto);
    EXPECT_EQ(io::read_npz(out).at("out").to_f32(), want.out) << to_string(w);
  }
  const auto bad =
      run_kda("run --model " + dir.string() + " --layer 0 --input " + (dir / "T65.npz").string() +
              " --output " + (tmp / "x.npz").string() + " --weights int5");
  EXPECT_NE(bad.code, 0);
  EXPECT_THAT(bad.output, HasSubstr("--weights"));
  EXPECT_FALSE(std::filesystem::exists(tmp / "x.npz"));
}

TEST(QuantCli, SimulateReportsWeightBytes) {
  int64_t bytes[3] = {0, 0, 0};
  int i = 0;
  for (const char* w : {"bf16", "int8", "int4"}) {
    const auto r = run_kda(std::string("simulate --model ") + testing::model_dumps_dir().string() +
                           " --requests 2 --prompt-len 8:16 --output-len 3 --check 1 --json --weights " + w);
    ASSERT_EQ(r.code, 0) << r.output;
    const auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
    EXPECT_EQ(j["weights"], w);
    bytes[i++] = j["weight_bytes"].get<int64_t>();
  }
  EXPECT_GT(bytes[0], 0);
  // One byte per weight + scales, against two; half a byte + a scale per 32. The MoE routers (fp32 in
  // every weights mode), the norms and the KDA conv weights stay as stored: a few percent above half and
  // a quarter on the tiny model.
  EXPECT_LT(bytes[1], bytes[0] * 0.53);
  EXPECT_LT(bytes[2], bytes[0] * 0.33);
}

// --quantize-lm-head: the head in the --weights format too (as llama.cpp quantizes its output tensor), so a
// decoded token reads fewer bytes and the self-check still passes; with bf16 weights the option is refused
// by name (it would change nothing) before anything loads.
TEST(QuantCli, SimulateQuantizesTheHeadOnlyWhenAsked) {
  const std::string base = std::string("simulate --model ") + testing::model_dumps_dir().string() +
                           " --requests 2 --prompt-len 8:16 --output-len 3 --check 1 --json --weights int4";
  int64_t active[2] = {0, 0};
  for (int q = 0; q < 2; ++q) {
    const auto r = run_kda(base + (q ? " --quantize-lm-head" : ""));
    ASSERT_EQ(r.code, 0) << r.output;
    const auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
    EXPECT_EQ(j["quantize_lm_head"], q == 1);
    EXPECT_EQ(j["ok"], true);
    active[q] = j["active_weight_bytes"].get<int64_t>();
  }
  // The tiny head is 512 x 256: bf16 256 KiB, int4 64 KiB + its scales (16 KiB).
  EXPECT_EQ(active[0] - active[1], 512 * 256 * 2 - (512 * 256 / 2 + 512 * 8 * 4));
  const auto bad = run_kda(std::string("simulate --model ") + testing::model_dumps_dir().string() +
                           " --requests 1 --check 0 --quantize-lm-head");
  EXPECT_NE(bad.code, 0);
  EXPECT_THAT(bad.output, HasSubstr("--quantize-lm-head"));
  EXPECT_THAT(bad.output, HasSubstr("int8 or int4"));
}

// TP 2 with quantized weights: each rank holds the packed bytes of its shard only (about half, f_a and
// g_a replicated); int4 groups never straddle a shard boundary, so TP 2 equals TP 1 up to the order of
// the partial sums; int8's o_proj scales are per rank (max over its columns), another scheme of the same
// kind, held to the same bound against the float64 output.
TEST(QuantCli, TensorParallelRanksQuantizeTheirShards) {
  const auto dir = testing::dumps_dir();
  const auto cfg = io::load_config(dir);
  const io::Checkpoint ckpt(dir);
  const auto npz = io::read_npz(dir / "varlen_initstate.npz");
  const auto c = runtime::LayerCase::from_npz(npz, cfg);
  const auto out_f64 = npz.at("out_fp32").to_f32();
  for (Weights w : {Weights::Int8, Weights::Int4}) {
    auto tp1 = models::KimiDeltaAttention::from_checkpoint(ckpt, cfg, 0, Precision::FP32, {}, w);
    const auto ref = runtime::run_layer_case(*tp1, cfg, c, 0, kernels::KernelImpl::Auto);
    const int tp = 2;
    distributed::InProcessGroup group(tp);
    std::vector<runtime::LayerResult> got(tp);
    std::vector<int64_t> bytes(tp);
    std::vector<std::string> errors(tp);
    std::vector<std::thread> threads;
    for (int r = 0; r < tp; ++r)
      threads.emplace_back([&, r] {
        try {
          auto comm = group.member(r);
          auto layer = models::KimiDeltaAttention::from_checkpoint(ckpt, cfg, 0, Precision::FP32,
                                                                   {r, tp, comm.get()}, w);
          bytes[r] = layer->weight_bytes();
          got[r] = runtime::run_layer_case(*layer, cfg, c, 0, kernels::KernelImpl::Auto);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < tp; ++r) {
      ASSERT_EQ(errors[r], "") << "rank " << r;
      EXPECT_LT(bytes[r], tp1->weight_bytes() * 0.6) << "rank " << r;
      EXPECT_GT(bytes[r], tp1->weight_bytes() * 0.4) << "rank " << r;
      const double e = testing::rel_l2(got[r].out.data(), ref.out.data(), ref.out.size());
      if (w == Weights::Int4) {
        EXPECT_LE(e, 1e-5) << "int4 rank " << r;
      } else {
        const double e_tp = testing::rel_l2(got[r].out.data(), out_f64.data(), out_f64.size());
        const double e_1 = testing::rel_l2(ref.out.data(), out_f64.data(), out_f64.size());
        EXPECT_LE(e_tp, 1.1 * e_1) << "int8 rank " << r;
        EXPECT_GT(e, 0.0);  // per-rank scales: not the same quantization as TP 1
      }
    }
  }
}

}  // namespace
}  // namespace kda
