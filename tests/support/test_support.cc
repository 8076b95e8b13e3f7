#include "support/test_support.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "kda/layers/onednn_isa.h"

namespace kda::testing {

std::filesystem::path dumps_dir() { return std::filesystem::path(KDA_TEST_DATA_DIR) / "kda_dumps" / "mini"; }

std::filesystem::path model_dumps_dir() {
  return std::filesystem::path(KDA_TEST_DATA_DIR) / "model_dumps" / "tiny";
}

int64_t proc_status_kb(const std::string& field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.compare(0, field.size() + 1, field + ":") == 0) return std::stoll(line.substr(field.size() + 1));
  return -1;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path.string());
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

namespace {

// The folders make_temp_dir made, removed when the test process exits: the suite writes checkpoints at
// real widths, and leaving them behind filled a CI machine's disk halfway through a run. Only the
// process that made a folder removes it (a forked child that exits normally leaves them alone).
struct TempDirs {
  pid_t owner = ::getpid();
  std::mutex mutex;
  std::vector<std::filesystem::path> paths;
  ~TempDirs() {
    if (::getpid() != owner) return;
    for (const auto& p : paths) {
      std::error_code ec;  // best effort: a folder a test removed itself is not an error
      std::filesystem::remove_all(p, ec);
    }
  }
};

TempDirs& temp_dirs() {
  static TempDirs dirs;
  return dirs;
}

}  // namespace

std::filesystem::path make_temp_dir(const std::string& tag) {
  auto p = std::filesystem::temp_directory_path() / ("kda_test_" + tag + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  auto& dirs = temp_dirs();
  const std::lock_guard<std::mutex> lock(dirs.mutex);
  if (std::find(dirs.paths.begin(), dirs.paths.end(), p) == dirs.paths.end()) dirs.paths.push_back(p);
  return p;
}

std::vector<float> random_normal(size_t n, uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<bf16_t> random_bf16(size_t n, uint64_t seed) {
  const std::vector<float> f = random_normal(n, seed);
  std::vector<bf16_t> b(n);
  f32_to_bf16_array(f.data(), b.data(), n);
  return b;
}

std::vector<bf16_t> abs_bf16(std::vector<bf16_t> v) {
  for (bf16_t& h : v) h = static_cast<bf16_t>(h & 0x7fffu);
  return v;
}

int64_t fp32_sum_mismatches(const float* y, int64_t M, int64_t ldy, const float* ref, const float* mag,
                            int64_t N, int64_t K, const std::string& what) {
  int64_t bad = 0;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      const double tol = 2.0 * K * std::ldexp(static_cast<double>(mag[m * N + n]), -24) * 1.01;
      if (!(std::fabs(y[m * ldy + n] - ref[m * N + n]) <= tol) && bad++ < 3)
        ADD_FAILURE() << what << ": y[" << m << ", " << n << "] = " << y[m * ldy + n] << ", reference "
                      << ref[m * N + n] << " (tolerance " << tol << ")";
    }
    for (int64_t n = N; n < ldy; ++n)
      if (y[m * ldy + n] != 7.0f && bad++ < 3) ADD_FAILURE() << what << ": column " << n << " past N written";
  }
  return bad;
}

std::vector<float> random_uniform(size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

double max_error_ratio(const float* a, const float* b, size_t n, double atol, double rtol) {
  double worst = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (std::isnan(d)) return INFINITY;
    worst = std::max(worst, d / (atol + rtol * std::fabs(static_cast<double>(b[i]))));
  }
  return worst;
}

double rel_l2(const float* a, const float* b, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

void expect_same_stack_config(const io::KimiLinearConfig& got, const io::KimiLinearConfig& want) {
  EXPECT_EQ(got.hidden_size, want.hidden_size);
  EXPECT_EQ(got.rms_norm_eps, want.rms_norm_eps);
  EXPECT_EQ(got.num_hidden_layers, want.num_hidden_layers);
  EXPECT_EQ(got.num_heads, want.num_heads);
  EXPECT_EQ(got.head_dim, want.head_dim);
  EXPECT_EQ(got.short_conv_kernel_size, want.short_conv_kernel_size);
  EXPECT_EQ(got.kda_layers, want.kda_layers);
  EXPECT_EQ(got.full_attn_layers, want.full_attn_layers);
  EXPECT_EQ(got.has_model_fields, want.has_model_fields);
  if (!got.has_model_fields || !want.has_model_fields) return;
  EXPECT_EQ(got.vocab_size, want.vocab_size);
  EXPECT_EQ(got.tie_word_embeddings, want.tie_word_embeddings);
  EXPECT_EQ(got.num_attention_heads, want.num_attention_heads);
  EXPECT_EQ(got.num_key_value_heads, want.num_key_value_heads);
  EXPECT_EQ(got.kv_lora_rank, want.kv_lora_rank);
  EXPECT_EQ(got.qk_nope_head_dim, want.qk_nope_head_dim);
  EXPECT_EQ(got.qk_rope_head_dim, want.qk_rope_head_dim);
  EXPECT_EQ(got.v_head_dim, want.v_head_dim);
  EXPECT_EQ(got.intermediate_size, want.intermediate_size);
  EXPECT_EQ(got.first_k_dense_replace, want.first_k_dense_replace);
  EXPECT_EQ(got.moe_layer_freq, want.moe_layer_freq);
  EXPECT_EQ(got.num_experts, want.num_experts);
  EXPECT_EQ(got.num_experts_per_token, want.num_experts_per_token);
  EXPECT_EQ(got.num_shared_experts, want.num_shared_experts);
  EXPECT_EQ(got.moe_intermediate_size, want.moe_intermediate_size);
  EXPECT_EQ(got.moe_renormalize, want.moe_renormalize);
  EXPECT_EQ(got.routed_scaling_factor, want.routed_scaling_factor);
  EXPECT_EQ(got.bos_token_id, want.bos_token_id);
  EXPECT_EQ(got.eos_token_id, want.eos_token_id);
  EXPECT_EQ(got.pad_token_id, want.pad_token_id);
}

namespace {
std::string& refused_reason() {
  static std::string r;
  return r;
}
class BatchInvariance : public ::testing::Environment {
 public:
  void SetUp() override {
    try {
      layers::make_bf16_batch_invariant();
    } catch (const std::runtime_error& e) {
      refused_reason() = e.what();
      std::printf("  not batch-invariant: %s\n", e.what());
    }
  }
};
}  // namespace

::testing::Environment* ask_batch_invariance() {
  return ::testing::AddGlobalTestEnvironment(new BatchInvariance);
}
const std::string& batch_invariance_refused() { return refused_reason(); }

}  // namespace kda::testing
