// Every vendored dump case through the full stack (pool + backend + layer, one EXTEND batch, initial
// states in pool slots), in fp32 and bf16, with the prefill -> decode invariance: the checks of
// `kda verify`, at the spec's tolerances.
#include <gtest/gtest.h>

#include "kda/io/config.h"
#include "kda/io/safetensors.h"
#include "kda/runtime/verify.h"
#include "support/test_support.h"

namespace kda {
namespace {

struct DumpParam {
  std::string case_name;
  Precision precision;
  kernels::KernelImpl kernel;
};

class DumpCase : public ::testing::TestWithParam<DumpParam> {};

TEST_P(DumpCase, MatchesReferenceAndDecodeInvariance) {
  const auto& p = GetParam();
  const auto dir = testing::dumps_dir();
  const auto cfg = io::load_config(dir);
  const io::Checkpoint ckpt(dir);
  auto layer =
      models::KimiDeltaAttention::from_checkpoint(ckpt, cfg, cfg.kda_layer_ids().front(), p.precision);
  const auto rep = runtime::verify_case(*layer, cfg, dir / (p.case_name + ".npz"), p.kernel);
  ASSERT_FALSE(rep.rows.empty());
  for (const auto& r : rep.rows)
    EXPECT_TRUE(r.ok) << rep.name << " " << to_string(p.precision) << ": " << r.check << " " << r.metric
                      << " = " << r.value << " > " << r.limit;
}

std::vector<DumpParam> all_params() {
  std::vector<DumpParam> out;
  for (const auto& f : runtime::list_cases(testing::dumps_dir()))
    for (Precision p : {Precision::FP32, Precision::BF16})
      out.push_back({f.stem().string(), p, kernels::KernelImpl::Auto});
  // The reference kernels through the same stack, on a varlen case with initial states.
  out.push_back({"varlen_initstate", Precision::FP32, kernels::KernelImpl::Naive});
  out.push_back({"unbalanced_5_17_1_41", Precision::FP32, kernels::KernelImpl::Naive});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Mini, DumpCase, ::testing::ValuesIn(all_params()),
                         [](const ::testing::TestParamInfo<DumpParam>& i) {
                           return i.param.case_name + "_" + to_string(i.param.precision) + "_" +
                                  kernels::to_string(i.param.kernel);
                         });

TEST(DumpCases, AllTwelveArePresent) { EXPECT_EQ(runtime::list_cases(testing::dumps_dir()).size(), 12u); }

}  // namespace
}  // namespace kda
