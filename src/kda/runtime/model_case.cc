#include "kda/runtime/model_case.h"

#include <stdexcept>
#include <string>

#include "kda/distributed/shard_layout.h"

namespace kda::runtime {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// A 1-D integer array (int32 or int64 in the file) as int32; std::invalid_argument naming it otherwise.
std::vector<int32_t> int_vector(const io::NpyArray& a, const std::string& name, const std::string& what) {
  if (a.dtype != io::NpyDType::I32 && a.dtype != io::NpyDType::I64)
    throw std::invalid_argument(what + ": " + name + " must hold int32 ids, got " + io::to_string(a.dtype));
  if (a.shape.size() != 1)
    throw std::invalid_argument(what + ": " + name + " must be 1-D, got shape " + shape_str(a.shape));
  try {
    return a.to_i32();
  } catch (const std::out_of_range& e) {
    throw std::invalid_argument(what + ": " + name + ": " + e.what());
  }
}

}  // namespace

bool is_token_case(const io::NpzArchive& npz) { return npz.count("input_ids") != 0; }

TokenCase TokenCase::from_npz(const io::NpzArchive& npz, const io::KimiLinearConfig& cfg,
                              const std::string& what) {
  auto it = npz.find("input_ids");
  if (it == npz.end()) throw std::invalid_argument(what + " has no 'input_ids' array");
  TokenCase c;
  c.input_ids = int_vector(it->second, "input_ids", what);
  c.T = static_cast<int64_t>(c.input_ids.size());
  for (int64_t t = 0; t < c.T; ++t) {
    const int32_t id = c.input_ids[static_cast<size_t>(t)];
    if (id < 0 || id >= cfg.vocab_size)
      throw std::invalid_argument(what + ": input_ids[" + std::to_string(t) + "] = " + std::to_string(id) +
                                  " is outside the vocabulary [0, " + std::to_string(cfg.vocab_size) + ")");
  }
  if (auto cu = npz.find("cu_seqlens"); cu != npz.end()) {
    c.cu_seqlens = int_vector(cu->second, "cu_seqlens", what);
    if (c.cu_seqlens.size() < 2)
      throw std::invalid_argument(what + ": cu_seqlens must have at least 2 entries, got " +
                                  std::to_string(c.cu_seqlens.size()));
  } else {
    if (c.T > INT32_MAX) throw std::invalid_argument(what + ": input_ids has more than 2^31 - 1 tokens");
    c.cu_seqlens = {0, static_cast<int32_t>(c.T)};
  }
  c.N = static_cast<int64_t>(c.cu_seqlens.size()) - 1;
  if (c.cu_seqlens[0] != 0)
    throw std::invalid_argument(what + ": cu_seqlens must start at 0, got " +
                                std::to_string(c.cu_seqlens[0]));
  for (int64_t i = 0; i < c.N; ++i)
    if (c.cu_seqlens[i + 1] < c.cu_seqlens[i])
      throw std::invalid_argument(what + ": cu_seqlens decreases at index " + std::to_string(i + 1) + ": " +
                                  std::to_string(c.cu_seqlens[i]) + " then " +
                                  std::to_string(c.cu_seqlens[i + 1]));
  if (c.cu_seqlens[c.N] != c.T)
    throw std::invalid_argument(what + ": cu_seqlens ends at " + std::to_string(c.cu_seqlens[c.N]) +
                                " but input_ids has " + std::to_string(c.T) + " tokens");
  return c;
}

void TokenCase::check_decode_tail(int k) const {
  if (k < 0) throw std::invalid_argument("--decode-tail must be >= 0, got " + std::to_string(k));
  for (int64_t i = 0; i < N; ++i)
    if (k > seq_len(i))
      throw std::invalid_argument("--decode-tail " + std::to_string(k) + " is longer than sequence " +
                                  std::to_string(i) + " (" + std::to_string(seq_len(i)) + " tokens)");
}

TokenCase TokenCase::prefix(int64_t len) const {
  if (N != 1)
    throw std::invalid_argument("TokenCase::prefix: the case has " + std::to_string(N) + " sequences");
  if (len < 0 || len > T)
    throw std::invalid_argument("TokenCase::prefix: " + std::to_string(len) + " tokens of " +
                                std::to_string(T));
  TokenCase c;
  c.T = len;
  c.N = 1;
  c.input_ids.assign(input_ids.begin(), input_ids.begin() + len);
  c.cu_seqlens = {0, static_cast<int32_t>(len)};
  return c;
}

void gather_kda_states(models::ModelCaseResult& r, const io::KimiLinearConfig& cfg,
                       const distributed::TensorParallel& tp) {
  if (tp.size <= 1) return;
  const distributed::StateDims dims{r.N, cfg.num_heads, cfg.head_dim, cfg.head_dim,
                                    cfg.short_conv_kernel_size - 1};
  const auto gather = [&](std::vector<float>& part, bool recurrent) {
    std::vector<float> all(part.size() * static_cast<size_t>(tp.size));
    tp.comm->allgather(part.data(), part.size(), all.data());
    part = recurrent ? distributed::unshard_recurrent(all, dims, tp.size)
                     : distributed::unshard_conv(all, dims, tp.size);
  };
  for (auto& [id, v] : r.kda_recurrent_state) gather(v, true);
  for (auto& [id, v] : r.kda_conv_state) gather(v, false);
}

io::NpzArchive model_case_archive(const models::ModelCaseResult& r, const io::KimiLinearConfig& cfg,
                                  int64_t vocab) {
  const int64_t H = cfg.num_heads, K = cfg.head_dim, W = cfg.short_conv_kernel_size,
                P = cfg.projection_size(), R = cfg.kv_lora_rank, dr = cfg.qk_rope_head_dim;
  io::NpzArchive out;
  const auto put = [&](const std::string& key, std::vector<int64_t> shape, const std::vector<float>& v) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    if (static_cast<int64_t>(v.size()) != n)
      throw std::logic_error("model result '" + key + "' has " + std::to_string(v.size()) +
                             " values for shape " + shape_str(shape));
    out[key] = io::NpyArray::from_f32(std::move(shape), v.data());
  };
  put("logits", {r.T, vocab}, r.logits);
  put("hidden_final", {r.T, cfg.hidden_size}, r.hidden_final);
  for (const auto& [id, v] : r.kda_recurrent_state)
    put("kda_recurrent_state_" + std::to_string(id), {r.N, H, K, K}, v);
  for (const auto& [id, v] : r.kda_conv_state)
    put("kda_conv_state_" + std::to_string(id), {r.N, W - 1, 3 * P}, v);
  for (const auto& [id, v] : r.mla_ckv) put("mla_ckv_" + std::to_string(id), {r.T, R}, v);
  for (const auto& [id, v] : r.mla_kpe) put("mla_kpe_" + std::to_string(id), {r.T, dr}, v);
  return out;
}

}  // namespace kda::runtime
