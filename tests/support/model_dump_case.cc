#include "support/model_dump_case.h"

#include <gtest/gtest.h>

#include <stdexcept>

#include "support/test_support.h"

namespace kda::testing {

std::vector<float> ModelDumpCase::f32(const std::string& key) const {
  const auto it = npz.find(key);
  if (it == npz.end()) throw std::runtime_error("model dump case " + name + " has no array '" + key + "'");
  return it->second.to_f32();
}

std::vector<std::string> model_dump_case_names() {
  return {"T1", "T7", "T64", "T65", "T200", "varlen_3", "decode_tail"};
}

ModelDumpCase load_model_dump_case(const std::string& name) {
  ModelDumpCase c;
  c.name = name;
  c.npz = io::read_npz(model_dumps_dir() / (name + ".npz"));
  c.input_ids = c.npz.at("input_ids").to_i32();
  if (c.npz.count("cu_seqlens")) c.cu_seqlens = c.npz.at("cu_seqlens").to_i32();
  return c;
}

namespace {
void expect_within(const std::vector<float>& got, const std::vector<float>& want, double tol,
                   const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_LE(max_error_ratio(got.data(), want.data(), got.size(), tol, tol), 1.0) << what;
}
}  // namespace

void expect_case_fp32(const models::ModelCaseResult& r, const ModelDumpCase& c, const std::string& what) {
  const std::string at = what + " (" + c.name + ")";
  expect_within(r.logits, c.f32("logits"), 1e-4, at + " logits");
  expect_within(r.hidden_final, c.f32("hidden_final"), 1e-4, at + " hidden_final");
  for (const auto& [id, s] : r.kda_recurrent_state)
    expect_within(s, c.f32("kda_recurrent_state_" + std::to_string(id)), 1e-5,
                  at + " kda_recurrent_state_" + std::to_string(id));
  for (const auto& [id, s] : r.kda_conv_state)
    expect_within(s, c.f32("kda_conv_state_" + std::to_string(id)), 1e-5,
                  at + " kda_conv_state_" + std::to_string(id));
  for (const auto& [id, s] : r.mla_ckv)
    expect_within(s, c.f32("mla_ckv_" + std::to_string(id)), 1e-5, at + " mla_ckv_" + std::to_string(id));
  for (const auto& [id, s] : r.mla_kpe)
    expect_within(s, c.f32("mla_kpe_" + std::to_string(id)), 1e-5, at + " mla_kpe_" + std::to_string(id));
}

}  // namespace kda::testing
