// Shared helpers for the test suite.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/io/config.h"

namespace kda::testing {

// Whether a sanitizer's allocator (ASan, TSan) stands in for the C library's: malloc's statistics and
// resident memory then measure the sanitizer's bookkeeping (shadow memory, quarantine), not the program.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitizedMalloc = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitizedMalloc = true;
#else
inline constexpr bool kSanitizedMalloc = false;
#endif
#else
inline constexpr bool kSanitizedMalloc = false;
#endif

// The vendored reference dumps: tests/data/kda_dumps/mini.
std::filesystem::path dumps_dir();
// The vendored whole-model reference dumps: tests/data/model_dumps/tiny (4 layers in the real pattern).
std::filesystem::path model_dumps_dir();
// kB of a /proc/self/status field (VmRSS, VmHWM), -1 when unavailable.
int64_t proc_status_kb(const std::string& field);
// A file's bytes as text (std::runtime_error when it cannot be read).
std::string read_file(const std::filesystem::path& path);
// A fresh empty temporary directory for one test, removed with everything in it when the process exits.
std::filesystem::path make_temp_dir(const std::string& tag);

std::vector<float> random_normal(size_t n, uint64_t seed, float stddev = 1.0f);
std::vector<float> random_uniform(size_t n, uint64_t seed, float lo, float hi);
// random_normal's values rounded to bf16 (nearest even).
std::vector<bf16_t> random_bf16(size_t n, uint64_t seed);
// In a test body: skipped where the CPU (or the build) has no AMX-BF16 (kernels/gemm/bf16_amx.h).
#define SKIP_WITHOUT_AMX_BF16() \
  if (!kda::kernels::gemm::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 on this CPU or in this build"
// v with every value's sign cleared (|v|: the magnitudes a bf16 GEMM's rounding bound scales with).
std::vector<bf16_t> abs_bf16(std::vector<bf16_t> v);
// A bf16 GEMM's rows y [M, ldy] against its reference ref [>= M, N] (row stride N): each |y - ref| within
// 2 K 2^-24 mag (two fp32 sums of the same exact products in different orders; mag: the reference on |x|
// and |W|), and y's columns past N still 7. The first mismatches are reported with `what`; their count.
int64_t fp32_sum_mismatches(const float* y, int64_t M, int64_t ldy, const float* ref, const float* mag,
                            int64_t N, int64_t K, const std::string& what);

// Worst |a-b| / (atol + rtol*|b|) over all elements (<= 1 means within tolerance).
double max_error_ratio(const float* a, const float* b, size_t n, double atol, double rtol);
double rel_l2(const float* a, const float* b, size_t n);

// Runs a shell command; its exit code and what it printed on stdout (add " 2>&1" for stderr too).
struct CommandResult {
  int code = -1;
  std::string output;
};
CommandResult run_command(const std::string& cmd);

// fn throws an E whose message contains needle.
template <class E>
void expect_throw_with(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one mentioning '" << needle << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

// A test binary that needs bf16 rows independent of their batch (layers/onednn_isa.h) calls this at
// namespace scope: a global test environment that asks for it before any test builds a kernel. What
// refused it (the environment chose oneDNN's ISA) is batch_invariance_refused(), "" when granted.
::testing::Environment* ask_batch_invariance();
const std::string& batch_invariance_refused();

// The KDA stack's fields of two configs agree (sizes, eps, the layer pattern): what the model reads.
void expect_same_stack_config(const io::KimiLinearConfig& got, const io::KimiLinearConfig& want);

}  // namespace kda::testing
