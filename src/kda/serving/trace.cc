#include "kda/serving/trace.h"

#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>

namespace kda::serving {

namespace {

using nlohmann::json;

int64_t int_field(const json& entry, const char* key, int64_t min, const std::string& where) {
  const auto it = entry.find(key);
  if (it == entry.end() || it->is_null())
    throw std::invalid_argument(where + ": missing field '" + key + "'");
  if (!it->is_number_integer())
    throw std::invalid_argument(where + ": field '" + key + "' must be an integer, got " + it->dump());
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT32_MAX))
    throw std::invalid_argument(where + ": field '" + key + "' is too large: " + it->dump());
  const int64_t v = it->get<int64_t>();
  if (v < min)
    throw std::invalid_argument(where + ": field '" + key + "' must be >= " + std::to_string(min) + ", got " +
                                std::to_string(v));
  if (v > INT32_MAX) throw std::invalid_argument(where + ": field '" + key + "' is too large: " + it->dump());
  return v;
}

// Every request costs its bookkeeping in memory up front; beyond this a typo is likelier than intent.
constexpr int64_t kMaxRequests = 10'000'000;

int32_t parse_positive(const std::string& s, const std::string& option, const std::string& text) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != s.size())
    throw std::invalid_argument(option + " '" + text + "': '" + s + "' is not an integer");
  if (v < 1) throw std::invalid_argument(option + " '" + text + "': lengths must be >= 1, got " + s);
  if (v > INT32_MAX) throw std::invalid_argument(option + " '" + text + "': " + s + " is too large");
  return static_cast<int32_t>(v);
}

}  // namespace

std::vector<RequestSpec> parse_trace(const std::string& json_text, const std::string& what) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::parse_error& e) {
    throw std::invalid_argument(what + ": not valid JSON: " + e.what());
  }
  if (!j.is_array())
    throw std::invalid_argument(what +
                                ": a trace must be a JSON list of {prompt_len, output_len, arrival_step}");
  if (j.empty()) throw std::invalid_argument(what + ": the trace holds no requests");
  std::vector<RequestSpec> reqs;
  reqs.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string where = what + ": request " + std::to_string(i);
    if (!j[i].is_object()) throw std::invalid_argument(where + " is not an object: " + j[i].dump());
    RequestSpec r;
    r.id = static_cast<int64_t>(i);
    // prompt_len 0 is refused: the first decode input is derived from the prompt's last output.
    r.prompt_len = static_cast<int32_t>(int_field(j[i], "prompt_len", 1, where));
    r.output_len = static_cast<int32_t>(int_field(j[i], "output_len", 0, where));
    r.arrival_step = int_field(j[i], "arrival_step", 0, where);
    reqs.push_back(r);
  }
  return reqs;
}

std::vector<RequestSpec> load_trace(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(path.string() + ": cannot open the trace file");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw std::invalid_argument(path.string() + ": cannot read the trace file");
  return parse_trace(ss.str(), path.string());
}

LenRange parse_len_range(const std::string& text, const std::string& option) {
  const size_t colon = text.find(':');
  LenRange r;
  if (colon == std::string::npos) {
    r.min = r.max = parse_positive(text, option, text);
  } else {
    r.min = parse_positive(text.substr(0, colon), option, text);
    r.max = parse_positive(text.substr(colon + 1), option, text);
  }
  if (r.min > r.max)
    throw std::invalid_argument(option + " '" + text + "': MIN " + std::to_string(r.min) + " > MAX " +
                                std::to_string(r.max));
  return r;
}

std::vector<RequestSpec> make_workload(int64_t requests, LenRange prompt, int32_t output_len, uint64_t seed) {
  if (requests < 1) throw std::invalid_argument("--requests must be >= 1, got " + std::to_string(requests));
  if (requests > kMaxRequests)
    throw std::invalid_argument("--requests " + std::to_string(requests) +
                                " is more than this simulator holds (" + std::to_string(kMaxRequests) + ")");
  if (prompt.min < 1 || prompt.min > prompt.max)
    throw std::invalid_argument("--prompt-len: need 1 <= MIN <= MAX, got " + std::to_string(prompt.min) +
                                ":" + std::to_string(prompt.max));
  if (output_len < 0)
    throw std::invalid_argument("--output-len must be >= 0, got " + std::to_string(output_len));
  // Lengths are drawn by hand from the raw 64-bit stream: std::uniform_int_distribution is not the
  // same across standard libraries, and a seed should name one workload.
  std::mt19937_64 rng(seed ^ 0x5eedf00dULL);
  const uint64_t span = static_cast<uint64_t>(prompt.max - prompt.min) + 1;
  std::vector<RequestSpec> reqs(static_cast<size_t>(requests));
  for (int64_t i = 0; i < requests; ++i) {
    reqs[i].id = i;
    reqs[i].prompt_len = prompt.min + static_cast<int32_t>(rng() % span);
    reqs[i].output_len = output_len;
    reqs[i].arrival_step = 0;
  }
  return reqs;
}

void validate_workload(const std::vector<RequestSpec>& reqs) {
  if (reqs.empty()) throw std::invalid_argument("the workload holds no requests");
  std::set<int64_t> ids;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto& r = reqs[i];
    const std::string where = "request " + std::to_string(i);
    if (r.id < 0) throw std::invalid_argument(where + ": negative id " + std::to_string(r.id));
    // The id seeds the inputs and names the outputs: two requests with one id would be one request.
    if (!ids.insert(r.id).second)
      throw std::invalid_argument(where + ": id " + std::to_string(r.id) + " is used twice");
    if (r.prompt_len < 1)
      throw std::invalid_argument(where + ": prompt_len must be >= 1, got " + std::to_string(r.prompt_len));
    if (r.output_len < 0)
      throw std::invalid_argument(where + ": output_len must be >= 0, got " + std::to_string(r.output_len));
    if (r.arrival_step < 0)
      throw std::invalid_argument(where + ": arrival_step must be >= 0, got " +
                                  std::to_string(r.arrival_step));
    if (r.sample_base < 0)
      throw std::invalid_argument(where + ": sample_base must be >= 0, got " + std::to_string(r.sample_base));
    if (static_cast<int64_t>(r.prompt_len) + r.output_len > INT32_MAX)
      throw std::invalid_argument(where + ": prompt_len + output_len exceeds 2^31 - 1");
  }
}

}  // namespace kda::serving
