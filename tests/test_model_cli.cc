// The kda binary on the whole model: `kda run --tokens` on every tiny model-dump case within the spec's
// tolerances (fp32 elementwise, bf16 by the rel-L2 rule), the decode tail, `kda verify` on the model
// dumps (passing, and failing on a corrupted copy), and every bad input refused with a clear message,
// a nonzero exit and no output file.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "kda/distributed/mpi_communicator.h"
#include "kda/io/config.h"
#include "kda/io/npy.h"
#include "support/model_checkpoint.h"
#include "support/model_reference.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

testing::CommandResult run_kda(const std::string& args) {
  return testing::run_command(std::string(KDA_BINARY_PATH) + " " + args + " 2>&1");
}

const std::vector<std::string> kCases = {"T1", "T7", "T64", "T65", "T200", "varlen_3", "decode_tail"};

std::string tiny() { return testing::model_dumps_dir().string(); }

// kda run --tokens on one case into a fresh folder; the archive it wrote.
io::NpzArchive run_case(const std::string& name, const std::string& extra, const std::string& tag) {
  const auto out = testing::make_temp_dir(tag) / "out.npz";
  const auto r = run_kda("run --model " + tiny() + " --tokens " + tiny() + "/" + name + ".npz --output " +
                         out.string() + " " + extra);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("kda run: 4 layers"));
  return r.code == 0 ? io::read_npz(out) : io::NpzArchive{};
}

std::vector<float> f32(const io::NpzArchive& a, const std::string& key) {
  auto it = a.find(key);
  if (it == a.end()) {
    ADD_FAILURE() << "no '" << key << "' array";
    return {};
  }
  return it->second.to_f32();
}

// Every output array against the case's reference of the same name, at the spec's fp32 bounds, and the
// output holds exactly the reference's per-layer keys (KDA layers 0-2, MLA layer 3 in tiny).
void expect_fp32_match(const io::NpzArchive& got, const io::NpzArchive& ref, const std::string& what) {
  std::vector<std::string> keys = {"logits", "hidden_final"};
  for (int i : {0, 1, 2})
    for (const char* k : {"kda_recurrent_state_", "kda_conv_state_"}) keys.push_back(k + std::to_string(i));
  keys.push_back("mla_ckv_3");
  keys.push_back("mla_kpe_3");
  EXPECT_EQ(got.size(), keys.size()) << what;
  for (const auto& k : keys) {
    const auto a = f32(got, k), b = f32(ref, k);
    ASSERT_EQ(a.size(), b.size()) << what << ": " << k;
    ASSERT_EQ(got.at(k).shape, ref.at(k).shape) << what << ": " << k;
    const double tol = (k == "logits" || k == "hidden_final") ? 1e-4 : 1e-5;
    EXPECT_LE(testing::max_error_ratio(a.data(), b.data(), a.size(), tol, tol), 1.0) << what << ": " << k;
  }
}

TEST(ModelCli, RunEveryTinyCaseInFp32WithinTheSpecsTolerance) {
  for (const auto& name : kCases) {
    SCOPED_TRACE(name);
    const auto got = run_case(name, "", "model_cli_fp32");
    const auto ref = io::read_npz(testing::model_dumps_dir() / (name + ".npz"));
    expect_fp32_match(got, ref, name);
    EXPECT_EQ(got.at("logits").shape, (std::vector<int64_t>{ref.at("input_ids").shape[0], 512}));
  }
}

// --decode-tail: the decode_tail case's last 8 tokens as DECODE steps after a prefill of 40, and every
// sequence of varlen_3 (lengths 5, 1, 40) ending with one DECODE step: the same references.
TEST(ModelCli, DecodeTailMatchesTheWholeSequence) {
  expect_fp32_match(run_case("decode_tail", "--decode-tail 8", "model_cli_tail"),
                    io::read_npz(testing::model_dumps_dir() / "decode_tail.npz"), "decode_tail, tail 8");
  expect_fp32_match(run_case("varlen_3", "--decode-tail 1", "model_cli_tail"),
                    io::read_npz(testing::model_dumps_dir() / "varlen_3.npz"), "varlen_3, tail 1");
}

// bf16 (spec): the rel L2 of the logits against float64 within 2x that of the case's own bf16 emulation,
// prefill and decode tail alike; NaN / Inf fail it (rel_l2 is then not finite).
TEST(ModelCli, Bf16LogitsWithinTwiceTheEmulationsError) {
  for (const auto& [name, extra] : std::vector<std::pair<std::string, std::string>>{
           {"varlen_3", ""}, {"decode_tail", "--decode-tail 8"}}) {
    SCOPED_TRACE(name + " " + extra);
    const auto got = run_case(name, "--precision bf16 " + extra, "model_cli_bf16");
    const auto ref = io::read_npz(testing::model_dumps_dir() / (name + ".npz"));
    const auto a = f32(got, "logits"), b = f32(ref, "logits"), e = f32(ref, "logits_bf16");
    ASSERT_EQ(a.size(), b.size());
    const double own = testing::rel_l2(e.data(), b.data(), b.size());
    EXPECT_LE(testing::rel_l2(a.data(), b.data(), b.size()), 2.0 * own);
    EXPECT_GT(testing::rel_l2(a.data(), b.data(), b.size()), 0.0);  // it did round
  }
}

// --moe-combine biased against the float64 reference with the biased combine (the routing is the same:
// both select by c; only the combine weights differ), and away from the default unbiased run.
TEST(ModelCli, MoeCombineBiasedMatchesItsReference) {
  const auto unbiased = run_case("T7", "", "model_cli_moe");
  const auto biased = run_case("T7", "--moe-combine biased", "model_cli_moe");
  const auto cfg = io::load_model_config(testing::model_dumps_dir());
  const auto ids = io::read_npz(testing::model_dumps_dir() / "T7.npz").at("input_ids").to_i32();
  testing::ModelReferenceOptions ro;
  ro.combine = testing::RefCombine::Biased;
  const auto ref =
      testing::reference_model(cfg, testing::read_model_weights(testing::model_dumps_dir()), ids, {}, ro);
  for (const auto& [key, want] :
       {std::pair{"logits", &ref.logits}, std::pair{"hidden_final", &ref.hidden_final}}) {
    const auto a = f32(biased, key);
    const std::vector<float> b(want->begin(), want->end());
    ASSERT_EQ(a.size(), b.size()) << key;
    EXPECT_LE(testing::max_error_ratio(a.data(), b.data(), a.size(), 1e-4, 1e-4), 1.0) << key;
  }
  const auto a = f32(unbiased, "logits"), b = f32(biased, "logits");
  EXPECT_GT(testing::rel_l2(b.data(), a.data(), a.size()), 1e-3);
  // The KDA layer before the first MoE layer does not depend on the combine.
  EXPECT_EQ(f32(unbiased, "kda_recurrent_state_0"), f32(biased, "kda_recurrent_state_0"));
}

// --weights int8 / int4 on the model dumps: the spec's rule (rel L2 of the logits within 1.1x the scheme's
// own error, the scheme run as a dense fp32 model on the dequantized weights), fp32 and bf16.
TEST(ModelCli, VerifyQuantizedWeightsByTheSchemeRule) {
  const auto dir = testing::make_temp_dir("model_cli_quant");
  for (const auto& e : fs::directory_iterator(testing::model_dumps_dir()))
    if (e.path().extension() != ".npz" || e.path().stem() == "T65")
      fs::copy_file(e.path(), dir / e.path().filename());
  const auto scratch = testing::make_temp_dir("model_cli_quant_tmp");  // where the scheme's copy goes
  for (const std::string w : {"int8", "int4"}) {
    SCOPED_TRACE(w);
    const auto r =
        testing::run_command("TMPDIR=" + scratch.string() + " " + KDA_BINARY_PATH + " verify --dumps " +
                             dir.string() + " --weights " + w + " --json 2>&1");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("\"ok\": true"));
    EXPECT_THAT(r.output, HasSubstr("logits (1.1x the " + w + " scheme's)"));
    EXPECT_THAT(r.output, HasSubstr("logits (1.1x the " + w + " scheme's (+) logits_bf16's)"));
    EXPECT_THAT(r.output, HasSubstr("invariance: logits"));
    EXPECT_TRUE(fs::is_empty(scratch));  // the dequantized scratch checkpoint is removed again
  }
}

// --tp 2 under mpirun: the MLA heads and the MLP rows split over two ranks, every output equal to TP 1
// within the fp32 bounds (the KDA states gathered from both ranks' heads), rank 0 writing the file.
TEST(ModelCli, RunTp2EqualsTp1) {
  if (!distributed::mpi_available()) GTEST_SKIP() << "built without MPI";
  if (testing::run_command("command -v mpirun").code != 0) GTEST_SKIP() << "mpirun not installed";
  const auto tmp = testing::make_temp_dir("model_cli_tp");
  const std::string args =
      " run --model " + tiny() + " --tokens " + tiny() + "/varlen_3.npz --decode-tail 1 ";
  auto r = run_kda(args + "--output " + (tmp / "tp1.npz").string());
  ASSERT_EQ(r.code, 0) << r.output;
  r = testing::run_command(
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ASAN_OPTIONS=detect_leaks=0 "
      "OMP_NUM_THREADS=1 "
      "timeout 300 mpirun --oversubscribe -np 2 " +
      std::string(KDA_BINARY_PATH) + args + "--tp 2 --output " + (tmp / "tp2.npz").string() + " 2>&1");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto one = io::read_npz(tmp / "tp1.npz"), two = io::read_npz(tmp / "tp2.npz");
  ASSERT_EQ(one.size(), two.size());
  expect_fp32_match(two, one, "tp 2 vs tp 1");
}

TEST(ModelCli, VerifyPassesOnTheTinyModelDumps) {
  const auto r = run_kda("verify --dumps " + tiny() + " --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"ok\": true"));
  EXPECT_THAT(r.output, HasSubstr("\"kind\": \"model\""));
  for (const auto& name : kCases) EXPECT_THAT(r.output, HasSubstr("\"case\": \"" + name + "\""));
  EXPECT_THAT(r.output, HasSubstr("decode tail 8: logits"));
  EXPECT_THAT(r.output, HasSubstr("prefill: prefill_kda_recurrent_state_0"));
  EXPECT_THAT(r.output, HasSubstr("\"precision\": \"bf16\""));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("\"ok\": false")));
}

// A copy of the dumps (T1 and T7) whose T7 logits disagree with the model by far more than the fp32
// tolerance in one element: verify fails T7 naming the check, passes T1, and exits 1.
TEST(ModelCli, VerifyFailsOnACorruptedCopy) {
  const auto dir = testing::make_temp_dir("model_cli_bad");
  for (const auto& e : fs::directory_iterator(testing::model_dumps_dir()))
    if (e.path().extension() != ".npz" || e.path().stem() == "T7" || e.path().stem() == "T1")
      fs::copy_file(e.path(), dir / e.path().filename());
  auto npz = io::read_npz(dir / "T7.npz");
  auto v = npz.at("logits").to_f32();
  v[5] += 0.05f;  // far beyond 1e-4 + 1e-4|b|
  npz["logits"] = io::NpyArray::from_f32(npz.at("logits").shape, v.data());
  io::write_npz(dir / "T7.npz", npz);
  const auto r = run_kda("verify --dumps " + dir.string() + " --precision fp32");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("T7  [fp32"));
  EXPECT_THAT(r.output, HasSubstr("FAIL\n  hidden_final"));  // the row before it, logits, failed
  EXPECT_THAT(r.output, HasSubstr("T1  [fp32"));
  EXPECT_THAT(r.output, HasSubstr("verify: 1 passed, 1 failed"));
}

// ---- bad input: a clear message, a nonzero exit, no output file.

struct BadCase {
  std::string name;
  std::vector<int32_t> ids;
  std::vector<int32_t> cu;  // empty: no cu_seqlens
  std::string extra;
  std::string message;
};

TEST(ModelCliBadInput, EveryBadCaseIsRefusedAndWritesNothing) {
  const std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6};
  const std::vector<BadCase> cases = {
      {"cu_seqlens not from 0", ids, {1, 3, 6}, "", "cu_seqlens must start at 0, got 1"},
      {"cu_seqlens decreasing", ids, {0, 4, 2, 6}, "", "cu_seqlens decreases at index 2: 4 then 2"},
      {"cu_seqlens short of T", ids, {0, 2, 5}, "", "cu_seqlens ends at 5 but input_ids has 6 tokens"},
      {"cu_seqlens past T", ids, {0, 2, 7}, "", "cu_seqlens ends at 7 but input_ids has 6 tokens"},
      {"id = vocab", {1, 512, 3}, {}, "", "input_ids[1] = 512 is outside the vocabulary [0, 512)"},
      {"negative id", {1, 2, -3}, {}, "", "input_ids[2] = -3 is outside the vocabulary"},
      {"tail longer than a sequence",
       ids,
       {0, 1, 6},
       "--decode-tail 2",
       "--decode-tail 2 is longer than sequence 0 (1 tokens)"},
      {"tail longer than the case", ids, {}, "--decode-tail 7", "--decode-tail 7 is longer than sequence 0"},
      {"unknown combine", ids, {}, "--moe-combine mean", "--moe-combine: mean not in {"},
      {"unknown precision", ids, {}, "--precision fp16", "--precision: fp16 not in {"},
  };
  const auto in = testing::make_temp_dir("model_cli_bad_in");
  const auto out = testing::make_temp_dir("model_cli_bad_out");
  int n = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    io::NpzArchive npz;
    npz["input_ids"] = io::NpyArray::from_i32({static_cast<int64_t>(c.ids.size())}, c.ids.data());
    if (!c.cu.empty())
      npz["cu_seqlens"] = io::NpyArray::from_i32({static_cast<int64_t>(c.cu.size())}, c.cu.data());
    const auto file = in / ("case" + std::to_string(n++) + ".npz");
    io::write_npz(file, npz);
    const auto r = run_kda("run --model " + tiny() + " --tokens " + file.string() + " --output " +
                           (out / "out.npz").string() + " " + c.extra);
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.message));
    EXPECT_TRUE(fs::is_empty(out)) << r.output;
  }
}

TEST(ModelCliBadInput, CaseFilesOfTheWrongKindAreRefused) {
  const auto in = testing::make_temp_dir("model_cli_kind_in");
  const auto out = testing::make_temp_dir("model_cli_kind_out");
  const std::vector<float> x = {1.0f, 2.0f};
  std::vector<std::pair<io::NpzArchive, std::string>> files;
  io::NpzArchive floats;
  floats["input_ids"] = io::NpyArray::from_f32({2}, x.data());
  files.push_back({floats, "input_ids must hold int32 ids, got"});
  io::NpzArchive matrix;
  const std::vector<int32_t> ids = {1, 2, 3, 4};
  matrix["input_ids"] = io::NpyArray::from_i32({2, 2}, ids.data());
  files.push_back({matrix, "input_ids must be 1-D, got shape [2, 2]"});
  io::NpzArchive none;
  none["hidden_states"] = io::NpyArray::from_f32({1, 2}, x.data());
  files.push_back({none, "has no 'input_ids' array"});
  int n = 0;
  for (const auto& [npz, message] : files) {
    const auto file = in / ("kind" + std::to_string(n++) + ".npz");
    io::write_npz(file, npz);
    const auto r = run_kda("run --model " + tiny() + " --tokens " + file.string() + " --output " +
                           (out / "out.npz").string());
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("kda: error: " + file.string())) << message;
    EXPECT_THAT(r.output, HasSubstr(message));
    EXPECT_TRUE(fs::is_empty(out));
  }
}

// The options of the two kinds of run do not mix, and one kind must be given.
TEST(ModelCliBadInput, RunOptionsOfTheTwoKindsDoNotMix) {
  const std::string base = "run --model " + tiny() + " --output /tmp/kda_model_cli_never.npz ";
  const std::string case_file = tiny() + "/T7.npz";
  auto r = run_kda(base + "--tokens " + case_file + " --layer 0");
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("excludes"));
  r = run_kda(base + "--layer 0 --input " + case_file + " --moe-combine biased");
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("--moe-combine requires --tokens"));
  r = run_kda(base);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output,
              HasSubstr("kda run needs --tokens CASE.npz (the whole model) or --layer N and --input"));
  // A token case with a KDA-only config (the layer dumps): refused naming the missing model field.
  r = run_kda("run --model " + testing::dumps_dir().string() + " --tokens " + case_file +
              " --output /tmp/kda_model_cli_never.npz");
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("vocab_size"));
  EXPECT_FALSE(fs::exists("/tmp/kda_model_cli_never.npz"));
}

}  // namespace
}  // namespace kda
