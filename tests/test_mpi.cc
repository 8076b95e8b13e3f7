// Tensor parallelism across processes: `kda run` / `kda verify` started by mpirun with --tp N equal
// TP 1, and a launch unlike --tp is a clear error before any work. MPI errors are exceptions (the
// communicators return errors instead of MPI's fatal default), and a rank that fails mid-run ends every
// rank with a non-zero exit instead of leaving them in a collective.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "kda/distributed/mpi_communicator.h"
#include "kda/io/npy.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

testing::CommandResult sh(const std::string& cmd) { return testing::run_command(cmd + " 2>&1"); }

// mpirun as CI runs it: oversubscribed (2 cores, up to 4 ranks), allowed as root, no leak checker in
// the ranks (Open MPI's own allocations would be reported under ASan); under `timeout`, so that a launch
// whose ranks hang fails (exit 124) instead of holding the suite until ctest's limit.
constexpr const char* kMpiEnv =
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ASAN_OPTIONS=detect_leaks=0 "
    "OMP_NUM_THREADS=1 ";
std::string mpirun(int np, const std::string& program = KDA_BINARY_PATH) {
  return std::string(kMpiEnv) + "timeout 300 mpirun --oversubscribe -np " + std::to_string(np) + " " +
         program;
}

// `kda simulate --outputs` of two runs: every request's greedy tokens the same ids (tokens_<i>), its
// last-layer rows (req_<i>) within |a - b| <= tol + tol |b|.
void expect_same_requests(const io::NpzArchive& want, const io::NpzArchive& got, const std::string& context,
                          double tol = 1e-5) {
  ASSERT_EQ(got.size(), want.size()) << context;
  for (const auto& [key, arr] : want) {
    ASSERT_TRUE(got.count(key)) << key << ' ' << context;
    if (key.starts_with("tokens_")) {
      EXPECT_EQ(got.at(key).to_i32(), arr.to_i32()) << key << ' ' << context;
      continue;
    }
    const auto x = got.at(key).to_f32(), y = arr.to_f32();
    ASSERT_EQ(x.size(), y.size()) << key << ' ' << context;
    EXPECT_LE(testing::max_error_ratio(x.data(), y.data(), x.size(), tol, tol), 1.0) << key << ' ' << context;
  }
}

class Mpi : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!distributed::mpi_available()) GTEST_SKIP() << "built without MPI";
    if (sh("command -v mpirun").code != 0) GTEST_SKIP() << "mpirun not installed";
  }
};

TEST_F(Mpi, RunTp2AndTp4EqualTp1) {
  const auto dir = testing::dumps_dir();
  const auto tmp = testing::make_temp_dir("mpi_run");
  const std::string args = " run --model " + dir.string() + " --layer 0 --input " +
                           (dir / "varlen_initstate.npz").string() + " --decode-tail 8 --output ";
  const auto ref = sh(std::string(KDA_BINARY_PATH) + args + (tmp / "tp1.npz").string());
  ASSERT_EQ(ref.code, 0) << ref.output;
  const auto want = io::read_npz(tmp / "tp1.npz");
  for (int tp : {2, 4}) {
    const auto out = tmp / ("tp" + std::to_string(tp) + ".npz");
    const auto r = sh(mpirun(tp) + args + out.string() + " --tp " + std::to_string(tp));
    ASSERT_EQ(r.code, 0) << r.output;
    const auto got = io::read_npz(out);
    for (const char* key : {"out", "recurrent_state", "conv_state"}) {
      const auto a = got.at(key).to_f32(), b = want.at(key).to_f32();
      ASSERT_EQ(a.size(), b.size()) << key;
      EXPECT_LE(testing::max_error_ratio(a.data(), b.data(), a.size(), 1e-5, 1e-5), 1.0)
          << key << " at tp " << tp;
    }
  }
}

TEST_F(Mpi, VerifyPassesUnderTp2) {
  const auto r =
      sh(mpirun(2) + " verify --dumps " + testing::dumps_dir().string() + " --precision fp32 --tp 2");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("verify: 12 passed, 0 failed"));
}

// The serving driver under --tp 2: the same schedule on half the heads per rank gives every request
// the outputs of a TP 1 run (fp32, elementwise tolerance), and rank 0 reports a pool of half the bytes.
TEST_F(Mpi, SimulateTp2EqualsTp1) {
  const auto tmp = testing::make_temp_dir("mpi_sim");
  const std::string args =
      " simulate --layers 2 --vocab 1024 --requests 5 --prompt-len 4:40 --output-len 3 --precision fp32 "
      "--token-budget 50 "
      "--mixed --check 1 --json --no-prefix-cache --outputs ";  // pool_bytes: the request slots alone
  const auto one = sh(std::string(KDA_BINARY_PATH) + args + (tmp / "tp1.npz").string() + " 2>/dev/null");
  ASSERT_EQ(one.code, 0) << one.output;
  const auto two = sh(mpirun(2) + args + (tmp / "tp2.npz").string() + " --tp 2 2>/dev/null");
  ASSERT_EQ(two.code, 0) << two.output;
  const auto a = io::read_npz(tmp / "tp1.npz");
  ASSERT_EQ(a.size(), 10u);  // req_<i> and tokens_<i>
  expect_same_requests(a, io::read_npz(tmp / "tp2.npz"), "tp 2");
  EXPECT_THAT(one.output, HasSubstr("\"pool_bytes\": 26935296"));
  EXPECT_THAT(two.output, HasSubstr("\"pool_bytes\": 13467648"));
}

// Speculative decoding under --tp 2 (KDA, MLA and MoE layers): the verify steps split the heads as
// the decode steps do and agree on each row's greedy tokens, so a chain and a draft tree each accept
// the drafts a TP 1 run accepts and give every request its tokens, and its hidden rows within the spec's
// fp32 bound for the final hidden state (1e-4; four layers' reordered sums pass 1e-5 by a little).
TEST_F(Mpi, SpeculativeTp2EqualsTp1) {
  const auto tmp = testing::make_temp_dir("mpi_spec");
  // Fixed depth: the adaptive one follows measured step times, so two runs may draft differently.
  for (const std::string flags : {" --draft-tokens 4", " --draft-topk 2"}) {
    const std::string args =
        " simulate --layers 4 --vocab 1024 --requests 5 --prompt-len 4:40 --output-len 12 --precision fp32 "
        "--speculative replay --draft-depth fixed --check 1 --json" +
        flags + " --outputs ";
    const auto one = sh(std::string(KDA_BINARY_PATH) + args + (tmp / "tp1.npz").string() + " 2>/dev/null");
    ASSERT_EQ(one.code, 0) << one.output;
    std::smatch accepted;
    ASSERT_TRUE(std::regex_search(one.output, accepted, std::regex("\"spec_accepted_tokens\": [1-9][0-9]*,")))
        << "no draft accepted at tp 1, so the test would not reach the verify path\n"
        << one.output;
    const auto two = sh(mpirun(2) + args + (tmp / "tp2.npz").string() + " --tp 2 2>/dev/null");
    ASSERT_EQ(two.code, 0) << two.output;
    EXPECT_THAT(two.output, HasSubstr(accepted.str())) << flags;
    EXPECT_THAT(two.output, HasSubstr("\"check_ok\": true")) << flags;
    const auto a = io::read_npz(tmp / "tp1.npz");
    ASSERT_EQ(a.size(), 10u);  // req_<i> and tokens_<i>
    expect_same_requests(a, io::read_npz(tmp / "tp2.npz"), "tp 2" + flags, 1e-4);
  }
}

// Data-parallel attention: DP 2 x TP 1 and DP 2 x TP 2 serve the same workload (requests split over the
// groups, each group with its own pool) with the per-request outputs of a single-process run.
TEST_F(Mpi, SimulateDp2EqualsOneGroup) {
  const auto tmp = testing::make_temp_dir("mpi_dp");
  const std::string args =
      " simulate --layers 2 --vocab 1024 --requests 5 --prompt-len 4:40 --output-len 3 --precision fp32 "
      "--token-budget 50 "
      "--mixed --check 2 --json --outputs ";
  const auto one = sh(std::string(KDA_BINARY_PATH) + args + (tmp / "dp1.npz").string() + " 2>/dev/null");
  ASSERT_EQ(one.code, 0) << one.output;
  const auto a = io::read_npz(tmp / "dp1.npz");
  ASSERT_EQ(a.size(), 10u);  // req_<i> and tokens_<i>
  for (auto [np, flags] : {std::pair{2, " --dp 2"}, std::pair{4, " --dp 2 --tp 2"}}) {
    const auto out = tmp / ("dp_" + std::to_string(np) + ".npz");
    const auto r = sh(mpirun(np) + args + out.string() + flags + " 2>/dev/null");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("\"requests_completed\": 5"));
    EXPECT_THAT(r.output, HasSubstr("\"check_ok\": true"));
    expect_same_requests(a, io::read_npz(out), flags);
  }
  const auto bad =
      sh(mpirun(2) +
         " simulate --layers 1 --vocab 1024 --requests 1 --prompt-len 4:8 --output-len 1 --check 0 --dp 2");
  EXPECT_NE(bad.code, 0);
  EXPECT_THAT(bad.output, HasSubstr("at least as many requests"));
}

TEST_F(Mpi, LaunchUnlikeTpIsAnError) {
  const auto dir = testing::dumps_dir().string();
  const std::string args =
      " run --model " + dir + " --layer 0 --input " + dir + "/T8.npz --output /tmp/kda_x.npz";
  auto r = sh(mpirun(3) + args + " --tp 2");
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("started with 3 ranks but --tp 2"));
  r = sh(mpirun(3) + args + " --tp 3");  // 4 heads
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("divisible"));
}

// --- inside the ranks: this test binary started by mpirun (MpiErrors.CommunicatorErrorsAreExceptions) -----

// Runs only as a rank of that launch; a plain ctest run skips it.
class MpiRank : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::getenv("KDA_TEST_INSIDE_MPIRUN") == nullptr || !distributed::launched_by_mpi())
      GTEST_SKIP() << "runs as a rank of MpiErrors.CommunicatorErrorsAreExceptions";
  }
};

// A call MPI refuses (a negative color other than MPI_UNDEFINED) is a std::runtime_error naming the
// call and MPI's reason, and the communicator stays usable. Under MPI_ERRORS_ARE_FATAL the process
// would end inside MPI_Comm_split, and mpirun with it.
TEST_F(MpiRank, AFailedCallThrowsAndTheCommunicatorStaysUsable) {
  auto world = distributed::mpi_world();
  testing::expect_throw_with<std::runtime_error>([&] { distributed::mpi_split(*world, -5, 0); },
                                                 "MPI error in MPI_Comm_split: ");
  float x = 1.0f;
  world->allreduce_sum(&x, 1);
  EXPECT_EQ(x, static_cast<float>(world->size()));
  auto half = distributed::mpi_split(*world, world->rank() % 2, world->rank());
  testing::expect_throw_with<std::runtime_error>([&] { distributed::mpi_split(*half, -7, 0); },
                                                 "MPI_Comm_split");  // splits return errors too
}

std::string self_path() {
  std::array<char, 4096> buf{};
  const ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  return n > 0 ? std::string(buf.data(), static_cast<size_t>(n)) : std::string();
}

TEST_F(Mpi, CommunicatorErrorsAreExceptions) {
  const auto self = self_path();
  ASSERT_FALSE(self.empty());
  const auto r =
      sh("KDA_TEST_INSIDE_MPIRUN=1 " + mpirun(2, self) + " --gtest_filter='MpiRank.*' --gtest_color=no");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[  PASSED  ] 1 test."));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("SKIPPED")));
}

// One rank fails mid-run: `kda simulate --tp 2` where rank 1 (an MPMD launch: its own command line) has
// a vocabulary of 2 tokens while rank 0 has 512. Both serve the same trace (prompt tokens below 2); every
// rank feeds rank 0's greedy picks, so rank 1's first decode step meets a token id it does not have and
// throws while rank 0 waits for it in the layer's all-reduce. Every rank must exit non-zero (mpirun's
// status), with rank 1's error printed, and none may hang (timeout's 124 would say so).
TEST_F(Mpi, ARankThatFailsMidRunEndsEveryRank) {
  const auto tmp = testing::make_temp_dir("mpi_fail");
  std::ofstream(tmp / "trace.json")
      << R"([{"prompt": [1, 0, 1, 1, 0, 1], "output_len": 8, "arrival_step": 0}])";
  const std::string args =
      " simulate --tp 2 --layers 1 --precision fp32 --check 0 --no-prefix-cache --trace " +
      (tmp / "trace.json").string() + " --vocab ";
  const std::string env =
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ASAN_OPTIONS=detect_leaks=0 "
      "OMP_NUM_THREADS=1 ";
  const auto r = sh(env + "timeout 300 mpirun --oversubscribe -np 1 " + KDA_BINARY_PATH + args +
                    "512 : -np 1 " + KDA_BINARY_PATH + args + "2");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.code, 124) << "timed out: a rank hangs\n" << r.output;
  EXPECT_THAT(r.output, HasSubstr("kda: error: token id"));
  EXPECT_THAT(r.output, HasSubstr("outside the vocabulary [0, 2)"));
  // No rank finished: the failed rank's MPI_Abort ended rank 0 in its all-reduce. (mpirun's own "MPI_ABORT
  // was invoked on rank 1" notice is not asserted: under load its help-text printing fails at times with
  // "ORTE_ERROR_LOG: Out of resource in file .../show_help.c", seen in a ctest -j2 run.)
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("built in")));
}

}  // namespace
}  // namespace kda
