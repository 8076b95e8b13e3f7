#include "kda/runtime/verify_model.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/io/file.h"
#include "kda/io/npy.h"
#include "kda/models/kimi_linear_case.h"
#include "kda/runtime/compare.h"
#include "kda/runtime/model_case.h"

namespace kda::runtime {

namespace {

constexpr double kLogitsTol = 1e-4;  // fp32: logits and hidden_final, atol = rtol
constexpr double kStateTol = 1e-5;   // fp32: KDA states and MLA cache rows, atol = rtol
constexpr double kBf16Factor = 2.0;  // bf16: x the case's own logits_bf16 rel L2
constexpr int kInvarianceTail = 8;   // the spec's k >= 8 decode steps

void add(CaseReport& r, std::string check, std::string metric, double value, double limit) {
  r.rows.push_back({std::move(check), std::move(metric), value, limit, value <= limit});
}

nlohmann::json read_json(const std::filesystem::path& file) {
  try {
    return nlohmann::json::parse(io::read_regular_text(file, "JSON file"));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(file.string() + ": " + e.what());
  }
}

models::ModelCaseResult run(models::KimiLinearForCausalLM& model, const TokenCase& c, int decode_tail) {
  models::ModelCaseOptions o;
  o.decode_tail = decode_tail;
  auto r = models::run_model_case(model, c.input_ids, c.cu_seqlens, o);
  gather_kda_states(r, model.config(), model.options().tp);
  return r;
}

// Every fp32 check of one run against the case's references; `prefix` names the run.
void check_fp32(CaseReport& rep, const std::string& run_name, const models::ModelCaseResult& r,
                const io::NpzArchive& npz, const std::filesystem::path& file) {
  const std::string m = "max err/tol";
  add(rep, run_name + "logits", m, max_err_ratio(r.logits, need(npz, "logits", file), kLogitsTol), 1.0);
  add(rep, run_name + "hidden_final", m,
      max_err_ratio(r.hidden_final, need(npz, "hidden_final", file), kLogitsTol), 1.0);
  const auto states = [&](const std::map<int, std::vector<float>>& got, const std::string& key) {
    for (const auto& [id, v] : got) {
      const std::string k = key + std::to_string(id);
      add(rep, run_name + k, m, max_err_ratio(v, need(npz, k, file), kStateTol), 1.0);
    }
  };
  states(r.kda_recurrent_state, "kda_recurrent_state_");
  states(r.kda_conv_state, "kda_conv_state_");
  states(r.mla_ckv, "mla_ckv_");
  states(r.mla_kpe, "mla_kpe_");
}

}  // namespace

bool is_model_dumps(const std::filesystem::path& dir) {
  const auto cfg = read_json(dir / "config.json");
  if (!cfg.is_object() || !cfg.contains("vocab_size")) return false;
  const auto cases = list_cases(dir);
  return !cases.empty() && is_token_case(io::read_npz(cases.front()));
}

ModelDumpsMeta read_model_dumps_meta(const std::filesystem::path& dir) {
  ModelDumpsMeta meta;
  const auto file = dir / "meta.json";
  if (!std::filesystem::exists(file)) return meta;
  const auto j = read_json(file);
  if (!j.is_object()) throw std::runtime_error(file.string() + " is not a JSON object");
  try {
    if (j.contains("moe_combine") && !j["moe_combine"].is_null())
      meta.moe_combine = models::parse_moe_combine(j["moe_combine"].get<std::string>());
    if (j.contains("kv_norm_eps") && !j["kv_norm_eps"].is_null())
      meta.kv_norm_eps = j["kv_norm_eps"].get<double>();
  } catch (const std::exception& e) {
    throw std::runtime_error(file.string() + ": " + e.what());
  }
  return meta;
}

int invariance_tail(const io::NpzArchive& npz, int64_t T, const std::filesystem::path& case_file) {
  auto it = npz.find("prefill_len");
  if (it == npz.end()) return kInvarianceTail;
  const auto v = it->second.to_i32();
  if (v.size() != 1 || v[0] < 0 || v[0] > T)
    throw std::runtime_error(case_file.string() + ": prefill_len must be one value in [0, " +
                             std::to_string(T) + "]");
  return static_cast<int>(T - v[0]);
}

CaseReport verify_model_case(models::KimiLinearForCausalLM& model, const std::filesystem::path& case_file) {
  const io::NpzArchive npz = io::read_npz(case_file);
  const TokenCase c = TokenCase::from_npz(npz, model.config(), case_file.string());
  CaseReport rep;
  rep.name = case_file.stem().string();
  rep.precision = model.precision();
  const int tail = invariance_tail(npz, c.T, case_file);
  const auto full = run(model, c, 0);
  const auto decoded = run(model, c, tail);  // sequences shorter than the tail decode every token
  const std::string tail_name = "decode tail " + std::to_string(tail) + ": ";

  if (model.precision() == Precision::FP32) {
    check_fp32(rep, "", full, npz, case_file);
    check_fp32(rep, tail_name, decoded, npz, case_file);
    if (npz.count("prefill_len")) {  // the decode_tail case's prefill alone, against its prefill_* states
      const auto pre = run(model, c.prefix(c.T - tail), 0);
      const std::string m = "max err/tol";
      for (const auto& [id, v] : pre.kda_recurrent_state) {
        const std::string k = "prefill_kda_recurrent_state_" + std::to_string(id);
        add(rep, "prefill: " + k, m, max_err_ratio(v, need(npz, k, case_file), kStateTol), 1.0);
      }
      for (const auto& [id, v] : pre.kda_conv_state) {
        const std::string k = "prefill_kda_conv_state_" + std::to_string(id);
        add(rep, "prefill: " + k, m, max_err_ratio(v, need(npz, k, case_file), kStateTol), 1.0);
      }
    }
  } else {
    const auto ref = need(npz, "logits", case_file);
    const double own = rel_l2(need(npz, "logits_bf16", case_file), ref);
    const std::string check = "logits (2x logits_bf16's rel L2)";
    add(rep, check, "rel L2", rel_l2(full.logits, ref), kBf16Factor * own);
    add(rep, tail_name + check, "rel L2", rel_l2(decoded.logits, ref), kBf16Factor * own);
  }
  return rep;
}

}  // namespace kda::runtime
