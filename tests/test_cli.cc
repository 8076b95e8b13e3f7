// The kda binary as a user drives it: `kda run` and `kda verify`, their outputs, exit codes and errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

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

}  // namespace
}  // namespace kda
