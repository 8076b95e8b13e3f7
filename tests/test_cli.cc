// The kda binary as a user drives it: `kda run` and `kda verify`, their outputs, exit codes and errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kda/io/npy.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

testing::CommandResult run_kda(const std::string& args) {
  return testing::run_command(std::string(KDA_BINARY_PATH) + " " + args + " 2>&1");
}

TEST(Cli, RunWritesOutputsThatMatchTheReference) {
  const auto dir = testing::dumps_dir();
  const auto out = testing::make_temp_dir("cli_run") / "out.npz";
  const auto r =
      run_kda("run --model " + dir.string() + " --layer 0 --input " +
              (dir / "varlen_initstate.npz").string() + " --output " + out.string() + " --decode-tail 3");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto got = io::read_npz(out);
  const auto ref = io::read_npz(dir / "varlen_initstate.npz");
  ASSERT_EQ(got.at("out").shape, (std::vector<int64_t>{64, 256}));
  ASSERT_EQ(got.at("recurrent_state").shape, (std::vector<int64_t>{4, 4, 128, 128}));
  ASSERT_EQ(got.at("conv_state").shape, (std::vector<int64_t>{4, 3, 1536}));
  const auto pairs = {std::pair{"out", "out_fp32"}, std::pair{"recurrent_state", "recurrent_state_chunk"},
                      std::pair{"conv_state", "final_conv_state"}};
  for (auto [mine, theirs] : pairs) {
    const auto a = got.at(mine).to_f32(), b = ref.at(theirs).to_f32();
    EXPECT_LE(testing::max_error_ratio(a.data(), b.data(), a.size(), 1e-5, 1e-5), 1.0) << mine;
  }
}

TEST(Cli, VerifyPassesOnTheDumpsAndPrintsJson) {
  const auto r = run_kda("verify --dumps " + testing::dumps_dir().string() + " --precision fp32 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"ok\": true"));
  EXPECT_THAT(r.output, HasSubstr("\"varlen_initstate\""));
}

TEST(Cli, VerifyFailsWhenAReferenceDisagrees) {
  const auto dir = testing::make_temp_dir("cli_verify_bad");
  const auto src = testing::dumps_dir();
  for (const char* f : {"config.json", "model.safetensors", "T8.npz"}) fs::copy_file(src / f, dir / f);
  auto npz = io::read_npz(src / "T8.npz");
  auto out = npz.at("out_fp32").to_f32();
  out[17] += 1e-3f;  // one element off by far more than the fp32 tolerance
  npz["out_fp32"] = io::NpyArray::from_f32(npz.at("out_fp32").shape, out.data());
  io::write_npz(dir / "T8.npz", npz);
  const auto r = run_kda("verify --dumps " + dir.string() + " --precision fp32");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("FAIL"));
}

TEST(Cli, ErrorsAreClear) {
  const auto dir = testing::dumps_dir().string();
  auto r = run_kda("run --model " + dir + " --layer 3 --input " + dir + "/T8.npz --output /tmp/x.npz");
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("layer 3"));
  r = run_kda("run --model /nonexistent --layer 0 --input " + dir + "/T8.npz --output /tmp/x.npz");
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("/nonexistent"));
  r = run_kda("verify --dumps " + dir + " --precision fp64");
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("fp64"));
}

// `kda args` fails with `message` before it measures anything: its output lacks `measured`, what the
// section it names prints once it runs.
void expect_refused_before_measuring(const std::string& args, const std::string& message,
                                     const std::string& measured) {
  const auto r = run_kda(args);
  EXPECT_NE(r.code, 0) << args;
  EXPECT_THAT(r.output, HasSubstr(message)) << args;
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr(measured))) << args;
}

// --experts sizes the whole model of --only model and of --only spec's serving rows; other sections have
// no experts to size, and it is refused before anything is measured.
TEST(Cli, BenchExpertsIsForModelAndSpecOnly) {
  expect_refused_before_measuring("bench --only stack --experts 4",
                                  "--experts is for --only model or --only spec", "stack (20 layers)");
}

// --layers sizes --only model's whole model; it is refused elsewhere and beyond the model's 27 layers
// before anything is measured.
TEST(Cli, BenchLayersIsForModelOnlyAndWithinTheModel) {
  expect_refused_before_measuring("bench --only stack --layers 4", "--layers is for --only model",
                                  "stack (20 layers)");
  expect_refused_before_measuring("bench --only model --layers 28",
                                  "--layers 28: the model has 27 decoder layers", "ceilings");
}

// --rounds repeats --only model's decode measurements; it is refused elsewhere and below 1 before anything
// is measured.
TEST(Cli, BenchRoundsIsForModelOnlyAndPositive) {
  expect_refused_before_measuring("bench --only stack --rounds 2", "--rounds is for --only model",
                                  "stack (20 layers)");
  expect_refused_before_measuring("bench --only model --rounds 0", "--rounds: Value 0 not in range",
                                  "ceilings");
}

// Each round of --only model's decode gives its own figures; the row's are their medians (with two
// rounds, the mean of the two) and decode_spread their ranges.
TEST(Cli, BenchModelRoundsGiveMediansAndSpread) {
  const auto r = testing::run_command(std::string(KDA_BINARY_PATH) +
                                      " bench --only model --layers 1 --experts 8 --weights int4 --rounds 2 "
                                      "--json 2>/dev/null");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  ASSERT_EQ(j.at("model").size(), 1u);
  const auto& row = j.at("model")[0];
  const auto& rounds = row.at("decode_rounds");
  ASSERT_EQ(rounds.size(), 2u);
  for (const char* key :
       {"read_bandwidth_gbs", "read_bandwidth_b16_gbs", "model_decode_b1_ms", "decode_b1_over_bound",
        "model_decode_b16_ms", "decode_b16_over_bound", "decode_b16_floor_ms", "decode_b16_over_floor"}) {
    const double a = rounds[0].at(key).get<double>(), b = rounds[1].at(key).get<double>();
    EXPECT_GT(a, 0.0) << key;
    EXPECT_GT(b, 0.0) << key;
    EXPECT_DOUBLE_EQ(row.at(key).get<double>(), 0.5 * (a + b)) << key;
  }
  for (const char* key : {"read_bandwidth_gbs", "read_bandwidth_b16_gbs", "decode_b1_over_bound",
                          "decode_b16_over_bound", "decode_b16_floor_over_bound", "decode_b16_over_floor"}) {
    const double a = rounds[0].at(key).get<double>(), b = rounds[1].at(key).get<double>();
    const auto& range = row.at("decode_spread").at(key);
    ASSERT_EQ(range.size(), 2u) << key;
    EXPECT_EQ(range[0].get<double>(), std::min(a, b)) << key;
    EXPECT_EQ(range[1].get<double>(), std::max(a, b)) << key;
  }
}

// The prefix cache's own options with the cache turned off are refused by the parser, before anything
// runs, as --draft-* options are without --speculative.
TEST(Cli, SimulateRefusesPrefixCacheOptionsWithTheCacheOff) {
  const std::string tiny =
      "simulate --layers 1 --vocab 1024 --requests 1 --prompt-len 4 --output-len 1 --check 0 ";
  for (const char* opt : {"--prefix-cache-memory 64MiB", "--cache-interval 128"}) {
    const auto r = run_kda(tiny + "--no-prefix-cache " + opt);
    EXPECT_NE(r.code, 0) << opt << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr("excludes")) << opt;
    EXPECT_THAT(r.output, HasSubstr("--no-prefix-cache")) << opt;
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr("kda simulate:"))) << opt;
  }
  const auto r = run_kda(tiny + "--cache-interval 128");  // with the cache on, as always
  EXPECT_EQ(r.code, 0) << r.output;
}

// --- --kernel on the command line ---------------------------------------------------------

// `--kernel naive` (the reference kernels) and `--kernel optimized` (this CPU's best ISA copy) each give
// passing results through run, verify and simulate; the two are different code (a chunked and a
// per-token recurrence), so their outputs agree within the fp32 tolerance but not bit for bit, which
// shows the option reaches the kernels. A kernel name the CLI does not know is refused.
TEST(CliKernel, NaiveAndOptimizedPassRunVerifyAndSimulate) {
  const auto dir = testing::dumps_dir();
  const auto tmp = testing::make_temp_dir("cli_kernel");
  const auto ref = io::read_npz(dir / "varlen_initstate.npz");
  std::map<std::string, io::NpzArchive> runs;
  for (const std::string k : {"naive", "optimized"}) {
    SCOPED_TRACE(k);
    const auto out = tmp / ("run_" + k + ".npz");
    auto r = run_kda("run --model " + dir.string() + " --layer 0 --input " +
                     (dir / "varlen_initstate.npz").string() + " --output " + out.string() +
                     " --decode-tail 3 --kernel " + k);
    ASSERT_EQ(r.code, 0) << r.output;
    runs[k] = io::read_npz(out);
    const auto pairs = {std::pair{"out", "out_fp32"}, std::pair{"recurrent_state", "recurrent_state_chunk"},
                        std::pair{"conv_state", "final_conv_state"}};
    for (auto [mine, theirs] : pairs) {
      const auto a = runs[k].at(mine).to_f32(), b = ref.at(theirs).to_f32();
      EXPECT_LE(testing::max_error_ratio(a.data(), b.data(), a.size(), 1e-5, 1e-5), 1.0) << mine;
    }

    r = run_kda("verify --dumps " + dir.string() + " --precision fp32 --json --kernel " + k);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("\"ok\": true"));
    EXPECT_THAT(r.output, HasSubstr("\"kernel\": \"" + k + "\""));
    if (k == "naive") {
      EXPECT_THAT(r.output, HasSubstr("\"kernel_ran\": \"naive\""));
    } else {
      EXPECT_THAT(r.output, ::testing::Not(HasSubstr("\"kernel_ran\": \"naive\"")));
    }

    r = run_kda(
        "simulate --layers 1 --vocab 1024 --requests 3 --prompt-len 4:70 --output-len 3 --precision fp32 "
        "--check 3 "
        "--json --outputs " +
        (tmp / ("sim_" + k + ".npz")).string() + " --kernel " + k);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("\"check_ok\": true"));
  }
  const auto a = runs["naive"].at("out").to_f32(), b = runs["optimized"].at("out").to_f32();
  EXPECT_LE(testing::max_error_ratio(a.data(), b.data(), a.size(), 1e-5, 1e-5), 1.0);
  EXPECT_NE(a, b);
  const auto sa = io::read_npz(tmp / "sim_naive.npz"), sb = io::read_npz(tmp / "sim_optimized.npz");
  ASSERT_EQ(sa.size(), sb.size());
  for (const auto& [key, arr] : sa) {
    if (key.starts_with("tokens_")) {
      EXPECT_EQ(sb.at(key).to_i32(), arr.to_i32()) << key;
      continue;
    }
    const auto x = sb.at(key).to_f32(), y = arr.to_f32();
    ASSERT_EQ(x.size(), y.size()) << key;
    EXPECT_LE(testing::max_error_ratio(x.data(), y.data(), x.size(), 1e-5, 1e-5), 1.0) << key;
  }
}

TEST(CliKernel, AnUnknownKernelIsRefused) {
  const auto dir = testing::dumps_dir().string();
  for (const std::string& cmd :
       {"run --model " + dir + " --layer 0 --input " + dir + "/T8.npz --output /tmp/kda_k.npz",
        "verify --dumps " + dir, std::string("simulate --layers 1 --vocab 1024")}) {
    SCOPED_TRACE(cmd);
    const auto r = run_kda(cmd + " --kernel fastest");
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("--kernel: fastest not in {"));
  }
}

// ---- Bad input to the end: every subcommand given a file of the wrong kind where an
// .npz / .json / checkpoint is expected exits non-zero with a message naming it, and writes no output
// file, complete, partial or temporary.

// The wrong kinds in a fresh folder: an empty file, a truncated .npz, a text file, a directory, a FIFO.
std::vector<fs::path> wrong_kinds(const fs::path& dir) {
  const auto put = [](const fs::path& p, const std::string& bytes) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out << bytes;
  };
  put(dir / "empty.npz", "");
  std::ifstream in(testing::dumps_dir() / "T8.npz", std::ios::binary);
  std::string whole((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  put(dir / "truncated.npz", whole.substr(0, whole.size() / 2));
  put(dir / "text.npz", "not an archive\n");
  fs::create_directory(dir / "folder.npz");
  EXPECT_EQ(::mkfifo((dir / "fifo.npz").c_str(), 0600), 0);
  return {dir / "empty.npz", dir / "truncated.npz", dir / "text.npz", dir / "folder.npz", dir / "fifo.npz"};
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(CliBadInput, RunRefusesEveryWrongKindOfInputAndWritesNoOutput) {
  const auto in = testing::make_temp_dir("cli_bad_in");
  const auto out = testing::make_temp_dir("cli_bad_out");
  const auto inputs = wrong_kinds(in);
  for (const auto& p : inputs) {
    const auto r = run_kda("run --model " + testing::dumps_dir().string() + " --layer 0 --input " +
                           p.string() + " --output " + (out / "out.npz").string());
    EXPECT_NE(r.code, 0) << p;
    EXPECT_THAT(r.output, HasSubstr("kda: error: " + p.string())) << r.output;
    EXPECT_TRUE(fs::is_empty(out)) << p << ": left " << ::testing::PrintToString(names_in(out));
  }
  // A checkpoint folder whose config.json is a FIFO, or whose model.safetensors is truncated.
  const auto model = testing::make_temp_dir("cli_bad_model");
  ASSERT_EQ(::mkfifo((model / "config.json").c_str(), 0600), 0);
  auto r = run_kda("run --model " + model.string() + " --layer 0 --input " +
                   (testing::dumps_dir() / "T8.npz").string() + " --output " + (out / "out.npz").string());
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("FIFO"));
  fs::remove(model / "config.json");
  fs::copy_file(testing::dumps_dir() / "config.json", model / "config.json");
  {
    std::ofstream st(model / "model.safetensors", std::ios::binary);
    st << std::string("\x40\x00\x00\x00\x00\x00\x00\x00{\"w\":", 13);
  }
  r = run_kda("run --model " + model.string() + " --layer 0 --input " +
              (testing::dumps_dir() / "T8.npz").string() + " --output " + (out / "out.npz").string());
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr((model / "model.safetensors").string()));
  EXPECT_TRUE(fs::is_empty(out)) << ::testing::PrintToString(names_in(out));
}

TEST(CliBadInput, RunLeavesAnExistingOutputWhenItFails) {
  const auto dir = testing::make_temp_dir("cli_keep_out");
  const auto out = dir / "out.npz";
  { std::ofstream(out) << "the previous output"; }
  const auto r = run_kda("run --model " + testing::dumps_dir().string() + " --layer 0 --input " +
                         (dir / "absent.npz").string() + " --output " + out.string());
  EXPECT_NE(r.code, 0);
  std::ifstream in(out);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()),
            "the previous output");
  EXPECT_EQ(names_in(dir), std::vector<std::string>{"out.npz"});
  // An output path that is a directory: an error, and nothing written into or beside it.
  const auto r2 = run_kda("run --model " + testing::dumps_dir().string() + " --layer 0 --input " +
                          (testing::dumps_dir() / "T8.npz").string() + " --output " + dir.string());
  EXPECT_NE(r2.code, 0);
  EXPECT_THAT(r2.output, HasSubstr("is a directory"));
  EXPECT_EQ(names_in(dir), std::vector<std::string>{"out.npz"});
}

TEST(CliBadInput, VerifyRefusesEveryWrongKindOfCaseFile) {
  const auto scratch = testing::make_temp_dir("cli_verify_kinds");
  const auto inputs = wrong_kinds(scratch);
  for (const auto& p : inputs) {
    // A dump folder with the model and one case file of the wrong kind.
    const auto dir = testing::make_temp_dir("cli_verify_kind");
    for (const char* f : {"config.json", "model.safetensors"})
      fs::copy_file(testing::dumps_dir() / f, dir / f);
    fs::rename(p, dir / "T8.npz");
    const auto before = names_in(dir);
    const auto r = run_kda("verify --dumps " + dir.string() + " --precision fp32");
    EXPECT_NE(r.code, 0) << p;
    EXPECT_THAT(r.output, HasSubstr((dir / "T8.npz").string())) << r.output;
    EXPECT_EQ(names_in(dir), before);
  }
}

TEST(CliBadInput, SimulateRefusesEveryWrongKindOfTraceAndWritesNoOutputs) {
  const auto in = testing::make_temp_dir("cli_sim_bad_in");
  const auto out = testing::make_temp_dir("cli_sim_bad_out");
  auto inputs = wrong_kinds(in);
  { std::ofstream(in / "truncated.json") << R"([{"prompt_len": 4, "output_len": 2, "arrival_st)"; }
  inputs.push_back(in / "truncated.json");
  for (const auto& p : inputs) {
    const auto r = run_kda("simulate --layers 1 --vocab 16 --trace " + p.string() + " --outputs " +
                           (out / "o.npz").string());
    EXPECT_NE(r.code, 0) << p;
    EXPECT_THAT(r.output, HasSubstr("kda: error: " + p.string())) << r.output;
    EXPECT_TRUE(fs::is_empty(out)) << p << ": left " << ::testing::PrintToString(names_in(out));
  }
}

}  // namespace
}  // namespace kda
