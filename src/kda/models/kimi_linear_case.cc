#include "kda/models/kimi_linear_case.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kda::models {

namespace {
std::string str(int64_t v) { return std::to_string(v); }

std::vector<int64_t> checked_bounds(std::span<const int32_t> cu, int64_t T) {
  if (cu.empty()) return {0, T};
  if (cu.size() < 2)
    throw std::invalid_argument("cu_seqlens needs at least 2 entries, got " + str(int64_t(cu.size())));
  if (cu.front() != 0) throw std::invalid_argument("cu_seqlens[0] is " + str(cu.front()) + ", expected 0");
  for (size_t i = 1; i < cu.size(); ++i)
    if (cu[i] < cu[i - 1])
      throw std::invalid_argument("cu_seqlens[" + str(int64_t(i)) + "] = " + str(cu[i]) +
                                  " is below cu_seqlens[" + str(int64_t(i - 1)) + "] = " + str(cu[i - 1]));
  if (cu.back() != T)
    throw std::invalid_argument("cu_seqlens ends at " + str(cu.back()) + " but input_ids holds " + str(T) +
                                " tokens");
  return {cu.begin(), cu.end()};
}
}  // namespace

ModelCaseResult run_model_case(KimiLinearForCausalLM& model, std::span<const int32_t> input_ids,
                               std::span<const int32_t> cu_seqlens, const ModelCaseOptions& opts) {
  const int64_t T = static_cast<int64_t>(input_ids.size());
  const auto cu = checked_bounds(cu_seqlens, T);
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
  if (opts.decode_tail < 0)
    throw std::invalid_argument("decode_tail must be >= 0, got " + str(opts.decode_tail));
  if (opts.prefill_chunks < 1)
    throw std::invalid_argument("prefill_chunks must be >= 1, got " + str(opts.prefill_chunks));
  const int64_t D = model.hidden_size(), V = model.vocab_size();

  ModelCaseResult res;
  res.T = T;
  res.N = N;
  res.hidden_final.assign(static_cast<size_t>(T * D), 0.0f);
  auto pools = model.make_pools(N, std::max<int64_t>(T, 1));
  const auto reqs = pools->req_to_token_pool.alloc(N);

  std::vector<int64_t> len(N), tail(N), prefill(N), done(N, 0);
  for (int64_t i = 0; i < N; ++i) {
    len[i] = cu[i + 1] - cu[i];
    tail[i] = std::min<int64_t>(opts.decode_tail, len[i]);
    prefill[i] = len[i] - tail[i];
  }
  std::vector<float> h;
  // One step over rows (sequence i, its next n[i] tokens); rows with n == 0 are left out but for an
  // empty sequence in the first step (a 0-token row of a varlen batch).
  auto step = [&](bool decode, const std::vector<int64_t>& n, bool first) {
    std::vector<int32_t> rows_req, rows_len, rows_prefix, ids;
    std::vector<int64_t> rows_seq;
    for (int64_t i = 0; i < N; ++i) {
      if (n[i] == 0 && !(first && len[i] == 0)) continue;
      rows_seq.push_back(i);
      rows_req.push_back(reqs[i]);
      rows_len.push_back(static_cast<int32_t>(n[i]));
      rows_prefix.push_back(static_cast<int32_t>(done[i]));
      for (int64_t t = 0; t < n[i]; ++t) ids.push_back(input_ids[cu[i] + done[i] + t]);
    }
    if (rows_seq.empty()) return;
    auto fb = decode ? model_executor::ForwardBatch::decode(rows_req)
                     : model_executor::ForwardBatch::extend(rows_req, rows_len, rows_prefix);
    const int64_t Ts = static_cast<int64_t>(ids.size());
    h.resize(static_cast<size_t>(Ts * D));
    model.forward(ids.data(), Ts, fb, *pools, h.data());
    int64_t r = 0;
    for (const int64_t i : rows_seq) {
      std::copy(h.begin() + r * D, h.begin() + (r + n[i]) * D,
                res.hidden_final.begin() + (cu[i] + done[i]) * D);
      r += n[i];
      done[i] += n[i];
    }
  };
  for (int c = 0; c < opts.prefill_chunks; ++c) {
    std::vector<int64_t> n(N);
    for (int64_t i = 0; i < N; ++i)
      n[i] = prefill[i] * (c + 1) / opts.prefill_chunks - prefill[i] * c / opts.prefill_chunks;
    step(false, n, c == 0);
  }
  for (int j = 0; j < opts.decode_tail; ++j) {
    std::vector<int64_t> n(N);
    for (int64_t i = 0; i < N; ++i) n[i] = tail[i] > j ? 1 : 0;
    step(true, n, false);
  }

  res.logits.resize(static_cast<size_t>(T * V));
  model.compute_logits(res.hidden_final.data(), T, res.logits.data());
  if (!opts.states) return res;

  auto& rtp = pools->req_to_token_pool;
  const auto slots = rtp.get_recurrent_indices(reqs);
  auto& rec = pools->recurrent_state_pool;
  for (const int id : model.kda_layer_ids()) {
    const auto& pc = rec.config();
    const int64_t rs = int64_t(pc.num_heads) * pc.head_k_dim * pc.head_v_dim,
                  cs = (pc.conv_kernel - 1) * pc.conv_dim;
    auto& r = res.kda_recurrent_state[id];
    auto& c = res.kda_conv_state[id];
    r.resize(static_cast<size_t>(N * rs));
    c.resize(static_cast<size_t>(N * cs));
    rec.read_linear_recurrent_layer_cache(id, slots, r.data(), c.data());
  }
  if (!model.mla_layer_ids().empty()) {
    const auto& kc = pools->token_to_kv_pool->config();
    const int64_t R = kc.kv_lora_rank, rr = kc.qk_rope_head_dim;
    for (const int id : model.mla_layer_ids()) {
      auto& ckv = res.mla_ckv[id];
      auto& kpe = res.mla_kpe[id];
      ckv.resize(static_cast<size_t>(T * R));
      kpe.resize(static_cast<size_t>(T * rr));
      for (int64_t i = 0; i < N; ++i) {
        const auto toks = rtp.req_to_token(reqs[i]);
        if (static_cast<int64_t>(toks.size()) != len[i])
          throw std::runtime_error("run_model_case: request " + str(reqs[i]) + " holds " +
                                   str(int64_t(toks.size())) + " token slots after " + str(len[i]) +
                                   " tokens");
        pools->token_to_kv_pool->read_kv(id, toks, ckv.data() + cu[i] * R, kpe.data() + cu[i] * rr);
      }
    }
  }
  return res;
}

}  // namespace kda::models
