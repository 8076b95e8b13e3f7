#include "kda/models/kimi_moe.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kda/common/aligned_scratch.h"
#include "kda/common/allocator.h"
#include "kda/common/bf16.h"
#include "kda/common/seeded.h"
#include "kda/io/packed_checkpoint.h"
#include "kda/kernels/gemm/bf16_amx_block.h"
#include "kda/layers/linear.h"
#include "kda/layers/moe/router.h"
#include "kda/layers/moe/swiglu.h"
#include "kda/layers/quant_linear.h"

namespace kda::models {

namespace {

using layers::moe::SwigluMlp;
using layers::moe::SwigluPieces;
using layers::moe::SwigluScratch;

// seeded_normals tables of the synthetic weights (the KDA stack's embedding and head use 1 and 2).
constexpr uint64_t kGateTable = 0x4d4c5001, kUpTable = 0x4d4c5002, kDownTable = 0x4d4c5003;
constexpr uint64_t kRouterTable = 0x524f5501, kBiasTable = 0x524f5502;
constexpr uint64_t kMoeSeedStream = 32;  // seeded_bits stream: per-layer / per-expert seeds
constexpr int64_t kRouterSeed = -1, kSharedSeed = -2;

// Scratch of the calling thread, shared by every MLP and MoE layer it runs (they run one after another):
// sized by the largest call, never one buffer per layer.
struct ThreadScratch {
  SwigluScratch mlp;
  std::vector<float> xe, ye;            // an expert's gathered rows and its output
  std::vector<bf16_t> x16, xe16, ye16;  // the same as bf16 rows (run_grouped in the bf16 precision)
  std::vector<float> part;              // a sliced MLP's partial outputs after its first slice
  std::vector<float> side;              // the calling thread's: every active expert's output side by side
};
ThreadScratch& thread_scratch() {
  thread_local ThreadScratch s;
  return s;
}

void check_tp(const distributed::TensorParallel& tp, const char* what) {
  if (tp.size < 1 || tp.rank < 0 || tp.rank >= tp.size)
    throw std::invalid_argument(std::string(what) + ": tensor-parallel rank " + std::to_string(tp.rank) +
                                " of " + std::to_string(tp.size) + " is not a rank of the group");
  if (tp.size > 1 && (!tp.comm || tp.comm->size() != tp.size || tp.comm->rank() != tp.rank))
    throw std::invalid_argument(std::string(what) + ": tensor-parallel rank " + std::to_string(tp.rank) +
                                " of " + std::to_string(tp.size) +
                                " needs a communicator of that size and rank");
}

void check_split(int64_t I, int tp_size, const std::string& what) {
  if (tp_size < 1 || I % tp_size != 0)
    throw std::invalid_argument(what + ": intermediate size " + std::to_string(I) +
                                " cannot be split evenly over " + std::to_string(tp_size) +
                                " tensor-parallel ranks");
}

// GEMM row counts are padded to few distinct shapes (powers of two up to 64, then multiples of 64): a
// Linear creates a oneDNN primitive per shape, and the number of tokens an expert gets varies per call.
// Quantized weights up to `unpadded` rows (the experts' projections' QuantLinear::decode_rows) run the
// packed kernels, which keep no primitive per shape and would compute the pad rows (they are compute
// bound there): the count stays as it is; so at any count on the dpbf16 and amx bf16 paths (no primitives
// either).
int64_t padded_rows(int64_t n, Weights weights, Precision precision, int64_t unpadded) {
  if (weights != Weights::BF16 && n <= unpadded) return n;
  const layers::QuantLinear::Prefill path = layers::QuantLinear::prefill_path_for(weights, precision);
  if (path == layers::QuantLinear::Prefill::Dpbf16 || path == layers::QuantLinear::Prefill::AmxBf16) return n;
  if (n > 64) return (n + 63) / 64 * 64;
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

constexpr int64_t kParallelCopy = 1 << 15;  // elements: gather / scatter in parallel from here

// bf16 experts on AMX (amx_chunks_): a count of kAmxRows + 1 to kChunkedRows rows runs as calls of at most
// kAmxRows on the AMX decode kernel instead of one oneDNN call padded to the next multiple of 64. At 256
// experts a 2048-token prefill gives an expert about 64 rows, half of them more: padded to 128, they cost
// their expert up to twice its products. The expert shapes, in turns (docs/performance.md, "The bf16
// experts' rows past 64 in calls of 64"): gate+up at 65 / 80 / 100 / 128 rows in chunks took 0.72 / 0.75 /
// 0.88 / 0.94 of the padded call's time, down 0.91 / 1.01 / 1.15 / 1.32: the pair gains up to about 100.
// A row's bits do not depend on the rows beside it on that kernel, so the chunks give each row the value
// one call of all of them would.
constexpr int64_t kChunkedRows = 96;

// An MLP from its fp32 weights, or from a packed checkpoint's projections (MlpWeights::packed).
std::unique_ptr<SwigluMlp> make_mlp(const MlpWeights& w, Precision precision, Weights weights) {
  if (w.packed.empty())
    return std::make_unique<SwigluMlp>(w.hidden, w.intermediate, w.gate_proj, w.up_proj, w.down_proj,
                                       precision, weights);
  const int64_t D = w.hidden, I = w.intermediate;
  auto none = [&]() -> std::vector<float> {
    throw std::invalid_argument("MlpWeights: a packed MLP lacks one of gate_up_proj / down_proj");
  };
  return std::make_unique<SwigluMlp>(
      D, I, layers::make_linear(w.packed, "gate_up_proj", D, 2 * I, none, precision, weights),
      layers::make_linear(w.packed, "down_proj", I, D, none, precision, weights), precision);
}

// An expert's (or the shared expert's) slices: from its fp32 weights, or from a packed checkpoint's
// pieces, which must be the slices this model cuts (SwigluPieces::pieces_for).
std::unique_ptr<layers::moe::SwigluPieces> make_pieces(const MlpWeights& w, Precision precision,
                                                       Weights weights, int want) {
  using layers::moe::SwigluPieces;
  if (w.packed.empty())
    return std::make_unique<SwigluPieces>(w.hidden, w.intermediate, w.gate_proj, w.up_proj, w.down_proj,
                                          precision, weights, want);
  const int64_t D = w.hidden, I = w.intermediate;
  const int P = SwigluPieces::pieces_for(I, weights, want);
  const auto stored = static_cast<int>(w.packed.size() / 2);
  if (stored != P || w.packed.size() % 2 != 0)
    throw std::invalid_argument("a packed expert holds " + std::to_string(stored) +
                                " slices, this model cuts it into " + std::to_string(P) +
                                " (MoeOptions::pieces): quantize the source checkpoint again");
  auto none = [&]() -> std::vector<float> {
    throw std::invalid_argument("MlpWeights: a packed expert lacks a slice's projection");
  };
  std::vector<SwigluMlp> pieces;
  pieces.reserve(static_cast<size_t>(P));
  for (int p = 0; p < P; ++p) {
    const std::string n = "pieces." + std::to_string(p) + ".";
    pieces.emplace_back(
        D, I / P, layers::make_linear(w.packed, n + "gate_up_proj", D, 2 * (I / P), none, precision, weights),
        layers::make_linear(w.packed, n + "down_proj", I / P, D, none, precision, weights), precision);
  }
  return std::make_unique<SwigluPieces>(D, I, std::move(pieces));
}

}  // namespace

const char* to_string(MoeCombine c) { return c == MoeCombine::Biased ? "biased" : "unbiased"; }

MoeCombine parse_moe_combine(std::string_view s) {
  if (s == "unbiased") return MoeCombine::Unbiased;
  if (s == "biased") return MoeCombine::Biased;
  throw std::invalid_argument("unknown MoE combine '" + std::string(s) + "' (expected unbiased or biased)");
}

// ---------------------------------------------------------------------------------------------------
// MlpWeights

MlpWeights MlpWeights::load(const io::Checkpoint& ckpt, const std::string& prefix, bool expert_names,
                            int64_t D, int64_t I, int tp_rank, int tp_size) {
  check_split(I, tp_size, prefix);
  if (tp_rank < 0 || tp_rank >= tp_size)
    throw std::invalid_argument(prefix + ": tensor-parallel rank " + std::to_string(tp_rank) +
                                " outside [0, " + std::to_string(tp_size) + ")");
  const int64_t i0 = I / tp_size * tp_rank, i1 = I / tp_size * (tp_rank + 1);
  const std::string g = prefix + (expert_names ? ".w1.weight" : ".gate_proj.weight");
  const std::string u = prefix + (expert_names ? ".w3.weight" : ".up_proj.weight");
  const std::string d = prefix + (expert_names ? ".w2.weight" : ".down_proj.weight");
  MlpWeights w;
  w.hidden = D;
  w.intermediate = i1 - i0;
  if (const auto scheme = io::packed_weights(ckpt)) {
    io::packed_for_load(ckpt, *scheme, tp_size);            // one rank: the whole MLP
    if (ckpt.contains(prefix + ".gate_up_proj.qweight")) {  // a whole MLP (the dense one)
      w.packed["gate_up_proj"] = io::load_packed(ckpt, prefix + ".gate_up_proj", *scheme, D, 2 * I);
      w.packed["down_proj"] = io::load_packed(ckpt, prefix + ".down_proj", *scheme, I, D);
      return w;
    }
    // An expert's slices (KimiMoE checks their count against the slices it cuts).
    int P = 0;
    while (ckpt.contains(prefix + ".pieces." + std::to_string(P) + ".gate_up_proj.qweight")) ++P;
    if (P == 0 || I % P != 0)
      throw std::runtime_error(ckpt.root().string() + ": no packed projections for " + prefix +
                               " (neither gate_up_proj nor pieces.{p}.gate_up_proj), or their count " +
                               std::to_string(P) + " does not split " + std::to_string(I) + " rows");
    for (int p = 0; p < P; ++p) {
      const std::string n = "pieces." + std::to_string(p) + ".";
      w.packed[n + "gate_up_proj"] =
          io::load_packed(ckpt, prefix + "." + n + "gate_up_proj", *scheme, D, 2 * (I / P));
      w.packed[n + "down_proj"] = io::load_packed(ckpt, prefix + "." + n + "down_proj", *scheme, I / P, D);
    }
    return w;
  }
  w.gate_proj = ckpt.load_f32_slice(g, {I, D}, 0, i0, i1);
  w.up_proj = ckpt.load_f32_slice(u, {I, D}, 0, i0, i1);
  w.down_proj = ckpt.load_f32_slice(d, {D, I}, 1, i0, i1);
  return w;
}

MlpWeights MlpWeights::shard(int tp_rank, int tp_size) const {
  check_split(intermediate, tp_size, "MlpWeights::shard");
  if (tp_rank < 0 || tp_rank >= tp_size)
    throw std::invalid_argument("MlpWeights::shard: rank " + std::to_string(tp_rank) + " outside [0, " +
                                std::to_string(tp_size) + ")");
  const int64_t D = hidden, I = intermediate, n = I / tp_size, i0 = n * tp_rank;
  MlpWeights s;
  s.hidden = D;
  s.intermediate = n;
  s.gate_proj.assign(gate_proj.begin() + i0 * D, gate_proj.begin() + (i0 + n) * D);
  s.up_proj.assign(up_proj.begin() + i0 * D, up_proj.begin() + (i0 + n) * D);
  s.down_proj.resize(static_cast<size_t>(D * n));
  for (int64_t r = 0; r < D; ++r)
    std::copy(down_proj.begin() + r * I + i0, down_proj.begin() + r * I + i0 + n,
              s.down_proj.begin() + r * n);
  return s;
}

MlpWeights MlpWeights::synthetic(int64_t D, int64_t I, uint64_t seed) {
  MlpWeights w;
  w.hidden = D;
  w.intermediate = I;
  w.gate_proj.resize(static_cast<size_t>(I * D));
  w.up_proj.resize(static_cast<size_t>(I * D));
  w.down_proj.resize(static_cast<size_t>(D * I));
  const float sd = 1.0f / std::sqrt(static_cast<float>(D)), sd_down = 1.0f / std::sqrt(static_cast<float>(I));
  // Unit-variance uniforms (seeded_uniforms: a MoE has hundreds of experts, and normals cost several
  // times more to draw). Every row is a function of (seed, table, row) only, so rows are drawn in parallel.
#pragma omp parallel for schedule(static) if (I * D >= (int64_t{1} << 18))
  for (int64_t r = 0; r < I + D; ++r) {
    if (r < I) {
      float* g = w.gate_proj.data() + r * D;
      float* u = w.up_proj.data() + r * D;
      seeded_uniforms(seed, kGateTable, r, D, g);
      seeded_uniforms(seed, kUpTable, r, D, u);
      for (int64_t c = 0; c < D; ++c) {
        g[c] *= sd;
        u[c] *= sd;
      }
    } else {
      float* d = w.down_proj.data() + (r - I) * I;
      seeded_uniforms(seed, kDownTable, r - I, I, d);
      for (int64_t c = 0; c < I; ++c) d[c] *= sd_down;
    }
  }
  return w;
}

// ---------------------------------------------------------------------------------------------------
// KimiMLP

KimiMLP::KimiMLP(const MlpWeights& w, Precision precision, distributed::TensorParallel tp, Weights weights)
    : precision_(precision), tp_(tp) {
  check_tp(tp, "KimiMLP");
  configure_allocator();
  mlp_ = make_mlp(w, precision, weights);
}

KimiMLP::~KimiMLP() = default;
KimiMLP::KimiMLP(KimiMLP&&) noexcept = default;
KimiMLP& KimiMLP::operator=(KimiMLP&&) noexcept = default;

int64_t KimiMLP::hidden() const { return mlp_->hidden(); }
int64_t KimiMLP::intermediate() const { return mlp_->intermediate(); }
int64_t KimiMLP::weight_bytes() const { return mlp_->weight_bytes(); }

void KimiMLP::forward(const float* x, int64_t T, float* out, bool allreduce) {
  if (T < 0) throw std::invalid_argument("KimiMLP::forward: negative token count " + std::to_string(T));
  if (T == 0) return;
  const int64_t D = mlp_->hidden();
  const bool bf16 = precision_ == Precision::BF16;
  // Under TP the down output is a partial sum: the rounding point is the summed output.
  mlp_->forward(x, T, D, out, D, bf16 && tp_.size == 1, thread_scratch().mlp);
  if (tp_.size > 1 && allreduce) {
    tp_.comm->allreduce_sum(out, static_cast<size_t>(T * D));
    if (bf16) round_bf16_inplace(out, static_cast<size_t>(T * D));
  }
}

void KimiMLP::reserve(int64_t T) const {
  if (T > 0) mlp_->reserve(T, thread_scratch().mlp);
}

// ---------------------------------------------------------------------------------------------------
// KimiMoE

// Where a layer's weights come from: expert(e) gives this rank's shard of expert e, called from several
// threads at once.
struct KimiMoE::Source {
  std::vector<float> router, bias;
  std::function<MlpWeights(int e)> expert;
  std::function<MlpWeights()> shared;  // null: no shared expert
};

namespace {

int config_experts(const io::KimiLinearConfig& cfg, int layer_idx, const MoeOptions& opts, const char* what) {
  if (layer_idx < 0 || layer_idx >= cfg.num_hidden_layers)
    throw std::invalid_argument(std::string(what) + ": layer " + std::to_string(layer_idx) +
                                " is outside the model's " + std::to_string(cfg.num_hidden_layers) +
                                " decoder layers");
  if (!cfg.is_moe_layer(layer_idx))
    throw std::invalid_argument(std::string(what) + ": decoder layer " + std::to_string(layer_idx) +
                                " has a dense MLP, not a MoE (num_experts " +
                                std::to_string(cfg.num_experts) + ", first_k_dense_replace " +
                                std::to_string(cfg.first_k_dense_replace) + ", moe_layer_freq " +
                                std::to_string(cfg.moe_layer_freq) + ")");
  if (opts.num_experts < 0)
    throw std::invalid_argument(std::string(what) + ": num_experts " + std::to_string(opts.num_experts) +
                                " must be >= 1 (0: the config's)");
  return opts.num_experts > 0 ? opts.num_experts : cfg.num_experts;
}

std::string moe_prefix(int layer_idx) {
  return "model.layers." + std::to_string(layer_idx) + ".block_sparse_moe.";
}

}  // namespace

std::unique_ptr<KimiMoE> KimiMoE::from_checkpoint(const io::Checkpoint& ckpt, const io::KimiLinearConfig& cfg,
                                                  int layer_idx, Precision precision,
                                                  distributed::TensorParallel tp, Weights weights,
                                                  MoeOptions opts) {
  const int E = config_experts(cfg, layer_idx, opts, "KimiMoE::from_checkpoint");
  io::packed_for_load(ckpt, weights, tp.size);  // a packed checkpoint's scheme and rank count, said first
  if (E != cfg.num_experts)
    throw std::invalid_argument("KimiMoE::from_checkpoint: num_experts " + std::to_string(E) +
                                " differs from the checkpoint's config (" + std::to_string(cfg.num_experts) +
                                "); fewer experts are for synthetic weights only");
  check_tp(tp, "KimiMoE");
  const int64_t D = cfg.hidden_size, Ie = cfg.moe_intermediate_size, S = cfg.num_shared_experts;
  const std::string pre = moe_prefix(layer_idx);
  check_split(Ie, tp.size, pre + "experts");
  Source src;
  src.router = ckpt.load_f32(pre + "gate.weight", {E, D});
  src.bias = ckpt.load_f32(pre + "gate.e_score_correction_bias", {E});
  src.expert = [&, pre](int e) {
    return MlpWeights::load(ckpt, pre + "experts." + std::to_string(e), true, D, Ie, tp.rank, tp.size);
  };
  if (S > 0)
    src.shared = [&, pre] {
      return MlpWeights::load(ckpt, pre + "shared_experts", false, D, Ie * S, tp.rank, tp.size);
    };
  opts.num_experts = E;
  return std::unique_ptr<KimiMoE>(new KimiMoE(cfg, layer_idx, src, precision, tp, weights, opts));
}

namespace {

uint64_t moe_seed(uint64_t seed, int layer_idx, int64_t which) {
  return seeded_bits(seed, kMoeSeedStream, layer_idx, which, 0);
}

void synthetic_router(const io::KimiLinearConfig& cfg, int layer_idx, uint64_t seed, int E,
                      std::vector<float>& router, std::vector<float>& bias) {
  const int64_t D = cfg.hidden_size;
  const uint64_t s = moe_seed(seed, layer_idx, kRouterSeed);
  router.resize(static_cast<size_t>(E * D));
  const float sd = 1.0f / std::sqrt(static_cast<float>(D));
  for (int e = 0; e < E; ++e) {
    seeded_normals(s, kRouterTable, e, D, router.data() + e * D);
    for (int64_t c = 0; c < D; ++c) router[e * D + c] *= sd;
  }
  bias.resize(static_cast<size_t>(E));
  seeded_normals(s, kBiasTable, 0, E, bias.data());
  for (auto& b : bias) b *= 0.01f;
}

}  // namespace

MoeWeights MoeWeights::synthetic(const io::KimiLinearConfig& cfg, int layer_idx, uint64_t seed,
                                 const MoeOptions& opts) {
  const int E = config_experts(cfg, layer_idx, opts, "MoeWeights::synthetic");
  const int64_t D = cfg.hidden_size, Ie = cfg.moe_intermediate_size, S = cfg.num_shared_experts;
  MoeWeights w;
  synthetic_router(cfg, layer_idx, seed, E, w.router, w.bias);
  for (int e = 0; e < E; ++e) w.experts.push_back(MlpWeights::synthetic(D, Ie, moe_seed(seed, layer_idx, e)));
  if (S > 0) w.shared = MlpWeights::synthetic(D, Ie * S, moe_seed(seed, layer_idx, kSharedSeed));
  w.shared.hidden = D;
  return w;
}

std::unique_ptr<KimiMoE> KimiMoE::synthetic(const io::KimiLinearConfig& cfg, int layer_idx, uint64_t seed,
                                            Precision precision, distributed::TensorParallel tp,
                                            Weights weights, MoeOptions opts) {
  const int E = config_experts(cfg, layer_idx, opts, "KimiMoE::synthetic");
  check_tp(tp, "KimiMoE");
  const int64_t D = cfg.hidden_size, Ie = cfg.moe_intermediate_size, S = cfg.num_shared_experts;
  check_split(Ie, tp.size, "KimiMoE::synthetic experts");
  Source src;
  synthetic_router(cfg, layer_idx, seed, E, src.router, src.bias);
  src.expert = [=](int e) {
    return MlpWeights::synthetic(D, Ie, moe_seed(seed, layer_idx, e)).shard(tp.rank, tp.size);
  };
  if (S > 0)
    src.shared = [=] {
      return MlpWeights::synthetic(D, Ie * S, moe_seed(seed, layer_idx, kSharedSeed)).shard(tp.rank, tp.size);
    };
  opts.num_experts = E;
  return std::unique_ptr<KimiMoE>(new KimiMoE(cfg, layer_idx, src, precision, tp, weights, opts));
}

std::unique_ptr<KimiMoE> KimiMoE::from_weights(const MoeWeights& w, const io::KimiLinearConfig& cfg,
                                               int layer_idx, Precision precision,
                                               distributed::TensorParallel tp, Weights weights,
                                               MoeOptions opts) {
  config_experts(cfg, layer_idx, opts, "KimiMoE::from_weights");
  check_tp(tp, "KimiMoE");
  const int E = static_cast<int>(w.experts.size());
  const int64_t D = cfg.hidden_size, Ie = cfg.moe_intermediate_size, S = cfg.num_shared_experts;
  if (E < 1 || (opts.num_experts > 0 && opts.num_experts != E))
    throw std::invalid_argument("KimiMoE::from_weights: " + std::to_string(E) + " experts given, " +
                                std::to_string(opts.num_experts) + " asked for");
  auto check_mlp = [&](const MlpWeights& m, int64_t I, const std::string& what) {
    if (m.hidden != D || m.intermediate != I || static_cast<int64_t>(m.gate_proj.size()) != I * D ||
        static_cast<int64_t>(m.up_proj.size()) != I * D || static_cast<int64_t>(m.down_proj.size()) != I * D)
      throw std::invalid_argument("KimiMoE::from_weights: " + what + " is [" +
                                  std::to_string(m.intermediate) + ", " + std::to_string(m.hidden) +
                                  "], expected [" + std::to_string(I) + ", " + std::to_string(D) +
                                  "] (or its tensors' sizes disagree)");
  };
  for (int e = 0; e < E; ++e) check_mlp(w.experts[e], Ie, "expert " + std::to_string(e));
  if (S > 0) check_mlp(w.shared, Ie * S, "the shared expert");
  if (static_cast<int64_t>(w.router.size()) != E * D || static_cast<int64_t>(w.bias.size()) != E)
    throw std::invalid_argument("KimiMoE::from_weights: router has " + std::to_string(w.router.size()) +
                                " values and bias " + std::to_string(w.bias.size()) + ", expected " +
                                std::to_string(E) + " x " + std::to_string(D) + " and " + std::to_string(E));
  check_split(Ie, tp.size, "KimiMoE::from_weights experts");
  Source src;
  src.router = w.router;
  src.bias = w.bias;
  src.expert = [&](int e) { return w.experts[e].shard(tp.rank, tp.size); };
  if (S > 0) src.shared = [&] { return w.shared.shard(tp.rank, tp.size); };
  opts.num_experts = E;
  return std::unique_ptr<KimiMoE>(new KimiMoE(cfg, layer_idx, src, precision, tp, weights, opts));
}

KimiMoE::KimiMoE(const io::KimiLinearConfig& cfg, int layer_idx, const Source& src, Precision precision,
                 distributed::TensorParallel tp, Weights weights, MoeOptions opts)
    : layer_idx_(layer_idx),
      D_(cfg.hidden_size),
      E_(opts.num_experts),
      k_(std::min(cfg.num_experts_per_token, opts.num_experts)),
      combine_(opts.combine),
      renormalize_(cfg.moe_renormalize),
      factor_(static_cast<float>(cfg.routed_scaling_factor)),
      precision_(precision),
      weights_(weights),
      tp_(tp) {
  if (k_ < 1)
    throw std::invalid_argument("KimiMoE: num_experts_per_token " +
                                std::to_string(cfg.num_experts_per_token) + " must be >= 1");
  if (opts.pieces < 1)
    throw std::invalid_argument("KimiMoE: " + std::to_string(opts.pieces) +
                                " slices per expert (must be >= 1)");
  // Every expert's fp32 weights are freed once converted: with the fixed mmap threshold they go back to
  // the system instead of staying in the building threads' heaps.
  configure_allocator();
  // The router stays as stored: dense fp32 logits in every precision and weights mode.
  router_ = std::make_unique<layers::moe::RouterGate>(src.router, E_, D_);
  bias_ = src.bias;
  // Expert by expert, in parallel: each thread holds one expert's fp32 weights while it builds it.
  experts_.resize(static_cast<size_t>(E_));
  std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1)
  for (int e = 0; e < E_; ++e) {
    try {
      experts_[e] = make_pieces(src.expert(e), precision, weights, opts.pieces);
    } catch (...) {
#pragma omp critical(kda_moe_build)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  if (src.shared) {
    shared_ = make_pieces(src.shared(), precision, weights, opts.pieces);
  }
  if (weights == Weights::BF16 && precision == Precision::BF16 && !experts_.empty()) {
    amx_chunks_ = true;
    for (const auto& e : experts_)
      for (int p = 0; p < e->pieces(); ++p)
        amx_chunks_ = amx_chunks_ && e->piece(p).gate_up().bf16_gemm() == layers::Bf16Gemm::OneDnnAmx &&
                      e->piece(p).down().bf16_gemm() == layers::Bf16Gemm::OneDnnAmx;
  }
  if (weights != Weights::BF16 && !experts_.empty()) {
    using layers::QuantLinear;
    const int64_t I = experts_.front()->piece(0).intermediate();  // down's inputs
    unpadded_ = std::min(QuantLinear::decode_rows_for(weights, precision, D_),
                         QuantLinear::decode_rows_for(weights, precision, I));
  }
}

KimiMoE::~KimiMoE() = default;

int64_t KimiMoE::weight_bytes() const {
  int64_t b = router_->weight_bytes() + static_cast<int64_t>(bias_.size() * sizeof(float));
  for (const auto& e : experts_) b += e->weight_bytes();
  if (shared_) b += shared_->weight_bytes();
  return b;
}

int64_t KimiMoE::active_weight_bytes() const {
  return router_->weight_bytes() + static_cast<int64_t>(bias_.size() * sizeof(float)) +
         k_ * experts_.front()->weight_bytes() + (shared_ ? shared_->weight_bytes() : 0);
}

int64_t KimiMoE::last_weight_bytes() const {
  if (offsets_.empty()) return 0;
  int64_t b = router_->weight_bytes() + static_cast<int64_t>(bias_.size() * sizeof(float)) +
              (shared_ ? shared_->weight_bytes() : 0);
  for (int e = 0; e < E_; ++e)
    if (offsets_[e + 1] > offsets_[e]) b += experts_[e]->weight_bytes();
  return b;
}

void KimiMoE::forward(const float* x, int64_t T, float* out) {
  if (T < 0) throw std::invalid_argument("KimiMoE::forward: negative token count " + std::to_string(T));
  if (T == 0) {
    topk_ids_.clear();
    topk_w_.clear();
    offsets_.clear();
    return;
  }
  const int64_t k = k_;
  // Router logits, selection and combine weights, all fp32.
  logits_.resize(static_cast<size_t>(T * E_));
  router_->forward(x, T, logits_.data());
  std::vector<int32_t> ids(static_cast<size_t>(T * k));
  std::vector<float> w(static_cast<size_t>(T * k));
  layers::moe::RouterParams rp{.num_experts = E_,
                               .top_k = k_,
                               .renormalize = renormalize_,
                               .routed_scaling_factor = factor_,
                               .biased_combine = combine_ == MoeCombine::Biased};
  layers::moe::select_experts(logits_.data(), T, bias_.data(), rp, ids.data(), w.data());
  // Group the (token, slot) pairs by expert, tokens ascending within each (a counting sort).
  offsets_.assign(static_cast<size_t>(E_ + 1), 0);
  for (int64_t i = 0; i < T * k; ++i) ++offsets_[ids[i] + 1];
  for (int e = 0; e < E_; ++e) offsets_[e + 1] += offsets_[e];
  rows_.resize(static_cast<size_t>(T * k));
  {
    std::vector<int64_t> fill(offsets_.begin(), offsets_.end() - 1);
    for (int64_t i = 0; i < T * k; ++i) rows_[fill[ids[i]]++] = i;
  }
  // y = shared(x) (this rank's partial under TP), then the routed experts added in increasing id.
  const bool bf16 = precision_ == Precision::BF16;
  topk_ids_ = std::move(ids);
  topk_w_ = std::move(w);
  int64_t active = 0;
  for (int e = 0; e < E_; ++e) active += offsets_[e + 1] > offsets_[e];
  if (T * k <= kSideBySideRows * active)
    run_side_by_side(x, T, out);
  else
    run_grouped(x, T, out);
  if (tp_.size > 1) tp_.comm->allreduce_sum(out, static_cast<size_t>(T * D_));
  if (bf16) round_bf16_inplace(out, static_cast<size_t>(T * D_));
}

void KimiMoE::reserve(int64_t T) {
  if (T <= 0) return;
  grow(logits_, T * E_);
  grow(rows_, T * k_);
  // run_grouped's: the shared expert over T rows, then an expert's gathered rows (at most T: a token picks
  // an expert once), every expert the same shape.
  ThreadScratch& s = thread_scratch();
  if (shared_) shared_->reserve(T, s.mlp, s.part);
  const int64_t np = padded_rows(T, weights_, precision_, unpadded_);
  if (bf16_rows()) {
    grow(s.x16, T * D_);
    grow(s.xe16, np * D_);
    grow(s.ye16, np * D_);
  } else {
    grow(s.xe, np * D_);
    grow(s.ye, np * D_);
  }
  if (!experts_.empty()) experts_.front()->reserve(np, s.mlp, s.part);
}

namespace {

// xe [padded(n), D] = the rows of x of the expert's (token, slot) pairs; padding rows zero. T: float or
// bf16 rows.
template <class T>
void gather(const T* x, int64_t D, const int64_t* rows, int64_t n, int64_t k, T* xe, int64_t n_pad) {
#pragma omp parallel for schedule(static) if (n * D >= kParallelCopy)
  for (int64_t j = 0; j < n; ++j) std::memcpy(xe + j * D, x + rows[j] / k * D, sizeof(T) * D);
  if (n_pad > n) std::memset(xe + n * D, 0, sizeof(T) * static_cast<size_t>((n_pad - n) * D));
}

inline float widen(float v) { return v; }
inline float widen(bf16_t v) { return bf16_to_f32(v); }

// y[token][0, width) += w * ye[j][0, width) for the expert's pairs (rows D values apart in both); each token
// appears once per expert, so rows never race. Inside a parallel region it runs on the calling thread.
template <class T>
void scatter_add(const T* ye, int64_t D, int64_t width, const int64_t* rows, int64_t n, int64_t k,
                 const float* w, float* y) {
#pragma omp parallel for schedule(static) if (n * width >= kParallelCopy)
  for (int64_t j = 0; j < n; ++j) {
    const float wj = w[rows[j]];
    float* yr = y + rows[j] / k * D;
    const T* er = ye + j * D;
#pragma omp simd
    for (int64_t d = 0; d < width; ++d) yr[d] += wj * widen(er[d]);
  }
}

}  // namespace

// Where every expert's output is a rounding point (bf16, no tensor-parallel partials, whole experts)
// run_grouped's rows stay bf16 throughout: x converted once (what each gate_up would round it to),
// gathered and multiplied as bf16, each expert's output stored rounded as bf16 and widened as it is
// added. The same values as fp32 rows with the roundings in between, in half the bytes.
bool KimiMoE::bf16_rows() const {
  return precision_ == Precision::BF16 && tp_.size == 1 && (!shared_ || shared_->pieces() == 1) &&
         std::all_of(experts_.begin(), experts_.end(), [](const auto& e) { return e->pieces() == 1; });
}

void KimiMoE::run_grouped(const float* x, int64_t T, float* y) {
  const bool round_out = precision_ == Precision::BF16 && tp_.size == 1;
  ThreadScratch& s = thread_scratch();
  if (bf16_rows()) {
    if (s.x16.size() < static_cast<size_t>(T * D_)) s.x16.resize(static_cast<size_t>(T * D_));
    bf16_t* x16 = s.x16.data();
    const int64_t D = D_;
#pragma omp parallel for schedule(static) if (T * D >= kParallelCopy)
    for (int64_t t = 0; t < T; ++t) f32_to_bf16_array(x + t * D, x16 + t * D, static_cast<size_t>(D));
    return run_experts(x16, T, s.xe16, s.ye16, true, y);
  }
  run_experts(x, T, s.xe, s.ye, round_out, y);
}

template <class R>
void KimiMoE::run_experts(const R* x, int64_t T, std::vector<R>& xe, std::vector<R>& ye, bool round_out,
                          float* y) {
  ThreadScratch& s = thread_scratch();
  if (shared_)
    shared_->forward(x, T, D_, y, D_, round_out, s.mlp, s.part);
  else
    std::memset(y, 0, sizeof(float) * static_cast<size_t>(T * D_));
  for (int e = 0; e < E_; ++e) {
    const int64_t n = offsets_[e + 1] - offsets_[e];
    if (n == 0) continue;  // an expert no token picked: its weights are not read
    const bool chunked = amx_chunks_ && n > kernels::gemm::kAmxRows && n <= kChunkedRows;
    const int64_t np = chunked ? n : padded_rows(n, weights_, precision_, unpadded_);
    if (xe.size() < static_cast<size_t>(np * D_)) xe.resize(static_cast<size_t>(np * D_));
    if (ye.size() < static_cast<size_t>(np * D_)) ye.resize(static_cast<size_t>(np * D_));
    const int64_t* rows = rows_.data() + offsets_[e];
    gather(x, D_, rows, n, k_, xe.data(), np);
    const int64_t step = chunked ? kernels::gemm::kAmxRows : np;
    for (int64_t m = 0; m < np; m += step) {
      const int64_t c = std::min(step, np - m);
      if constexpr (std::is_same_v<R, bf16_t>)
        experts_[e]->forward(xe.data() + m * D_, c, D_, ye.data() + m * D_, D_, s.mlp);
      else
        experts_[e]->forward(xe.data() + m * D_, c, D_, ye.data() + m * D_, D_, round_out, s.mlp, s.part);
    }
    scatter_add(ye.data(), D_, D_, rows, n, k_, topk_w_.data(), y);
  }
}

void KimiMoE::run_side_by_side(const float* x, int64_t T, float* y) {
  const bool round_out = precision_ == Precision::BF16 && tp_.size == 1;
  // y = the shared expert's output (its pieces added and rounded as run_experts has them), its GEMMs
  // threaded.
  if (shared_) {
    ThreadScratch& s = thread_scratch();
    shared_->forward(x, T, D_, y, D_, round_out, s.mlp, s.part);
  } else {
    std::memset(y, 0, sizeof(float) * static_cast<size_t>(T * D_));
  }
  // The active experts in increasing id; a job is one slice of one.
  std::vector<int> active;
  for (int e = 0; e < E_; ++e)
    if (offsets_[e + 1] > offsets_[e]) active.push_back(e);
  const int na = static_cast<int>(active.size());
  struct Job {
    int mlp, piece;
  };
  std::vector<Job> jobs;
  for (int a = 0; a < na; ++a)
    for (int p = 0; p < experts_[active[a]]->pieces(); ++p) jobs.push_back({a, p});
  // Each active expert's slices' outputs, one block of its padded rows per slice.
  std::vector<int64_t> rows_of(static_cast<size_t>(na)), out_at(static_cast<size_t>(na) + 1, 0);
  for (int a = 0; a < na; ++a) {
    rows_of[a] = padded_rows(offsets_[active[a] + 1] - offsets_[active[a]], weights_, precision_, unpadded_);
    out_at[a + 1] = out_at[a] + rows_of[a] * experts_[active[a]]->pieces();
  }
  const int64_t total = out_at.back();
  std::vector<float>& ye = thread_scratch().side;
  if (ye.size() < static_cast<size_t>(total * D_)) ye.resize(static_cast<size_t>(total * D_));
  const int n_jobs = static_cast<int>(jobs.size());
  std::exception_ptr error;
  // One job per thread: at decode each slice is a few rows, too small to thread its GEMMs well.
#pragma omp parallel for schedule(dynamic, 1) if (n_jobs > 1)
  for (int j = 0; j < n_jobs; ++j) {
    try {
      ThreadScratch& s = thread_scratch();
      const auto [a, p] = jobs[j];
      const int e = active[a];
      const int64_t n = offsets_[e + 1] - offsets_[e], np = rows_of[a];
      if (s.xe.size() < static_cast<size_t>(np * D_)) s.xe.resize(static_cast<size_t>(np * D_));
      gather(x, D_, rows_.data() + offsets_[e], n, k_, s.xe.data(), np);
      experts_[e]->forward_piece(p, s.xe.data(), np, D_, ye.data() + (out_at[a] + p * np) * D_, D_, s.mlp);
    } catch (...) {
#pragma omp critical(kda_moe_forward)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  // Each expert's slices added in slice order, its sum rounded where a whole MLP's output is (bf16), then
  // added to y in increasing id, as run_grouped adds them. The threads share the columns: every value is
  // still summed in that order, where one thread did it all while the other waited (a batch of 16's
  // 128 rows, each layer).
  const int64_t threads = std::max(1, omp_get_max_threads());  // one span of whole vectors per thread
  const int64_t span = (D_ + 16 * threads - 1) / (16 * threads) * 16, spans = (D_ + span - 1) / span;
  // T * k_ routed rows, every one in some active expert's block.
#pragma omp parallel for schedule(static) if (spans > 1 && T * k_ * D_ >= kParallelCopy)
  for (int64_t sp = 0; sp < spans; ++sp) {
    const int64_t d0 = sp * span, width = std::min(D_, d0 + span) - d0;
    for (int a = 0; a < na; ++a) {
      const int e = active[a];
      const int64_t n = offsets_[e + 1] - offsets_[e], np = rows_of[a];
      float* block = ye.data() + out_at[a] * D_ + d0;
      for (int p = 1; p < experts_[e]->pieces(); ++p)  // slice p's rows start p * np rows after the first's
        SwigluPieces::add_part(block, D_, block + p * np * D_, D_, n, width);
      if (round_out)
        for (int64_t t = 0; t < n; ++t) round_bf16_inplace(block + t * D_, static_cast<size_t>(width));
      scatter_add(block, D_, width, rows_.data() + offsets_[e], n, k_, topk_w_.data(), y + d0);
    }
  }
}

}  // namespace kda::models
