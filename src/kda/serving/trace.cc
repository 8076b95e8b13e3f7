#include "kda/serving/trace.h"

#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <stdexcept>

#include "kda/common/seeded.h"
#include "kda/io/file.h"
#include "kda/io/json_brief.h"

namespace kda::serving {

namespace {

using nlohmann::json;

int64_t int_field(const json& entry, const char* key, int64_t min, const std::string& where) {
  const auto it = entry.find(key);
  if (it == entry.end() || it->is_null())
    throw std::invalid_argument(where + ": missing field '" + key + "'");
  if (!it->is_number_integer())
    throw std::invalid_argument(where + ": field '" + key + "' must be an integer, got " +
                                io::json_brief(*it));
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT32_MAX))
    throw std::invalid_argument(where + ": field '" + key + "' is too large: " + io::json_brief(*it));
  const int64_t v = it->get<int64_t>();
  if (v < min)
    throw std::invalid_argument(where + ": field '" + key + "' must be >= " + std::to_string(min) + ", got " +
                                std::to_string(v));
  if (v > INT32_MAX)
    throw std::invalid_argument(where + ": field '" + key + "' is too large: " + io::json_brief(*it));
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

// A request's tokens, and the running total of the workload's, within the bounds (trace.h).
void check_request_tokens(int64_t prompt_len, int64_t output_len, int64_t& workload_tokens,
                          const std::string& where) {
  const int64_t n = prompt_len + output_len;
  if (n > kMaxRequestTokens)
    throw std::invalid_argument(where + ": prompt_len + output_len is " + std::to_string(n) +
                                " tokens, more than a request may have (" +
                                std::to_string(kMaxRequestTokens) + ")");
  workload_tokens += n;
  if (workload_tokens > kMaxWorkloadTokens)
    throw std::invalid_argument(where + ": the workload's requests reach " + std::to_string(workload_tokens) +
                                " tokens (prompt_len + output_len), more than a workload may have (" +
                                std::to_string(kMaxWorkloadTokens) + ")");
}

}  // namespace

namespace {

void check_tokens(const std::vector<int32_t>& ids, int64_t vocab, const std::string& where) {
  for (size_t k = 0; k < ids.size(); ++k) {
    if (ids[k] < 0)
      throw std::invalid_argument(where + ": token id " + std::to_string(ids[k]) + " at position " +
                                  std::to_string(k) + " is negative");
    if (vocab > 0 && ids[k] >= vocab)
      throw std::invalid_argument(where + ": token id " + std::to_string(ids[k]) + " at position " +
                                  std::to_string(k) + " is >= the vocabulary size " + std::to_string(vocab) +
                                  " (--vocab)");
  }
}

std::vector<int32_t> token_list(const json& entry, const std::string& where) {
  const auto& p = entry.at("prompt");
  if (!p.is_array()) throw std::invalid_argument(where + ": field 'prompt' must be a list of token ids");
  std::vector<int32_t> ids;
  ids.reserve(p.size());
  for (size_t k = 0; k < p.size(); ++k) {
    if (!p[k].is_number_integer())
      throw std::invalid_argument(where + ": field 'prompt' position " + std::to_string(k) +
                                  " is not an integer token id: " + io::json_brief(p[k]));
    if (p[k].is_number_unsigned() ? p[k].get<uint64_t>() > static_cast<uint64_t>(INT32_MAX)
                                  : (p[k].get<int64_t>() < INT32_MIN || p[k].get<int64_t>() > INT32_MAX))
      throw std::invalid_argument(where + ": field 'prompt' position " + std::to_string(k) +
                                  " is out of range: " + io::json_brief(p[k]));
    ids.push_back(static_cast<int32_t>(p[k].get<int64_t>()));
  }
  return ids;
}

bool has(const json& entry, const char* key) {
  const auto it = entry.find(key);
  return it != entry.end() && !it->is_null();
}

}  // namespace

std::vector<RequestSpec> parse_trace(const std::string& json_text, const std::string& what, int64_t vocab) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1E999
    throw std::invalid_argument(what + ": not valid JSON: " + e.what());
  }
  if (!j.is_array())
    throw std::invalid_argument(
        what + ": a trace must be a JSON list of {prompt_len | prompt, output_len, arrival_step}");
  if (j.empty()) throw std::invalid_argument(what + ": the trace holds no requests");
  // Where each (session, turn) is listed first: to tell a turn listed before its predecessor from a
  // session that has no such predecessor.
  std::map<std::pair<int64_t, int64_t>, size_t> listed;
  for (size_t i = 0; i < j.size(); ++i)
    if (j[i].is_object() && has(j[i], "session") && has(j[i], "turn") &&
        j[i]["session"].is_number_integer() && j[i]["turn"].is_number_integer())
      listed.emplace(std::make_pair(j[i]["session"].get<int64_t>(), j[i]["turn"].get<int64_t>()), i);
  std::map<int64_t, std::pair<int64_t, size_t>> last;  // session -> (its latest turn, that request)
  std::vector<RequestSpec> reqs;
  reqs.reserve(j.size());
  int64_t workload_tokens = 0;
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string where = what + ": request " + std::to_string(i);
    if (!j[i].is_object()) throw std::invalid_argument(where + " is not an object: " + io::json_brief(j[i]));
    const json& e = j[i];
    RequestSpec r;
    r.id = static_cast<int64_t>(i);
    r.output_len = static_cast<int32_t>(int_field(e, "output_len", 0, where));
    int64_t turn = 0;
    if (has(e, "session")) {
      const int64_t session = int_field(e, "session", 0, where);
      turn = int_field(e, "turn", 0, where);
      const std::string st = "session " + std::to_string(session) + " turn " + std::to_string(turn);
      const auto it = last.find(session);
      if (turn == 0) {
        if (it != last.end())
          throw std::invalid_argument(where + ": " + st + " is listed after turn " +
                                      std::to_string(it->second.first) + " (request " +
                                      std::to_string(it->second.second) + ") of the session");
      } else if (it == last.end() || it->second.first != turn - 1) {
        const auto pred = listed.find({session, turn - 1});
        if (it != last.end() && it->second.first >= turn)
          throw std::invalid_argument(where + ": " + st + " is listed after turn " +
                                      std::to_string(it->second.first) + " (request " +
                                      std::to_string(it->second.second) + ") of the session");
        if (pred != listed.end() && pred->second > i)
          throw std::invalid_argument(where + ": " + st + " comes before its predecessor (turn " +
                                      std::to_string(turn - 1) + ", request " + std::to_string(pred->second) +
                                      "): a session's turns must be listed in order");
        throw std::invalid_argument(where + ": " + st + ": the session has no turn " +
                                    std::to_string(turn - 1) +
                                    " (turns are numbered 0, 1, 2, ... in list order)");
      } else {
        r.after = static_cast<int64_t>(it->second.second);
      }
      last[session] = {turn, i};
    } else if (has(e, "turn")) {
      throw std::invalid_argument(where + ": field 'turn' needs a 'session'");
    }
    // A first turn's prompt_len 0 is refused: the first token is picked from the prompt's last output.
    // A later turn may add no tokens: its prompt ends with the previous turn's last generated token.
    const int64_t min_own = r.after >= 0 ? 0 : 1;
    int64_t own = -1;
    if (has(e, "prompt")) {
      r.prompt = token_list(e, where);
      check_tokens(r.prompt, vocab, where + ": field 'prompt'");
      own = static_cast<int64_t>(r.prompt.size());
      if (own < min_own) throw std::invalid_argument(where + ": field 'prompt' holds no tokens");
      if (has(e, "prompt_len") && int_field(e, "prompt_len", min_own, where) != own)
        throw std::invalid_argument(where + ": field 'prompt_len' " + io::json_brief(e["prompt_len"]) +
                                    " is not the " + std::to_string(own) + " ids of 'prompt'");
    } else if (r.after >= 0 && !has(e, "prompt_len")) {
      own = 0;
    } else {
      own = int_field(e, "prompt_len", min_own, where);
    }
    if (r.after >= 0) {
      const RequestSpec& prev = reqs[r.after];
      const int64_t total = int64_t{prev.prompt_len} + prev.output_len + 1 + own;
      if (total > INT32_MAX)
        throw std::invalid_argument(where + ": the session's prompt would exceed 2^31 - 1 tokens");
      r.turn_len = static_cast<int32_t>(own);
      r.prompt_len = static_cast<int32_t>(total);
      r.arrival_step = has(e, "arrival_step") ? int_field(e, "arrival_step", 0, where) : 0;
    } else {
      r.prompt_len = static_cast<int32_t>(own);
      r.arrival_step = int_field(e, "arrival_step", 0, where);
    }
    check_request_tokens(r.prompt_len, r.output_len, workload_tokens, where);
    reqs.push_back(std::move(r));
  }
  return reqs;
}

std::vector<RequestSpec> load_trace(const std::filesystem::path& path, int64_t vocab) {
  std::string text;
  try {
    text = io::read_regular_text(path, "trace file");
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(e.what());  // every trace error is an invalid_argument
  }
  return parse_trace(text, path.string(), vocab);
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

WorkloadKind parse_workload_kind(const std::string& text) {
  if (text == "random") return WorkloadKind::kRandom;
  if (text == "shared-prefix") return WorkloadKind::kSharedPrefix;
  if (text == "multi-turn") return WorkloadKind::kMultiTurn;
  throw std::invalid_argument("--workload '" + text + "': expected random, shared-prefix or multi-turn");
}

const char* to_string(WorkloadKind k) {
  switch (k) {
    case WorkloadKind::kSharedPrefix:
      return "shared-prefix";
    case WorkloadKind::kMultiTurn:
      return "multi-turn";
    default:
      return "random";
  }
}

std::vector<RequestSpec> make_workload(const WorkloadOptions& w) {
  if (w.requests < 1)
    throw std::invalid_argument("--requests must be >= 1, got " + std::to_string(w.requests));
  if (w.prompt.min < 1 || w.prompt.min > w.prompt.max)
    throw std::invalid_argument("--prompt-len: need 1 <= MIN <= MAX, got " + std::to_string(w.prompt.min) +
                                ":" + std::to_string(w.prompt.max));
  if (w.output_len < 0)
    throw std::invalid_argument("--output-len must be >= 0, got " + std::to_string(w.output_len));
  if (w.vocab < 1) throw std::invalid_argument("--vocab must be >= 1, got " + std::to_string(w.vocab));
  if (w.prefix_groups < 1)
    throw std::invalid_argument("--prefix-groups must be >= 1, got " + std::to_string(w.prefix_groups));
  if (w.shared_prefix_len < 0)
    throw std::invalid_argument("--shared-prefix-len must be >= 0, got " +
                                std::to_string(w.shared_prefix_len));
  if (w.turns < 1) throw std::invalid_argument("--turns must be >= 1, got " + std::to_string(w.turns));
  const bool multi = w.kind == WorkloadKind::kMultiTurn;
  if (w.kind == WorkloadKind::kRandom && (w.prefix_groups != 1 || w.shared_prefix_len != 0))
    throw std::invalid_argument(
        "--prefix-groups and --shared-prefix-len need --workload shared-prefix or multi-turn");
  if (w.kind == WorkloadKind::kSharedPrefix && w.shared_prefix_len < 1)
    throw std::invalid_argument("--workload shared-prefix needs --shared-prefix-len >= 1");
  if (!multi && w.turns != 1) throw std::invalid_argument("--turns needs --workload multi-turn");
  if (w.requests > kMaxRequests / w.turns)
    throw std::invalid_argument("--requests " + std::to_string(w.requests) +
                                (multi ? " x --turns " + std::to_string(w.turns) : "") +
                                " is more than this simulator holds (" + std::to_string(kMaxRequests) + ")");
  const int64_t N = multi ? w.turns : 1, total = w.requests * N;
  int64_t workload_tokens = 0;
  // Lengths are drawn by hand from the raw 64-bit stream: std::uniform_int_distribution is not the
  // same across standard libraries, and a seed should name one workload.
  std::mt19937_64 rng(w.seed ^ 0x5eedf00dULL);
  const uint64_t span = static_cast<uint64_t>(w.prompt.max - w.prompt.min) + 1;
  std::vector<RequestSpec> reqs(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) {
    RequestSpec& r = reqs[i];
    r.id = i;
    r.output_len = w.output_len;
    r.arrival_step = 0;
    const int32_t own = w.prompt.min + static_cast<int32_t>(rng() % span);
    const int64_t conv = i / N, turn = i % N;
    if (turn > 0) {  // own tokens: seeded at serve time, from (seed, id, position)
      const RequestSpec& prev = reqs[i - 1];
      r.after = i - 1;
      r.turn_len = own;
      const int64_t len = int64_t{prev.prompt_len} + prev.output_len + 1 + own;
      check_request_tokens(len, r.output_len, workload_tokens,
                           "--turns: request " + std::to_string(i) + " (turn " + std::to_string(turn) + ")");
      r.prompt_len = static_cast<int32_t>(len);
      continue;
    }
    const int32_t S = w.kind == WorkloadKind::kRandom ? 0 : w.shared_prefix_len;
    check_request_tokens(int64_t{S} + own, r.output_len, workload_tokens,
                         "--prompt-len / --shared-prefix-len / --output-len: request " + std::to_string(i));
    r.prompt_len = S + own;
    if (S == 0) continue;  // seeded random tokens at serve time
    const int64_t group = (multi ? conv : i) % w.prefix_groups;
    r.prompt.resize(static_cast<size_t>(r.prompt_len));
    for (int32_t pos = 0; pos < S; ++pos)
      r.prompt[pos] = seeded_token(w.seed, TokenStream::kSharedPrefix, group, pos, w.vocab);
    for (int32_t pos = S; pos < r.prompt_len; ++pos)
      r.prompt[pos] = seeded_token(w.seed, TokenStream::kPrompt, r.id, pos, w.vocab);
  }
  return reqs;
}

std::vector<RequestSpec> make_workload(int64_t requests, LenRange prompt, int32_t output_len, uint64_t seed) {
  WorkloadOptions w;
  w.requests = requests;
  w.prompt = prompt;
  w.output_len = output_len;
  w.seed = seed;
  return make_workload(w);
}

void validate_workload(const std::vector<RequestSpec>& reqs, int64_t vocab) {
  if (reqs.empty()) throw std::invalid_argument("the workload holds no requests");
  std::set<int64_t> ids, next;
  int64_t workload_tokens = 0;
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
    check_request_tokens(r.prompt_len, r.output_len, workload_tokens, where);
    if (r.after >= 0) {
      if (r.after >= static_cast<int64_t>(i))
        throw std::invalid_argument(where + ": its previous turn (request " + std::to_string(r.after) +
                                    ") must come before it in the workload");
      if (!next.insert(r.after).second)
        throw std::invalid_argument(where + ": request " + std::to_string(r.after) +
                                    " is already the previous turn of another request");
      const auto& prev = reqs[r.after];
      if (r.turn_len < 0 ||
          int64_t{r.prompt_len} != int64_t{prev.prompt_len} + prev.output_len + 1 + r.turn_len)
        throw std::invalid_argument(where + ": prompt_len " + std::to_string(r.prompt_len) +
                                    " is not its previous turn's prompt_len + output_len + 1 + turn_len " +
                                    std::to_string(r.turn_len));
    }
    if (!r.prompt.empty() && static_cast<int64_t>(r.prompt.size()) != r.own_len())
      throw std::invalid_argument(where + ": " + std::to_string(r.prompt.size()) + " prompt token ids for " +
                                  std::to_string(r.own_len()) + " tokens of its own");
    check_tokens(r.prompt, vocab, where + ": prompt");
    for (const auto& f : r.forced) {
      if (static_cast<int64_t>(f.size()) < r.output_len)
        throw std::invalid_argument(where + ": fewer forced tokens than output_len");
      check_tokens(f, vocab, where + ": forced tokens");
    }
  }
}

}  // namespace kda::serving
