// Replays the fuzz corpora through the fuzz targets' bodies (tests/fuzz/targets.cc), in the normal suite:
// every seed (tests/fuzz/<target>/, valid files) must be accepted, and every input that ever broke a
// target (tests/fuzz/regressions/<target>/) must now be refused or accepted cleanly -- no exception
// other than the parser's own std::runtime_error / std::invalid_argument, no broken round trip (an
// abort). The ASan + UBSan build of this suite (scripts/test.sh) checks them for memory errors and UB.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kda/io/config.h"
#include "kda/io/kimi_linear_48b.h"
#include "support/test_support.h"
#include "targets.h"

namespace kda {
namespace {

namespace fs = std::filesystem;

std::vector<uint8_t> slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<fs::path> files_in(const fs::path& dir) {
  std::vector<fs::path> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(FuzzCorpus, EveryTargetHasSeeds) {
  for (const auto& t : fuzz::kTargets)
    EXPECT_GE(files_in(fs::path(KDA_FUZZ_DIR) / t.name).size(), 2u) << "tests/fuzz/" << t.name;
}

TEST(FuzzCorpus, SeedsAreAccepted) {
  for (const auto& t : fuzz::kTargets)
    for (const auto& f : files_in(fs::path(KDA_FUZZ_DIR) / t.name)) {
      const auto bytes = slurp(f);
      bool ok = false;
      EXPECT_NO_THROW(ok = t.run(bytes.data(), bytes.size())) << f;
      EXPECT_TRUE(ok) << f << " is a seed, a valid input, but " << t.name << " refuses it";
    }
}

// The seed named after the published config (moonshotai/Kimi-Linear-48B-A3B-Instruct) is that config: 20
// KDA layers and 7 MLA layers, 27 among them, as the engine's own copy of it says.
TEST(FuzzCorpus, TheKimiLinear48bSeedIsThePublishedConfig) {
  const auto seed = io::load_model_config(fs::path(KDA_FUZZ_DIR) / "config" / "kimi_linear_48b.json");
  const auto real = io::kimi_linear_48b_config();
  kda::testing::expect_same_stack_config(seed, real);
  EXPECT_EQ(seed.kda_layers.size() + seed.full_attn_layers.size(), 27u);
  EXPECT_FALSE(seed.is_kda_layer(26));
}

TEST(FuzzCorpus, RegressionInputsAreHandledCleanly) {
  size_t n = 0;
  for (const auto& t : fuzz::kTargets)
    for (const auto& f : files_in(fs::path(KDA_FUZZ_DIR) / "regressions" / t.name)) {
      const auto bytes = slurp(f);
      EXPECT_NO_THROW(t.run(bytes.data(), bytes.size())) << f;
      ++n;
    }
  RecordProperty("inputs", static_cast<int>(n));
}

}  // namespace
}  // namespace kda
