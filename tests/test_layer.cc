// The layer, backend and forward modes through the full stack: mixed batches, chunked prefill,
// padded rows, IDLE / DUMMY_FIRST / speculative modes, bad checkpoints and bad inputs, ServerArgs,
// and the full Kimi-Linear shape.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "kda/io/config.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/io/npy.h"
#include "kda/io/safetensors.h"
#include "kda/layers/attention/linear/kda_backend.h"
#include "kda/layers/linear.h"
#include "kda/layers/radix_linear_attention.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/models/kimi_linear.h"
#include "kda/runtime/layer_runner.h"
#include "kda/server_args.h"
#include "support/layer_reference.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace fs = std::filesystem;
using layers::attention::linear::KDAAttnBackend;
using mem_cache::MemoryPools;
using model_executor::ForwardBatch;
using model_executor::ForwardMode;
using ::testing::HasSubstr;

// Linear: y = x W^T against a float64 product of the values it multiplies (the bf16 precision rounds x
// and W to bf16 and accumulates in fp32), for several row counts and dense and strided rows in an order
// that makes the weight change layout (strided rows take another matmul kernel than dense ones); in bf16
// the float input (converted on the way in) and the same values handed in as bf16 give the same bits.
TEST(Linear, Fp32AndBf16InputsRowCountsAndStrides) {
  const int64_t in = 70, out = 45, ldy = 50;
  const auto w = testing::random_normal(out * in, 1, 0.1f);
  for (const Precision p : {Precision::FP32, Precision::BF16}) {
    const layers::Linear lin(in, out, w, p);
    const auto round = [&](float v) { return p == Precision::BF16 ? round_bf16(v) : v; };
    for (const auto& [M, ldx] : std::vector<std::pair<int64_t, int64_t>>{
             {37, 80}, {37, in}, {1, in}, {5, 80}, {64, in}, {300, 90}, {37, 80}}) {
      SCOPED_TRACE(std::string(to_string(p)) + " M=" + std::to_string(M) + " ldx=" + std::to_string(ldx));
      const auto x = testing::random_normal(M * ldx, 2 + M);
      std::vector<float> y(M * ldy, -3.0f);
      lin.forward(x.data(), M, ldx, y.data(), ldy);
      double worst = 0.0;
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t o = 0; o < out; ++o) {
          double ref = 0.0;
          for (int64_t d = 0; d < in; ++d)
            ref += static_cast<double>(round(x[i * ldx + d])) * round(w[o * in + d]);
          worst = std::max(worst, std::abs(y[i * ldy + o] - ref) / (1e-5 + 1e-5 * std::abs(ref)));
        }
        for (int64_t o = out; o < ldy; ++o) ASSERT_EQ(y[i * ldy + o], -3.0f);  // padding untouched
      }
      EXPECT_LE(worst, 1.0);
      std::vector<bf16_t> xb(M * ldx);
      for (size_t i = 0; i < x.size(); ++i) xb[i] = f32_to_bf16(x[i]);
      std::vector<float> yb(M * ldy, -3.0f);
      if (p == Precision::FP32) {
        EXPECT_THROW(lin.forward(xb.data(), M, ldx, yb.data(), ldy), std::invalid_argument);
        continue;
      }
      lin.forward(xb.data(), M, ldx, yb.data(), ldy);
      EXPECT_EQ(0, std::memcmp(y.data(), yb.data(), y.size() * sizeof(float)));
      EXPECT_THROW(lin.forward(xb.data(), M, in - 1, yb.data(), ldy), std::invalid_argument);
      // bf16 output, from fp32 and from bf16 input: the fp32 output rounded to nearest even, bit for bit.
      std::vector<bf16_t> o1(M * ldy, 7), o2(M * ldy, 7);
      lin.forward(x.data(), M, ldx, o1.data(), ldy);
      lin.forward(xb.data(), M, ldx, o2.data(), ldy);
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t o = 0; o < ldy; ++o) {
          const bf16_t want = o < out ? f32_to_bf16(y[i * ldy + o]) : bf16_t{7};
          ASSERT_EQ(o1[i * ldy + o], want) << i << "," << o;
          ASSERT_EQ(o2[i * ldy + o], want) << i << "," << o;
        }
      }
    }
    if (p == Precision::FP32) {  // bf16 outputs only in the bf16 precision
      std::vector<float> x(in);
      std::vector<bf16_t> yb(out);
      EXPECT_THROW(lin.forward(x.data(), 1, in, yb.data(), out), std::invalid_argument);
    }
  }
}

// A serving engine calls with a new row count at almost every step: the primitives kept stay bounded
// (least recently used dropped), and a shape whose primitive was dropped still computes right.
TEST(Linear, PrimitiveCacheStaysBoundedOverManyRowCounts) {
  const int64_t in = 16, out = 8;
  const auto w = testing::random_normal(out * in, 1, 0.1f);
  const layers::Linear lin(in, out, w, Precision::FP32);
  const auto check_rows = [&](int64_t M) {
    const auto x = testing::random_normal(M * in, 100 + M);
    std::vector<float> y(M * out);
    lin.forward(x.data(), M, y.data());
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t o = 0; o < out; ++o) {
        double ref = 0.0;
        for (int64_t d = 0; d < in; ++d) ref += static_cast<double>(x[i * in + d]) * w[o * in + d];
        ASSERT_NEAR(y[i * out + o], ref, 1e-5 + 1e-5 * std::abs(ref)) << "M=" << M;
      }
    }
  };
  const int64_t shapes = layers::Linear::kMaxPrimitives + 20;
  for (int64_t M = 1; M <= shapes; ++M) {
    check_rows(M);
    EXPECT_EQ(lin.cached_primitives(),
              static_cast<size_t>(std::min<int64_t>(M, layers::Linear::kMaxPrimitives)));
  }
  check_rows(1);       // dropped long ago
  check_rows(shapes);  // still kept
  EXPECT_EQ(lin.cached_primitives(), layers::Linear::kMaxPrimitives);
}

constexpr double kTol = 1e-5;

// The mini dump's layer and a pool sized for `slots` requests.
struct Stack {
  io::KimiLinearConfig cfg;
  std::unique_ptr<models::KimiDeltaAttention> layer;
  std::unique_ptr<MemoryPools> pools;
  KDAAttnBackend backend;
  // A second backend on the same pools, for reference steps between a verify and its accept (a batch on
  // `backend` itself would end the pending verify).
  KDAAttnBackend ref_backend;

  explicit Stack(int64_t slots, Precision p = Precision::FP32,
                 kernels::KernelImpl kernel = kernels::KernelImpl::Auto)
      : cfg(io::load_config(testing::dumps_dir())), backend(kernel) {
    const io::Checkpoint ckpt(testing::dumps_dir());
    layer = models::KimiDeltaAttention::from_checkpoint(ckpt, cfg, 0, p);
    init_pools(slots, p);
  }
  Stack(const io::KimiLinearConfig& c, const models::KdaLayerWeights& w, int64_t slots,
        kernels::KernelImpl kernel)
      : cfg(c), backend(kernel) {
    layer = std::make_unique<models::KimiDeltaAttention>(cfg, 0, w, Precision::FP32);
    init_pools(slots, Precision::FP32);
  }
  void init_pools(int64_t slots, Precision p, int max_verify_tokens = 0) {
    mem_cache::RecurrentStatePoolConfig pc;
    pc.max_verify_tokens = max_verify_tokens;
    pc.layer_ids = {0};
    pc.size = slots;
    pc.num_heads = cfg.num_heads;
    pc.head_k_dim = cfg.head_dim;
    pc.head_v_dim = cfg.head_dim;
    pc.conv_kernel = cfg.short_conv_kernel_size;
    pc.conv_dim = 3 * cfg.projection_size();
    pc.conv_dtype = p;
    pools = std::make_unique<MemoryPools>(pc, slots);
  }
  int64_t D() const { return cfg.hidden_size; }

  // Runs one batch (on `backend`, or `be`); returns the output rows.
  std::vector<float> step(ForwardBatch fb, const std::vector<float>& x) { return step(fb, x, backend); }
  std::vector<float> step(ForwardBatch fb, const std::vector<float>& x, KDAAttnBackend& be) {
    fb.attn_backend = &be;
    const auto slots = pools->req_to_token_pool.get_recurrent_indices(fb.req_pool_indices);
    be.init_forward_metadata(fb, slots);
    std::vector<float> y(x.size());
    layer->forward(x.data(), static_cast<int64_t>(x.size()) / D(), fb, pools->recurrent_state_pool, y.data());
    return y;
  }
  std::vector<float> states(int32_t req) { return slot_states(pools->req_to_token_pool.slot_of(req)); }
  // A slot's recurrent state [H, K, V] followed by its conv state [W-1, C], as fp32.
  std::vector<float> slot_states(int32_t slot) {
    const auto& pc = pools->recurrent_state_pool.config();
    std::vector<float> rec(static_cast<size_t>(pc.num_heads) * pc.head_k_dim * pc.head_v_dim);
    std::vector<float> conv(static_cast<size_t>((pc.conv_kernel - 1) * pc.conv_dim));
    const int32_t s[1] = {slot};
    pools->recurrent_state_pool.read_linear_recurrent_layer_cache(0, s, rec.data(), conv.data());
    rec.insert(rec.end(), conv.begin(), conv.end());
    return rec;
  }
};

int32_t pool_slot(Stack& s, int32_t req) { return s.pools->req_to_token_pool.slot_of(req); }

std::vector<float> rows(const std::vector<float>& x, int64_t D, int64_t from, int64_t n) {
  return std::vector<float>(x.begin() + from * D, x.begin() + (from + n) * D);
}

void expect_close(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_LE(testing::max_error_ratio(a.data(), b.data(), a.size(), kTol, kTol), 1.0) << what;
}

TEST(Layer, MixedBatchEqualsRequestsRunAlone) {
  const int64_t D = 256;
  const auto xa = testing::random_normal(70 * D, 1);  // a fresh 70-token prefill
  const auto xb = testing::random_normal(21 * D, 2);  // 20-token prompt, then one decode token
  const auto xc = testing::random_normal(34 * D, 3);  // 33-token prompt, then one decode token

  // Alone: each request on its own pool.
  std::vector<float> ya, yb, yc, sa, sb, sc;
  {
    Stack s(4);
    const auto r = s.pools->req_to_token_pool.alloc(1);
    ya = s.step(ForwardBatch::extend(r, {70}, {0}), xa);
    sa = s.states(r[0]);
  }
  for (auto [x, y, st, n] : {std::tuple{&xb, &yb, &sb, 20}, std::tuple{&xc, &yc, &sc, 33}}) {
    Stack s(4);
    const auto r = s.pools->req_to_token_pool.alloc(1);
    *y = s.step(ForwardBatch::extend(r, {n}, {0}), rows(*x, D, 0, n));
    const auto last = s.step(ForwardBatch::decode(r), rows(*x, D, n, 1));
    y->insert(y->end(), last.begin(), last.end());
    *st = s.states(r[0]);
  }

  // Together: B and C prefill, then one EXTEND batch holding A's whole prompt and B's and C's decode
  // tokens as 1-token segments (what --enable-mixed-chunk produces).
  Stack s(8);
  const auto r = s.pools->req_to_token_pool.alloc(3);
  std::vector<float> x = rows(xb, D, 0, 20);
  const auto c20 = rows(xc, D, 0, 33);
  x.insert(x.end(), c20.begin(), c20.end());
  const auto pre = s.step(ForwardBatch::extend({r[1], r[2]}, {20, 33}, {0, 0}), x);
  std::vector<float> mx = xa;
  for (const auto* src : {&xb, &xc}) {
    const int64_t n = static_cast<int64_t>(src->size()) / D;
    const auto last = rows(*src, D, n - 1, 1);
    mx.insert(mx.end(), last.begin(), last.end());
  }
  const auto y = s.step(ForwardBatch::extend({r[0], r[1], r[2]}, {70, 1, 1}, {0, 20, 33}), mx);

  expect_close(rows(y, D, 0, 70), ya, "prefill segment");
  std::vector<float> yb_mixed = rows(pre, D, 0, 20), yc_mixed = rows(pre, D, 20, 33);
  const auto b1 = rows(y, D, 70, 1), c1 = rows(y, D, 71, 1);
  yb_mixed.insert(yb_mixed.end(), b1.begin(), b1.end());
  yc_mixed.insert(yc_mixed.end(), c1.begin(), c1.end());
  expect_close(yb_mixed, yb, "request B");
  expect_close(yc_mixed, yc, "request C");
  expect_close(s.states(r[0]), sa, "state A");
  expect_close(s.states(r[1]), sb, "state B");
  expect_close(s.states(r[2]), sc, "state C");
}

TEST(Layer, ChunkedPrefillKeepsItsSlotAcrossSteps) {
  const int64_t D = 256;
  const auto x = testing::random_normal(150 * D, 7);
  Stack one(2), chunked(2);
  const auto r1 = one.pools->req_to_token_pool.alloc(1);
  const auto y1 = one.step(ForwardBatch::extend(r1, {150}, {0}), x);
  const auto r2 = chunked.pools->req_to_token_pool.alloc(1);
  const int32_t slot = chunked.pools->req_to_token_pool.slot_of(r2[0]);
  std::vector<float> y2;
  int32_t done = 0;
  for (int32_t len : {64, 1, 0, 45, 40}) {  // chunk sizes a token budget could produce
    const auto y = chunked.step(ForwardBatch::extend(r2, {len}, {done}), rows(x, D, done, len));
    y2.insert(y2.end(), y.begin(), y.end());
    done += len;
    EXPECT_EQ(chunked.pools->req_to_token_pool.slot_of(r2[0]), slot);
  }
  expect_close(y2, y1, "chunked prefill output");
  expect_close(chunked.states(r2[0]), one.states(r1[0]), "chunked prefill state");
}

TEST(Layer, PaddedRowGivesZerosAndTouchesNoSlot) {
  const int64_t D = 256;
  Stack s(3);
  const auto r = s.pools->req_to_token_pool.alloc(2);
  s.step(ForwardBatch::extend(r, {5, 9}, {0, 0}), testing::random_normal(14 * D, 11));
  const auto before0 = s.states(r[0]), before1 = s.states(r[1]);
  const auto y = s.step(ForwardBatch::extend({r[0], -1}, {3, 4}, {5, 0}), testing::random_normal(7 * D, 12));
  for (int64_t i = 3 * D; i < 7 * D; ++i) ASSERT_EQ(y[i], 0.0f) << "padded row output " << i;
  EXPECT_NE(s.states(r[0]), before0);  // the real request moved on
  EXPECT_EQ(s.states(r[1]), before1);  // nobody else's slot changed
}

// The backend takes each raw projection as fp32 or bf16: bf16 rows give the same bits as fp32 rows of
// the same values (the bf16 mode's inputs are bf16 values), EXTEND and then DECODE, outputs and states,
// optimized and reference kernels; a pair with both or neither set is an error that changes nothing.
TEST(Backend, Bf16InputsEqualFp32InputsOfTheSameValues) {
  const int H = 2, K = 16, W = 4;
  const int64_t P = H * K, C = 3 * P, Tx = 70;
  const auto conv_w = testing::random_uniform(C * W, 1, -0.5f, 0.5f);
  const auto A_log = testing::random_uniform(H, 2, -1.0f, 1.0f);
  const auto dt_bias = testing::random_uniform(P, 3, -0.5f, 0.5f);
  const layers::RadixLinearAttention layer({.layer_id = 0,
                                            .num_q_heads = H,
                                            .num_k_heads = H,
                                            .num_v_heads = H,
                                            .head_q_dim = K,
                                            .head_k_dim = K,
                                            .head_v_dim = K,
                                            .conv_weights = conv_w.data(),
                                            .conv_kernel = W,
                                            .A_log = A_log.data(),
                                            .dt_bias = dt_bias.data(),
                                            .bf16_activations = true});
  // Rows of [qkv | a | b] with padding columns, bf16 values, as fp32 and as bf16.
  const int64_t ld = C + P + H + 5;
  const auto rows_of = [&](int64_t T, uint64_t seed) {
    auto v = testing::random_normal(T * ld, seed);
    for (auto& x : v) x = round_bf16(x);
    std::vector<bf16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = f32_to_bf16(v[i]);
    return std::pair{v, b};
  };
  for (const auto impl : {kernels::KernelImpl::Optimized, kernels::KernelImpl::Naive}) {
    SCOPED_TRACE(kernels::to_string(impl));
    KDAAttnBackend backend(impl);
    mem_cache::RecurrentStatePoolConfig pc{.layer_ids = {0},
                                           .size = 2,
                                           .num_heads = H,
                                           .head_k_dim = K,
                                           .head_v_dim = K,
                                           .conv_kernel = W,
                                           .conv_dim = C,
                                           .conv_dtype = Precision::BF16};
    MemoryPools pools(pc, 2);
    const auto reqs = pools.req_to_token_pool.alloc(2);  // request 0 takes fp32 rows, request 1 bf16 rows
    const auto state = [&](int i) {
      std::vector<float> rec(H * K * K), conv((W - 1) * C);
      const int32_t slot[1] = {pools.req_to_token_pool.slot_of(reqs[i])};
      pools.recurrent_state_pool.read_linear_recurrent_layer_cache(0, slot, rec.data(), conv.data());
      rec.insert(rec.end(), conv.begin(), conv.end());
      return rec;
    };
    const auto run = [&](int i, bool decode, int64_t T,
                         const layers::attention::linear::LinearAttnInputs& in) {
      const std::vector<int32_t> r = {reqs[i]};
      auto fb = decode ? ForwardBatch::decode(r) : ForwardBatch::extend(r, {static_cast<int32_t>(T)}, {0});
      fb.attn_backend = &backend;
      backend.init_forward_metadata(fb, pools.req_to_token_pool.get_recurrent_indices(r));
      std::vector<float> o(T * P, -1.0f);
      layer(fb, in, pools.recurrent_state_pool, o.data());
      return o;
    };
    for (const bool decode : {false, true}) {
      const int64_t T = decode ? 1 : Tx;
      const auto [f, b] = rows_of(T, decode ? 5 : 4);
      const auto o32 = run(0, decode, T,
                           {.mixed_qkv = f.data(),
                            .qkv_stride = ld,
                            .a = f.data() + C,
                            .a_stride = ld,
                            .b = f.data() + C + P,
                            .b_stride = ld});
      const layers::attention::linear::LinearAttnInputs in16{.mixed_qkv_bf16 = b.data(),
                                                             .qkv_stride = ld,
                                                             .a_bf16 = b.data() + C,
                                                             .a_stride = ld,
                                                             .b_bf16 = b.data() + C + P,
                                                             .b_stride = ld};
      EXPECT_EQ(run(1, decode, T, in16), o32) << (decode ? "decode" : "extend");
      EXPECT_EQ(state(1), state(0)) << (decode ? "decode" : "extend");
      // Both or neither of a pair: an error, nothing changed.
      const auto before = state(1);
      auto both = in16;
      both.a = f.data() + C;
      EXPECT_THROW(run(1, decode, T, both), std::invalid_argument);
      auto neither = in16;
      neither.b_bf16 = nullptr;
      EXPECT_THROW(run(1, decode, T, neither), std::invalid_argument);
      EXPECT_EQ(state(1), before);
    }
  }
}

TEST(Layer, IdleAndDummyFirstGiveZerosAndTouchNoState) {
  const int64_t D = 256;
  Stack s(2);
  const auto r = s.pools->req_to_token_pool.alloc(1);
  s.step(ForwardBatch::extend(r, {10}, {0}), testing::random_normal(10 * D, 5));
  const auto before = s.states(r[0]);
  for (ForwardMode m : {ForwardMode::IDLE, ForwardMode::DUMMY_FIRST}) {
    auto fb = ForwardBatch::extend(r, {4}, {10});
    fb.forward_mode = m;
    const auto y = s.step(fb, testing::random_normal(4 * D, 6));
    for (float v : y) ASSERT_EQ(v, 0.0f) << model_executor::to_string(m);
    EXPECT_EQ(s.states(r[0]), before) << model_executor::to_string(m);
    // The backend alone answers these modes with zeros too.
    std::vector<float> o(4 * 512, 1.0f), qkv(4 * 1536, 1.0f), a(4 * 512), b(4 * 4);
    fb.attn_backend = &s.backend;
    s.layer->attn()(fb, qkv.data(), 1536, a.data(), 512, b.data(), 4, s.pools->recurrent_state_pool,
                    o.data());
    for (float v : o) ASSERT_EQ(v, 0.0f);
  }
  auto idle = ForwardBatch::extend({}, {}, {});
  idle.forward_mode = ForwardMode::IDLE;
  EXPECT_TRUE(s.step(idle, {}).empty());
}

TEST(Layer, DraftExtendIsRefused) {
  const int64_t D = 256;
  Stack s(2);
  const auto r = s.pools->req_to_token_pool.alloc(1);
  const auto before = s.states(r[0]);
  auto fb = ForwardBatch::extend(r, {2}, {0});
  fb.forward_mode = ForwardMode::DRAFT_EXTEND;
  try {
    s.step(fb, testing::random_normal(2 * D, 1));
    ADD_FAILURE() << "no error for DRAFT_EXTEND";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("not supported"));
    EXPECT_THAT(e.what(), HasSubstr("DRAFT_EXTEND"));
  }
  std::vector<float> y(2 * D);
  fb.attn_backend = &s.backend;
  EXPECT_THROW(s.layer->forward(y.data(), 2, fb, s.pools->recurrent_state_pool, y.data()),
               std::runtime_error);
  EXPECT_EQ(s.states(r[0]), before);
}

// The backend runs q, k and v with one head count: v with more (or fewer) heads than q/k would read q
// and k past their columns (or drop heads), so the layer refuses it when it is built.
TEST(Layer, VHeadsUnlikeQkHeadsAreRefused) {
  const int K = 16, W = 4;
  const auto conv_w = testing::random_uniform(8 * K * 3 * W, 1, -0.5f, 0.5f);
  const auto A_log = testing::random_uniform(8, 2, -1.0f, 1.0f);
  layers::RadixLinearAttention::Params p{.layer_id = 5,
                                         .num_q_heads = 2,
                                         .num_k_heads = 2,
                                         .num_v_heads = 2,
                                         .head_q_dim = K,
                                         .head_k_dim = K,
                                         .head_v_dim = 2 * K,  // other value dims are fine
                                         .conv_weights = conv_w.data(),
                                         .conv_kernel = W,
                                         .A_log = A_log.data()};
  EXPECT_NO_THROW(layers::RadixLinearAttention{p});
  for (int hv : {4, 1}) {
    p.num_v_heads = hv;
    testing::expect_throw_with<std::invalid_argument>(
        [&] { layers::RadixLinearAttention{p}; },
        "v has " + std::to_string(hv) +
            " heads but q and k have 2; the KDA backend needs one head count "
            "for q, k and v (layer 5)");
  }
}

TEST(Layer, BadBatchesAreErrorsThatChangeNothing) {
  const int64_t D = 256;
  Stack s(3);
  const auto r = s.pools->req_to_token_pool.alloc(2);
  s.step(ForwardBatch::extend(r, {6, 6}, {0, 0}), testing::random_normal(12 * D, 2));
  const auto b0 = s.states(r[0]), b1 = s.states(r[1]);
  const auto x = testing::random_normal(4 * D, 3);
  auto fb = ForwardBatch::extend(r, {2, 2}, {6, 6});
  fb.attn_backend = &s.backend;
  std::vector<float> y(4 * D);
  // A slot outside the pool.
  const int32_t bad_slots[2] = {1, 99};
  s.backend.init_forward_metadata(fb, bad_slots);
  EXPECT_THROW(s.layer->forward(x.data(), 4, fb, s.pools->recurrent_state_pool, y.data()),
               std::invalid_argument);
  // The same slot twice.
  const int32_t dup[2] = {1, 1};
  s.backend.init_forward_metadata(fb, dup);
  EXPECT_THROW(s.layer->forward(x.data(), 4, fb, s.pools->recurrent_state_pool, y.data()),
               std::invalid_argument);
  // Rows unlike the batch's token count.
  EXPECT_THROW(s.layer->forward(x.data(), 3, fb, s.pools->recurrent_state_pool, y.data()),
               std::invalid_argument);
  // DECODE with a 2-token row; negative lengths.
  auto dec = ForwardBatch::decode(r);
  dec.extend_seq_lens[0] = 2;
  EXPECT_THROW(dec.validate(), std::invalid_argument);
  EXPECT_THROW(ForwardBatch::extend(r, {-1, 5}, {0, 0}).validate(), std::invalid_argument);
  // A free request index.
  EXPECT_THROW(s.pools->req_to_token_pool.get_recurrent_indices(std::vector<int32_t>{r[0], 5}),
               std::exception);
  EXPECT_EQ(s.states(r[0]), b0);
  EXPECT_EQ(s.states(r[1]), b1);
}

// Prefix caching: an EXTEND with state_snapshots leaves in each snapshot slot the recurrent and conv
// states that an EXTEND over only the first pos tokens of that request leaves in the request's slot: a
// fresh request (A, 150 tokens) and one continuing from a 20-token prefix (B, 70 more; its snapshot at
// pos 2 reaches into the previous conv state), positions inside chunks, at chunk boundaries and at the
// end, in both precisions (the same computation: conv states bit for bit, recurrent states within the
// fp32 tolerance, as the chunk grids differ). The batch's own states are those of the same batch without
// snapshots within the same tolerance, and so are its outputs in fp32 (bf16: the kernel output's bf16
// rounding point turns fp32-level differences into bf16-level ones).
TEST(Layer, StateSnapshotsEqualStatesOfTruncatedExtends) {
  const int64_t D = 256;
  const auto xa = testing::random_normal(150 * D, 21);
  const auto xb = testing::random_normal(90 * D, 22);  // 20-token prefix, then 70
  for (const Precision prec : {Precision::FP32, Precision::BF16}) {
    SCOPED_TRACE(prec == Precision::FP32 ? "fp32" : "bf16");
    Stack s(12, prec), plain(12, prec);
    const auto r = s.pools->req_to_token_pool.alloc(2);
    const auto rp = plain.pools->req_to_token_pool.alloc(2);
    s.step(ForwardBatch::extend({r[1]}, {20}, {0}), rows(xb, D, 0, 20));
    plain.step(ForwardBatch::extend({rp[1]}, {20}, {0}), rows(xb, D, 0, 20));
    const auto slots = s.pools->recurrent_state_pool.alloc(8);  // held by no request
    struct Snap {
      int32_t row, pos;
    };
    const std::vector<Snap> at = {{0, 1}, {0, 64}, {0, 100}, {0, 150}, {1, 2}, {1, 64}, {1, 70}};
    std::vector<float> x = xa;
    const auto b = rows(xb, D, 20, 70);
    x.insert(x.end(), b.begin(), b.end());
    auto fb = ForwardBatch::extend({r[0], r[1]}, {150, 70}, {0, 20});
    for (size_t j = 0; j < at.size(); ++j) fb.state_snapshots.push_back({at[j].row, at[j].pos, slots[j]});
    const auto y = s.step(fb, x);
    const auto y_plain = plain.step(ForwardBatch::extend({rp[0], rp[1]}, {150, 70}, {0, 20}), x);
    if (prec == Precision::FP32) {
      expect_close(y, y_plain, "output with snapshots");
    } else {
      // The kernel output is rounded to bf16 before the norm: fp32-level differences move roundings.
      const double rel = testing::rel_l2(y.data(), y_plain.data(), y.size());
      std::printf("  bf16 output with snapshots against without: rel L2 %.3g\n", rel);
      EXPECT_LE(rel, 3.5e-4) << "output with snapshots";  // reached 1.2e-4
    }
    for (int i = 0; i < 2; ++i)
      expect_close(s.states(r[i]), plain.states(rp[i]), "final state " + std::to_string(i));

    const auto& pc = s.pools->recurrent_state_pool.config();
    const size_t nrec = static_cast<size_t>(pc.num_heads) * pc.head_k_dim * pc.head_v_dim;
    for (size_t j = 0; j < at.size(); ++j) {
      const std::string what = "row " + std::to_string(at[j].row) + " pos " + std::to_string(at[j].pos);
      Stack t(2, prec);
      const auto tr = t.pools->req_to_token_pool.alloc(1);
      if (at[j].row == 0) {
        t.step(ForwardBatch::extend(tr, {at[j].pos}, {0}), rows(xa, D, 0, at[j].pos));
      } else {
        t.step(ForwardBatch::extend(tr, {20}, {0}), rows(xb, D, 0, 20));
        t.step(ForwardBatch::extend(tr, {at[j].pos}, {20}), rows(xb, D, 20, at[j].pos));
      }
      const auto got = s.slot_states(slots[j]), want = t.states(tr[0]);
      ASSERT_EQ(got.size(), want.size());
      EXPECT_LE(testing::max_error_ratio(got.data(), want.data(), nrec, kTol, kTol), 1.0)
          << what << " recurrent";
      EXPECT_TRUE(std::equal(got.begin() + nrec, got.end(), want.begin() + nrec)) << what << " conv";
      EXPECT_NE(got, std::vector<float>(got.size(), 0.0f)) << what;
    }
    const auto untouched = s.slot_states(slots[7]);  // no snapshot named it
    EXPECT_EQ(untouched, std::vector<float>(untouched.size(), 0.0f));
  }
}

// Bad snapshots are errors that change nothing: no request's state and no snapshot slot.
TEST(Layer, BadStateSnapshotsAreErrorsThatChangeNothing) {
  const int64_t D = 256;
  Stack s(8);
  const auto r = s.pools->req_to_token_pool.alloc(2);
  s.step(ForwardBatch::extend(r, {6, 6}, {0, 0}), testing::random_normal(12 * D, 31));
  auto& pool = s.pools->recurrent_state_pool;
  const auto snap = pool.alloc(2);
  const auto freed = pool.alloc(1);
  pool.free(freed);
  const auto before = [&] {
    std::vector<std::vector<float>> v;
    for (int32_t sl : {pool_slot(s, r[0]), pool_slot(s, r[1]), snap[0], snap[1]})
      v.push_back(s.slot_states(sl));
    return v;
  };
  const auto b0 = before();
  const auto x = testing::random_normal(7 * D, 32);
  using Snap = ForwardBatch::StateSnapshot;
  const std::vector<std::pair<std::vector<Snap>, std::string>> bad = {
      {{{2, 1, snap[0]}}, "row 2 is not in [0, 2)"},
      {{{0, 0, snap[0]}}, "pos 0 is not in [1, 3]"},
      {{{1, 5, snap[0]}}, "pos 5 is not in [1, 4]"},
      {{{0, 1, snap[0]}, {1, 2, snap[0]}}, "two state snapshots into slot"},
      {{{0, 1, pool_slot(s, r[1])}}, "the slot of request 1 of this batch"},
      {{{0, 1, freed[0]}}, "is not an allocated slot of the state pool"},
      {{{0, 1, 99}}, "is not an allocated slot of the state pool"},
      {{{0, 1, -1}}, "negative slot"},
  };
  for (const auto& [snaps, what] : bad) {
    SCOPED_TRACE(what);
    auto fb = ForwardBatch::extend(r, {3, 4}, {6, 6});
    fb.state_snapshots = snaps;
    try {
      s.step(fb, x);
      ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
    EXPECT_EQ(before(), b0);
  }
  // A padded row takes no snapshot; DECODE takes none.
  auto padded = ForwardBatch::extend({r[0], -1}, {3, 4}, {6, 0});
  padded.state_snapshots = {{1, 1, snap[0]}};
  EXPECT_THROW(padded.validate(), std::invalid_argument);
  auto dec = ForwardBatch::decode(r);
  dec.state_snapshots = {{0, 1, snap[0]}};
  EXPECT_THROW(s.step(dec, testing::random_normal(2 * D, 33)), std::invalid_argument);
  EXPECT_EQ(before(), b0);
}

// ---------------------------------------------------------------------------------------------------
// Speculative decoding: TARGET_VERIFY, then accept.

// A stack whose pool has a verify buffer of `verify_tokens` tokens per row.
std::unique_ptr<Stack> verify_stack(int64_t slots, Precision p, int verify_tokens) {
  auto s = std::make_unique<Stack>(slots, p);
  s->init_pools(slots, p, verify_tokens);
  return s;
}

// The same layer computation, done as DECODE steps (on the stack's reference backend, so that a pending
// verify stays pending): outputs of each token and the slot's states after.
struct Decoded {
  std::vector<std::vector<float>> y, states;
};
Decoded decode_steps(Stack& s, int32_t req, const std::vector<std::vector<float>>& tokens) {
  Decoded d;
  for (const auto& x : tokens) {
    d.y.push_back(s.step(ForwardBatch::decode({req}), x, s.ref_backend));
    d.states.push_back(s.states(req));
  }
  return d;
}

// fp32: the fp32 tolerance. bf16 through the full stack: the verify step's projections are GEMMs over
// d+1 rows, the DECODE steps' over 1, and bf16 products of different row counts may round differently by
// an ulp, which the conv state keeps as it is: relative L2 <= 5e-3. (The same bf16 computation from the
// same projections is compared within the fp32 tolerance in Verify.Bf16BackendEqualsDecodeSteps.)
void expect_state_close(const std::vector<float>& got, const std::vector<float>& want,
                        const std::string& what, Precision p = Precision::FP32) {
  ASSERT_EQ(got.size(), want.size()) << what;
  if (p == Precision::FP32) {
    EXPECT_LE(testing::max_error_ratio(got.data(), want.data(), got.size(), kTol, kTol), 1.0) << what;
  } else {
    EXPECT_LE(testing::rel_l2(got.data(), want.data(), got.size()), 5e-3) << what;
  }
}

void expect_output_close(const std::vector<float>& got, const std::vector<float>& want, Precision p,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  if (p == Precision::FP32) {
    EXPECT_LE(testing::max_error_ratio(got.data(), want.data(), got.size(), kTol, kTol), 1.0) << what;
  } else {
    EXPECT_LE(testing::rel_l2(got.data(), want.data(), got.size()), 5e-3) << what;
  }
}

// Chains: requests with d = 4, 0 and 2 drafts and a padded row in one verify batch; for every a in 0..4
// (the others' a_i cycling through theirs), the outputs of every position equal those of DECODE steps
// over the row's tokens, and after accept each slot holds the state after a_i + 1 DECODE steps
// (recurrent and conv, fp32 tolerance; the same bf16 computation in bf16), and the next DECODE step gives
// the same output and states: the rejected drafts leave no trace.
TEST(Verify, ChainAcceptEqualsDecodeSteps) {
  const int64_t D = 256;
  for (const Precision prec : {Precision::FP32, Precision::BF16}) {
    SCOPED_TRACE(prec == Precision::FP32 ? "fp32" : "bf16");
    auto sp = verify_stack(24, prec, 5);
    Stack& s = *sp;
    const auto base = s.pools->req_to_token_pool.alloc(3);
    s.step(ForwardBatch::extend(base, {7, 3, 1}, {0, 0, 0}), testing::random_normal(11 * D, 41));
    const std::vector<int32_t> d = {4, 0, 2};
    for (int32_t a0 = 0; a0 <= 4; ++a0) {
      SCOPED_TRACE("a0=" + std::to_string(a0));
      const std::vector<int32_t> acc = {a0, 0, a0 % 3};
      std::vector<int32_t> w, ref;
      for (int32_t b : base) {
        w.push_back(s.pools->req_to_token_pool.fork(b));
        ref.push_back(s.pools->req_to_token_pool.fork(b));
      }
      // Rows: request 0, a padded row of 2 tokens, request 1, request 2.
      const std::vector<int32_t> rows_of = {0, -1, 1, 2};
      std::vector<int32_t> reqs, dl;
      for (int32_t r : rows_of) {
        reqs.push_back(r < 0 ? -1 : w[r]);
        dl.push_back(r < 0 ? 1 : d[r]);
      }
      const auto x = testing::random_normal(11 * D, 50 + a0);
      auto fb = ForwardBatch::target_verify(reqs, dl);
      std::vector<std::vector<float>> before;
      for (int32_t r : w) before.push_back(s.states(r));
      const auto y = s.step(fb, x);
      for (size_t i = 0; i < w.size(); ++i)
        EXPECT_EQ(s.states(w[i]), before[i]) << "verify moved request " << i;
      int64_t t = 0;
      for (size_t row = 0; row < rows_of.size(); ++row) {
        const int64_t len = dl[row] + 1;
        if (rows_of[row] < 0) {
          EXPECT_EQ(rows(y, D, t, len), std::vector<float>(len * D, 0.0f)) << "padded row";
          t += len;
          continue;
        }
        const int r = rows_of[row];
        std::vector<std::vector<float>> toks;
        for (int64_t j = 0; j < len; ++j) toks.push_back(rows(x, D, t + j, 1));
        const Decoded dec = decode_steps(s, ref[r], toks);  // all d+1 tokens
        for (int64_t j = 0; j < len; ++j)
          expect_output_close(rows(y, D, t + j, 1), dec.y[j], prec,
                              "request " + std::to_string(r) + " pos " + std::to_string(j));
        // The reference request again, stopped after a_i + 1 tokens.
        s.pools->req_to_token_pool.free(std::vector<int32_t>{ref[r]});
        ref[r] = s.pools->req_to_token_pool.fork(base[r]);
        decode_steps(s, ref[r], std::vector<std::vector<float>>(toks.begin(), toks.begin() + acc[r] + 1));
        t += len;
      }
      s.backend.accept(fb, std::vector<int32_t>{acc[0], 0, acc[1], acc[2]}, s.pools->recurrent_state_pool);
      EXPECT_FALSE(s.backend.has_pending_verify());
      const auto next = testing::random_normal(D, 60 + a0);
      for (int r = 0; r < 3; ++r) {
        const std::string what = "request " + std::to_string(r) + " a=" + std::to_string(acc[r]);
        expect_state_close(s.states(w[r]), s.states(ref[r]), what + " state after accept", prec);
        const auto yw = s.step(ForwardBatch::decode({w[r]}), next);
        const auto yr = s.step(ForwardBatch::decode({ref[r]}), next);
        expect_output_close(yw, yr, prec, what + " next token");
        expect_state_close(s.states(w[r]), s.states(ref[r]), what + " state after the next token", prec);
      }
      s.pools->req_to_token_pool.free(w);
      s.pools->req_to_token_pool.free(ref);
    }
  }
}

// One request's chain alone: its accepted tokens' kept rows lie one after the other in the verify buffer,
// and accept replays them in place (no copy); the slot then equals a_i + 1 DECODE steps for every a_i.
TEST(Verify, OneRequestsChainReplaysInPlace) {
  const int64_t D = 256;
  for (const Precision prec : {Precision::FP32, Precision::BF16}) {
    SCOPED_TRACE(prec == Precision::FP32 ? "fp32" : "bf16");
    auto sp = verify_stack(8, prec, 5);
    Stack& s = *sp;
    const auto base = s.pools->req_to_token_pool.alloc(1);
    s.step(ForwardBatch::extend(base, {6}, {0}), testing::random_normal(6 * D, 81));
    for (int32_t a = 0; a <= 4; ++a) {
      const int32_t w = s.pools->req_to_token_pool.fork(base[0]),
                    ref = s.pools->req_to_token_pool.fork(base[0]);
      const auto x = testing::random_normal(5 * D, 82 + a);
      s.step(ForwardBatch::target_verify({w}, {4}), x);
      std::vector<std::vector<float>> toks;
      for (int32_t j = 0; j <= a; ++j) toks.push_back(rows(x, D, j, 1));
      decode_steps(s, ref, toks);
      s.backend.accept(ForwardBatch::target_verify({w}, {4}), std::vector<int32_t>{a},
                       s.pools->recurrent_state_pool);
      expect_state_close(s.states(w), s.states(ref), "a=" + std::to_string(a), prec);
      s.pools->req_to_token_pool.free(std::vector<int32_t>{w, ref});
    }
  }
}

// Trees: each draft names its parent; every token's output equals its path run alone as DECODE steps,
// and accepting any node leaves the state of its root-to-node path; a chain request in the same batch.
TEST(Verify, TreeAcceptEqualsItsPathAsDecodeSteps) {
  const int64_t D = 256;
  for (const Precision prec : {Precision::FP32, Precision::BF16}) {
    SCOPED_TRACE(prec == Precision::FP32 ? "fp32" : "bf16");
    auto sp = verify_stack(8, prec, 8);
    Stack& s = *sp;
    const auto base = s.pools->req_to_token_pool.alloc(2);
    s.step(ForwardBatch::extend(base, {5, 2}, {0, 0}), testing::random_normal(7 * D, 71));
    // Row 0: drafts 0..5 with parents (-1: the last accepted token); row 1: 2 drafts whose parents are -1, 0.
    // Row positions' parents (position 0 is the last accepted token, draft j at position j + 1).
    const std::vector<int32_t> parents = {-1, 0, 1, 0, 3, 1, 5};
    for (int32_t pos = 0; pos <= 6; ++pos) {
      SCOPED_TRACE("accept position " + std::to_string(pos));
      const int32_t w0 = s.pools->req_to_token_pool.fork(base[0]),
                    w1 = s.pools->req_to_token_pool.fork(base[1]);
      const auto x = testing::random_normal(10 * D, 80 + pos);
      auto fb = ForwardBatch::target_verify({w0, w1}, {6, 2}, {-1, 0, -1, 2, 0, 4, -1, 0});
      const auto y = s.step(fb, x);
      // Row 0's token j: its path (row positions, root first).
      const auto path = [&](int32_t j) {
        std::vector<int32_t> p;
        for (int32_t t = j; t >= 0; t = parents[t]) p.insert(p.begin(), t);
        return p;
      };
      for (int32_t j = 0; j <= 6; ++j) {
        const int32_t r = s.pools->req_to_token_pool.fork(base[0]);
        std::vector<std::vector<float>> toks;
        for (int32_t t : path(j)) toks.push_back(rows(x, D, t, 1));
        const Decoded dec = decode_steps(s, r, toks);
        expect_output_close(rows(y, D, j, 1), dec.y.back(), prec, "tree token " + std::to_string(j));
        if (j == pos) {
          s.backend.accept(fb, std::vector<int32_t>{pos, 1}, s.pools->recurrent_state_pool);
          expect_state_close(s.states(w0), s.states(r), "tree state after accept", prec);
          const auto next = testing::random_normal(D, 90 + pos);
          expect_output_close(s.step(ForwardBatch::decode({w0}), next),
                              s.step(ForwardBatch::decode({r}), next), prec, "next token");
          expect_state_close(s.states(w0), s.states(r), "tree state after the next token", prec);
        }
        s.pools->req_to_token_pool.free(std::vector<int32_t>{r});
      }
      // Row 1 (a chain written as parents), accepted 1 draft.
      const int32_t r1 = s.pools->req_to_token_pool.fork(base[1]);
      decode_steps(s, r1, {rows(x, D, 7, 1), rows(x, D, 8, 1)});
      expect_state_close(s.states(w1), s.states(r1), "row 1 state after accept", prec);
      s.pools->req_to_token_pool.free(std::vector<int32_t>{w0, w1, r1});
    }
  }
}

// The same bf16 computation from the same projections (the backend fed bf16 rows): a tree verify and
// accept of each node equal DECODE steps over its path, states within the fp32 tolerance, outputs too.
TEST(Verify, Bf16BackendEqualsDecodeSteps) {
  const int H = 2, K = 16, W = 4;
  const int64_t P = H * K, C = 3 * P, ld = C + P + H;
  const auto conv_w = testing::random_uniform(C * W, 111, -0.5f, 0.5f);
  const auto A_log = testing::random_uniform(H, 112, -1.0f, 1.0f);
  const auto dt_bias = testing::random_uniform(P, 113, -0.5f, 0.5f);
  const layers::RadixLinearAttention layer({.layer_id = 0,
                                            .num_q_heads = H,
                                            .num_k_heads = H,
                                            .num_v_heads = H,
                                            .head_q_dim = K,
                                            .head_k_dim = K,
                                            .head_v_dim = K,
                                            .conv_weights = conv_w.data(),
                                            .conv_kernel = W,
                                            .A_log = A_log.data(),
                                            .dt_bias = dt_bias.data(),
                                            .bf16_activations = true});
  std::vector<bf16_t> x(10 * ld);
  {
    const auto v = testing::random_normal(x.size(), 114);
    for (size_t i = 0; i < v.size(); ++i) x[i] = f32_to_bf16(v[i]);
  }
  const std::vector<int32_t> parents = {-1, 0, 1, 0, 3, 1, 5};  // row positions (drafts -1, 0, -1, 2, 0, 4)
  for (int32_t pos = 0; pos <= 6; ++pos) {
    SCOPED_TRACE("accept position " + std::to_string(pos));
    KDAAttnBackend backend, ref_backend;  // the verify's, and the reference DECODE steps'

    mem_cache::RecurrentStatePoolConfig pc{.layer_ids = {0},
                                           .size = 2,
                                           .num_heads = H,
                                           .head_k_dim = K,
                                           .head_v_dim = K,
                                           .conv_kernel = W,
                                           .conv_dim = C,
                                           .conv_dtype = Precision::BF16,
                                           .max_verify_tokens = 7};
    MemoryPools pools(pc, 2);
    const auto reqs = pools.req_to_token_pool.alloc(2);  // 0 verifies, 1 decodes
    const auto state = [&](int i) {
      std::vector<float> rec(H * K * K), conv((W - 1) * C);
      const int32_t slot[1] = {pools.req_to_token_pool.slot_of(reqs[i])};
      pools.recurrent_state_pool.read_linear_recurrent_layer_cache(0, slot, rec.data(), conv.data());
      rec.insert(rec.end(), conv.begin(), conv.end());
      return rec;
    };
    const auto run = [&](ForwardBatch fb, const bf16_t* rows, KDAAttnBackend* be = nullptr) {
      if (be == nullptr) be = &backend;
      fb.attn_backend = be;
      be->init_forward_metadata(fb, pools.req_to_token_pool.get_recurrent_indices(fb.req_pool_indices));
      std::vector<float> o(fb.num_tokens() * P);
      layer(fb,
            {.mixed_qkv_bf16 = rows,
             .qkv_stride = ld,
             .a_bf16 = rows + C,
             .a_stride = ld,
             .b_bf16 = rows + C + P,
             .b_stride = ld},
            pools.recurrent_state_pool, o.data());
      return o;
    };
    // A shared history (rows 7..9 as a 3-token prefill of both).
    run(ForwardBatch::extend({reqs[0]}, {3}, {0}), x.data() + 7 * ld);
    run(ForwardBatch::extend({reqs[1]}, {3}, {0}), x.data() + 7 * ld);
    auto fb = ForwardBatch::target_verify({reqs[0]}, {6}, {-1, 0, -1, 2, 0, 4});
    const auto y = run(fb, x.data());
    std::vector<int32_t> path;
    for (int32_t t = pos; t >= 0; t = parents[t]) path.insert(path.begin(), t);
    std::vector<float> yd;
    for (int32_t t : path) yd = run(ForwardBatch::decode({reqs[1]}), x.data() + t * ld, &ref_backend);
    EXPECT_LE(testing::max_error_ratio(y.data() + pos * P, yd.data(), P, kTol, kTol), 1.0) << "output";
    backend.accept(fb, std::vector<int32_t>{pos}, pools.recurrent_state_pool);
    const auto s0 = state(0), s1 = state(1);
    EXPECT_LE(testing::max_error_ratio(s0.data(), s1.data(), s0.size(), kTol, kTol), 1.0) << "state";
  }
}

// Bad input is an error that changes nothing: more drafts than the verify buffer holds, a parent after
// its child, an unknown slot, no verify buffer; accept with a_i > d_i, another batch, or none pending.
TEST(Verify, BadInputIsAnErrorThatChangesNothing) {
  const int64_t D = 256;
  auto sp = verify_stack(6, Precision::FP32, 4);
  Stack& s = *sp;
  const auto r = s.pools->req_to_token_pool.alloc(2);
  s.step(ForwardBatch::extend(r, {4, 3}, {0, 0}), testing::random_normal(7 * D, 101));
  const auto b0 = s.states(r[0]), b1 = s.states(r[1]);
  const auto unchanged = [&] {
    EXPECT_EQ(s.states(r[0]), b0);
    EXPECT_EQ(s.states(r[1]), b1);
  };
  const auto expect_error = [&](const std::function<void()>& f, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "no error: " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
    unchanged();
  };
  expect_error(
      [&] {
        s.step(ForwardBatch::target_verify(r, {4, 1}), testing::random_normal(7 * D, 102));
      },
      "more than the verify buffer holds");
  expect_error(
      [&] {
        s.step(ForwardBatch::target_verify(r, {2, 1}, {-1, 1, -1}), testing::random_normal(5 * D, 103));
      },
      "a parent comes before its child");
  expect_error([&] { ForwardBatch::target_verify(r, {2, -1}); }, "has -1 drafts");
  expect_error(
      [&] {
        s.backend.accept(ForwardBatch::target_verify(r, {1, 1}), std::vector<int32_t>{0, 0},
                         s.pools->recurrent_state_pool);
      },
      "no TARGET_VERIFY batch is pending");
  {  // An unknown slot.
    auto fb = ForwardBatch::target_verify(r, {1, 1});
    fb.attn_backend = &s.backend;
    const int32_t bad[2] = {1, 99};
    s.backend.init_forward_metadata(fb, bad);
    std::vector<float> y(4 * D);
    const auto x = testing::random_normal(4 * D, 104);
    expect_error([&] { s.layer->forward(x.data(), 4, fb, s.pools->recurrent_state_pool, y.data()); },
                 "outside the pool's");
  }
  auto fb = ForwardBatch::target_verify(r, {3, 2});
  s.step(fb, testing::random_normal(7 * D, 105));
  unchanged();
  expect_error(
      [&] {
        s.backend.accept(fb, std::vector<int32_t>{4, 0}, s.pools->recurrent_state_pool);
      },
      "row 0 accepts position 4 of its 3 drafts");
  expect_error([&] { s.backend.accept(fb, std::vector<int32_t>{0}, s.pools->recurrent_state_pool); },
               "1 accepted positions for 2 rows");
  expect_error(
      [&] {
        s.backend.accept(ForwardBatch::target_verify(r, {3, 1}), std::vector<int32_t>{0, 0},
                         s.pools->recurrent_state_pool);
      },
      "not the pending TARGET_VERIFY batch");
  EXPECT_TRUE(s.backend.has_pending_verify());
  s.backend.accept(fb, std::vector<int32_t>{3, 2}, s.pools->recurrent_state_pool);
  EXPECT_NE(s.states(r[0]), b0);
  // A pool without a verify buffer.
  Stack plain(2);
  const auto pr = plain.pools->req_to_token_pool.alloc(1);
  EXPECT_EQ(plain.pools->recurrent_state_pool.spec_state_bytes(), 0u);
  EXPECT_GT(s.pools->recurrent_state_pool.spec_state_bytes(), 0u);
  try {
    plain.step(ForwardBatch::target_verify(pr, {1}), testing::random_normal(2 * D, 106));
    ADD_FAILURE() << "no error without a verify buffer";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("no verify buffer"));
  }
}

// Several small KDA layers (raw RadixLinearAttention layers, decoder ids 0..L-1) over one pool with a
// verify buffer: what a verify and its accept do across a stack. Every layer reads the same input rows
// [T, ld] (q||k||v, gate, beta logits); the weights differ per layer.
struct TinyLayers {
  static constexpr int H = 2, K = 16, W = 4;
  static constexpr int64_t P = H * K, C = 3 * P, ld = C + P + H;
  std::vector<std::vector<float>> conv_w, A_log, dt_bias;
  std::vector<std::unique_ptr<layers::RadixLinearAttention>> layers;
  std::unique_ptr<MemoryPools> pools;

  TinyLayers(int L, int64_t slots, Precision conv, int verify_tokens) {
    mem_cache::RecurrentStatePoolConfig pc{.layer_ids = {},
                                           .size = slots,
                                           .num_heads = H,
                                           .head_k_dim = K,
                                           .head_v_dim = K,
                                           .conv_kernel = W,
                                           .conv_dim = C,
                                           .conv_dtype = conv,
                                           .max_verify_tokens = verify_tokens};
    for (int l = 0; l < L; ++l) {
      conv_w.push_back(testing::random_uniform(C * W, 200 + l, -0.5f, 0.5f));
      A_log.push_back(testing::random_uniform(H, 300 + l, -1.0f, 1.0f));
      dt_bias.push_back(testing::random_uniform(P, 400 + l, -0.5f, 0.5f));
      layers.push_back(std::make_unique<layers::RadixLinearAttention>(
          layers::RadixLinearAttention::Params{.layer_id = l,
                                               .num_q_heads = H,
                                               .num_k_heads = H,
                                               .num_v_heads = H,
                                               .head_q_dim = K,
                                               .head_k_dim = K,
                                               .head_v_dim = K,
                                               .conv_weights = conv_w.back().data(),
                                               .conv_kernel = W,
                                               .A_log = A_log.back().data(),
                                               .dt_bias = dt_bias.back().data(),
                                               .bf16_activations = conv == Precision::BF16}));
      pc.layer_ids.push_back(l);
    }
    pools = std::make_unique<MemoryPools>(pc, slots);
  }
  static std::vector<float> rows(int64_t T, uint64_t seed) { return testing::random_normal(T * ld, seed); }

  // One batch on `be` through the first `n` layers (all when n < 0); every layer's outputs.
  std::vector<float> run(ForwardBatch fb, const std::vector<float>& x, KDAAttnBackend& be, int n = -1) {
    fb.attn_backend = &be;
    be.init_forward_metadata(fb, pools->req_to_token_pool.get_recurrent_indices(fb.req_pool_indices));
    const int64_t T = fb.num_tokens();
    std::vector<float> o(layers.size() * T * P);
    for (size_t l = 0; l < layers.size() && (n < 0 || static_cast<int>(l) < n); ++l)
      (*layers[l])(fb, x.data(), ld, x.data() + C, ld, x.data() + C + P, ld, pools->recurrent_state_pool,
                   o.data() + l * T * P);
    return o;
  }
  // The requests' states in every layer (recurrent, then conv), as fp32.
  std::vector<float> states(const std::vector<int32_t>& reqs) {
    const auto slots = pools->req_to_token_pool.get_recurrent_indices(reqs);
    std::vector<float> out;
    for (size_t l = 0; l < layers.size(); ++l) {
      std::vector<float> rec(slots.size() * H * K * K), conv(slots.size() * (W - 1) * C);
      pools->recurrent_state_pool.read_linear_recurrent_layer_cache(static_cast<int>(l), slots, rec.data(),
                                                                    conv.data());
      out.insert(out.end(), rec.begin(), rec.end());
      out.insert(out.end(), conv.begin(), conv.end());
    }
    return out;
  }
  std::vector<int32_t> fork(const std::vector<int32_t>& reqs) {
    std::vector<int32_t> out;
    for (const int32_t r : reqs) out.push_back(pools->req_to_token_pool.fork(r));
    return out;
  }
};

// A KDA backend whose dispatch_recurrent call number `fail_at` (counted from 0 over its life) throws.
class FailingBackend : public KDAAttnBackend {
 public:
  int64_t calls = 0, fail_at = -1;

 protected:
  void dispatch_recurrent(const layers::attention::linear::LinearRecurrentDispatch& d) override {
    if (calls++ == fail_at) throw std::runtime_error("injected failure");
    KDAAttnBackend::dispatch_recurrent(d);
  }
};

// Two backends verifying disjoint slots of one pool, interleaved (A verifies, B verifies, A accepts, B
// accepts): outputs and states equal each backend's verify and accept run alone, bit for bit.
TEST(Verify, TwoBackendsOnOnePoolEqualEachAlone) {
  for (const Precision prec : {Precision::FP32, Precision::BF16}) {
    SCOPED_TRACE(to_string(prec));
    TinyLayers s(2, 12, prec, 4);
    KDAAttnBackend a, b;
    const auto reqs = s.pools->req_to_token_pool.alloc(4);
    s.run(ForwardBatch::extend(reqs, {3, 5, 2, 4}, {0, 0, 0, 0}), TinyLayers::rows(14, 501), a);
    const std::vector<int32_t> ra = {reqs[0], reqs[1]}, rb = {reqs[2], reqs[3]};
    const std::vector<int32_t> alone_a = s.fork(ra), alone_b = s.fork(rb);
    const auto xa = TinyLayers::rows(7, 502), xb = TinyLayers::rows(6, 503);
    const std::vector<int32_t> acc_a = {3, 1}, acc_b = {2, 0};
    // Alone.
    auto fa = ForwardBatch::target_verify(alone_a, {3, 2});
    const auto ya = s.run(fa, xa, a);
    a.accept(fa, acc_a, s.pools->recurrent_state_pool);
    auto fb = ForwardBatch::target_verify(alone_b, {2, 2}, {-1, -1, -1, 0});
    const auto yb = s.run(fb, xb, b);
    b.accept(fb, acc_b, s.pools->recurrent_state_pool);
    // Interleaved.
    fa = ForwardBatch::target_verify(ra, {3, 2});
    fb = ForwardBatch::target_verify(rb, {2, 2}, {-1, -1, -1, 0});
    EXPECT_EQ(s.run(fa, xa, a), ya);
    EXPECT_EQ(s.run(fb, xb, b), yb);
    a.accept(fa, acc_a, s.pools->recurrent_state_pool);
    b.accept(fb, acc_b, s.pools->recurrent_state_pool);
    EXPECT_EQ(s.states(ra), s.states(alone_a)) << "backend A";
    EXPECT_EQ(s.states(rb), s.states(alone_b)) << "backend B";
  }
}

// accept after the verified slots may have moved is an error that changes nothing: a later batch on the
// same backend (on the same slots or others) ends the pending verify; a batch of another backend on a
// verified slot, or a pool operation writing one, moves its generation. A batch of another backend on
// other slots does neither.
TEST(Verify, LateAcceptIsAnErrorThatChangesNothing) {
  TinyLayers s(2, 8, Precision::FP32, 4);
  KDAAttnBackend be, other;
  const auto reqs = s.pools->req_to_token_pool.alloc(3);
  s.run(ForwardBatch::extend(reqs, {3, 4, 2}, {0, 0, 0}), TinyLayers::rows(9, 511), be);
  const std::vector<int32_t> base = {reqs[0], reqs[1]}, bystander = {reqs[2]};
  struct Case {
    std::string name, error;
    std::function<void(const std::vector<int32_t>&)> between;  // given the verified requests
  };
  const std::vector<Case> cases = {
      {"same backend, same slots", "ended by a later DECODE batch on this backend",
       [&](const std::vector<int32_t>& r) { s.run(ForwardBatch::decode(r), TinyLayers::rows(2, 512), be); }},
      {"same backend, other slots", "ended by a later EXTEND batch on this backend",
       [&](const std::vector<int32_t>&) {
         s.run(ForwardBatch::extend(bystander, {2}, {3}), TinyLayers::rows(2, 513), be);
       }},
      {"another backend, a verified slot", "was written after the TARGET_VERIFY batch",
       [&](const std::vector<int32_t>& r) {
         s.run(ForwardBatch::decode({r[1]}), TinyLayers::rows(1, 514), other);
       }},
      {"copy_slot into a verified slot", "was written after the TARGET_VERIFY batch",
       [&](const std::vector<int32_t>& r) {
         s.pools->recurrent_state_pool.copy_slot(s.pools->req_to_token_pool.slot_of(bystander[0]),
                                                 s.pools->req_to_token_pool.slot_of(r[0]));
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const auto r = s.fork(base);
    const auto fb = ForwardBatch::target_verify(r, {2, 3});
    s.run(fb, TinyLayers::rows(7, 515), be);
    c.between(r);
    const auto before = s.states(r);
    try {
      be.accept(fb, std::vector<int32_t>{1, 2}, s.pools->recurrent_state_pool);
      ADD_FAILURE() << "late accept accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(c.error));
    }
    EXPECT_EQ(s.states(r), before);
    s.pools->req_to_token_pool.free(r);
  }
  // Another backend's batch on other slots leaves the verify acceptable.
  const auto r = s.fork(base);
  const auto fb = ForwardBatch::target_verify(r, {2, 3});
  s.run(fb, TinyLayers::rows(7, 516), be);
  const auto before = s.states(r);
  s.run(ForwardBatch::decode(bystander), TinyLayers::rows(1, 517), other);
  be.accept(fb, std::vector<int32_t>{1, 2}, s.pools->recurrent_state_pool);
  EXPECT_NE(s.states(r), before);
}

// accept computes every layer before it writes any: a failure in the middle layer of three leaves every
// slot's states (recurrent and conv, every layer) as they were and the verify pending; accepted again,
// the slots equal a backend's that never failed.
TEST(Verify, AcceptFailingInALayerChangesNoSlot) {
  for (const Precision prec : {Precision::FP32, Precision::BF16}) {
    SCOPED_TRACE(to_string(prec));
    TinyLayers s(3, 8, prec, 4);
    FailingBackend be;
    KDAAttnBackend clean;
    const auto reqs = s.pools->req_to_token_pool.alloc(2);
    s.run(ForwardBatch::extend(reqs, {5, 3}, {0, 0}), TinyLayers::rows(8, 521), be);
    const auto ref = s.fork(reqs);
    const auto x = TinyLayers::rows(7, 522);
    const std::vector<int32_t> acc = {2, 1};
    const auto fr = ForwardBatch::target_verify(ref, {3, 2});
    s.run(fr, x, clean);
    clean.accept(fr, acc, s.pools->recurrent_state_pool);

    const auto fb = ForwardBatch::target_verify(reqs, {3, 2});
    s.run(fb, x, be);
    const auto before = s.states(reqs);
    be.fail_at = be.calls + 1;  // the replay of the second layer
    EXPECT_THROW(be.accept(fb, acc, s.pools->recurrent_state_pool), std::runtime_error);
    EXPECT_EQ(s.states(reqs), before);
    EXPECT_TRUE(be.has_pending_verify());
    be.accept(fb, acc, s.pools->recurrent_state_pool);
    EXPECT_EQ(s.states(reqs), s.states(ref));
  }
}

// A verify batch that failed in a layer, or did not run every KDA layer of the pool, cannot be accepted
// (the layers after would stay behind): a clear error that changes nothing.
TEST(Verify, FailedOrPartialVerifyCannotBeAccepted) {
  TinyLayers s(2, 8, Precision::FP32, 4);
  FailingBackend be;
  const auto reqs = s.pools->req_to_token_pool.alloc(2);
  s.run(ForwardBatch::extend(reqs, {5, 3}, {0, 0}), TinyLayers::rows(8, 531), be);
  const auto before = s.states(reqs);
  const auto expect_refused = [&](const ForwardBatch& fb, const std::string& what) {
    try {
      be.accept(fb, std::vector<int32_t>{1, 1}, s.pools->recurrent_state_pool);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
    EXPECT_EQ(s.states(reqs), before);
  };
  const auto fb = ForwardBatch::target_verify(reqs, {3, 2});
  be.fail_at = be.calls + 1;  // the verify's second layer
  EXPECT_THROW(s.run(fb, TinyLayers::rows(7, 532), be), std::runtime_error);
  expect_refused(fb, "a layer of the verify batch failed");
  s.run(fb, TinyLayers::rows(7, 533), be, 1);
  expect_refused(fb, "ran 1 of the state pool's 2 KDA layers");
}

TEST(Layer, BadCaseInputsAreClearErrors) {
  const auto cfg = io::load_config(testing::dumps_dir());
  io::NpzArchive npz;
  std::vector<float> hs(10 * 256, 0.5f);
  npz["hidden_states"] = io::NpyArray::from_f32({10, 256}, hs.data());
  const int32_t bad_cu[4] = {0, 6, 4, 10};
  npz["cu_seqlens"] = io::NpyArray::from_i32({4}, bad_cu);
  try {
    runtime::LayerCase::from_npz(npz, cfg);
    ADD_FAILURE() << "non-monotonic cu_seqlens accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("not monotonic"));
  }
  const int32_t short_cu[3] = {0, 4, 9};
  npz["cu_seqlens"] = io::NpyArray::from_i32({3}, short_cu);
  EXPECT_THROW(runtime::LayerCase::from_npz(npz, cfg), std::invalid_argument);
  npz.erase("cu_seqlens");
  std::vector<float> wide(10 * 300, 0.5f);
  npz["hidden_states"] = io::NpyArray::from_f32({10, 300}, wide.data());
  try {
    runtime::LayerCase::from_npz(npz, cfg);
    ADD_FAILURE() << "wrong hidden size accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("hidden_size is 256"));
  }
  npz["hidden_states"] = io::NpyArray::from_f32({10, 256}, hs.data());
  std::vector<float> st(2 * 4 * 128 * 128);
  npz["initial_recurrent_state"] = io::NpyArray::from_f32({2, 4, 128, 128}, st.data());
  EXPECT_THROW(runtime::LayerCase::from_npz(npz, cfg), std::invalid_argument);  // 2 states, 1 sequence
}

// A copy of the mini checkpoint with one change, for the bad-checkpoint tests.
// The mini checkpoint's tensors, as F32.
std::map<std::string, io::StTensor> mini_tensors() {
  const io::Checkpoint ckpt(testing::dumps_dir());
  std::map<std::string, io::StTensor> t;
  const io::SafetensorsFile f(testing::dumps_dir() / "model.safetensors");
  for (const auto& name : f.names()) {
    const auto& v = ckpt.get(name);
    t[name] = {v.shape, ckpt.load_f32(name, v.shape)};
  }
  return t;
}

fs::path mini_checkpoint_with(const std::string& tag,
                              const std::function<void(std::map<std::string, io::StTensor>&)>& edit,
                              const std::string& config_text = "") {
  const auto dir = testing::make_temp_dir(tag);
  auto t = mini_tensors();
  edit(t);
  io::write_safetensors(dir / "model.safetensors", t);
  if (config_text.empty()) {
    fs::copy_file(testing::dumps_dir() / "config.json", dir / "config.json");
  } else {
    std::ofstream(dir / "config.json") << config_text;
  }
  return dir;
}

std::string load_error(const fs::path& dir, int layer) {
  try {
    const auto cfg = io::load_config(dir);
    const io::Checkpoint ckpt(dir);
    models::KimiDeltaAttention::from_checkpoint(ckpt, cfg, layer, Precision::FP32);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(Layer, BadCheckpointsAreClearErrors) {
  const std::string pre = "model.layers.0.self_attn.";
  auto missing = mini_checkpoint_with("missing", [&](auto& t) { t.erase(pre + "g_b_proj.weight"); });
  EXPECT_THAT(load_error(missing, 0), HasSubstr("missing tensor 'model.layers.0.self_attn.g_b_proj.weight'"));
  auto shape = mini_checkpoint_with("shape", [&](auto& t) { t[pre + "o_proj.weight"].shape = {512, 256}; });
  EXPECT_THAT(load_error(shape, 0), HasSubstr("o_proj.weight"));
  EXPECT_THAT(load_error(shape, 0), HasSubstr("[256, 512]"));
  auto same = mini_checkpoint_with("same", [](auto&) {});
  EXPECT_EQ(load_error(same, 0), "");
  EXPECT_THAT(load_error(same, 1), HasSubstr("outside"));
  // A two-layer model whose layer 1 is full attention: asking for it as KDA is an error.
  auto cfg = io::load_config(testing::dumps_dir());
  const std::string two =
      R"({"model_type":"kimi_linear","hidden_size":256,"num_hidden_layers":2,"rms_norm_eps":1e-5,)"
      R"("linear_attn_config":{"num_heads":4,)"
      R"("head_dim":128,"short_conv_kernel_size":4,"kda_layers":[1],"full_attn_layers":[2]}})";
  auto mla = mini_checkpoint_with(
      "mla", [](auto&) {}, two);
  EXPECT_THAT(load_error(mla, 1), HasSubstr("not a KDA layer"));
  // A config whose hidden size disagrees with the tensors.
  const std::string wide =
      R"({"model_type":"kimi_linear","hidden_size":384,"num_hidden_layers":1,"rms_norm_eps":1e-5,)"
      R"("linear_attn_config":{"num_heads":4,)"
      R"("head_dim":128,"short_conv_kernel_size":4,"kda_layers":[1]}})";
  auto w = mini_checkpoint_with(
      "wide", [](auto&) {}, wide);
  EXPECT_THAT(load_error(w, 0), HasSubstr("q_proj.weight"));
}

// The likely layout of the released checkpoint: BF16 weights beside F32 A_log and dt_bias. Both modes
// use A_log and dt_bias as stored: fp32 matches a float64 reference of exactly the loaded values, and
// bf16 matches the dumps' out_bf16, which was computed from the bf16-rounded weights with A_log and
// dt_bias unrounded -- the values this checkpoint holds -- and equals bf16 on the F32 checkpoint bit for bit.
TEST(Layer, Bf16CheckpointKeepsF32GateParameters) {
  const std::string pre = "model.layers.0.self_attn.";
  const auto dir = mini_checkpoint_with("bf16_ckpt", [&](auto& t) {
    for (auto& [name, tensor] : t)
      if (name != pre + "A_log" && name != pre + "dt_bias") tensor.dtype = io::StDType::BF16;
  });
  const auto cfg = io::load_config(dir);
  const io::Checkpoint ckpt(dir), f32_ckpt(testing::dumps_dir());
  ASSERT_EQ(ckpt.get(pre + "q_proj.weight").dtype, io::StDType::BF16);
  ASSERT_EQ(ckpt.get(pre + "A_log").dtype, io::StDType::F32);
  const auto w = models::KdaLayerWeights::load(ckpt, cfg, 0, 0, 1);
  // The stored gate parameters are off the bf16 grid, so rounding them would change the result.
  int off_grid = 0;
  for (float v : w.dt_bias) off_grid += round_bf16(v) != v;
  ASSERT_GT(off_grid, static_cast<int>(w.dt_bias.size()) / 2);
  for (const char* name : {"varlen_initstate", "T65", "unbalanced_5_17_1_41"}) {
    SCOPED_TRACE(name);
    const auto npz = io::read_npz(testing::dumps_dir() / (std::string(name) + ".npz"));
    const auto c = runtime::LayerCase::from_npz(npz, cfg);
    const auto ref = testing::reference_layer(cfg, w, c.hidden_states, c.cu_seqlens,
                                              c.initial_recurrent_state, c.initial_conv_state);
    const std::vector<float> ref_out(ref.out.begin(), ref.out.end()),
        ref_state(ref.recurrent_state.begin(), ref.recurrent_state.end()),
        ref_conv(ref.conv_state.begin(), ref.conv_state.end());
    const auto fp32 = models::KimiDeltaAttention::from_checkpoint(ckpt, cfg, 0, Precision::FP32);
    const auto r32 = runtime::run_layer_case(*fp32, cfg, c, 0, kernels::KernelImpl::Auto);
    EXPECT_LE(testing::max_error_ratio(r32.out.data(), ref_out.data(), ref_out.size(), kTol, kTol), 1.0);
    EXPECT_LE(
        testing::max_error_ratio(r32.recurrent_state.data(), ref_state.data(), ref_state.size(), kTol, kTol),
        1.0);
    EXPECT_LE(testing::max_error_ratio(r32.conv_state.data(), ref_conv.data(), ref_conv.size(), kTol, kTol),
              1.0);
    const auto bf16 = models::KimiDeltaAttention::from_checkpoint(ckpt, cfg, 0, Precision::BF16);
    const auto r16 = runtime::run_layer_case(*bf16, cfg, c, 0, kernels::KernelImpl::Auto);
    const auto out_bf16 = npz.at("out_bf16").to_f32();
    EXPECT_LE(testing::rel_l2(r16.out.data(), out_bf16.data(), out_bf16.size()), 5e-3);
    const auto bf16_of_f32 = models::KimiDeltaAttention::from_checkpoint(f32_ckpt, cfg, 0, Precision::BF16);
    EXPECT_EQ(runtime::run_layer_case(*bf16_of_f32, cfg, c, 0, kernels::KernelImpl::Auto).out, r16.out);
  }
}

// The released checkpoint's layout: shards listed by model.safetensors.index.json, BF16 weights beside
// F32 A_log and dt_bias, the layer's tensors spread over both shards. The layer loaded from it (whole,
// and each TP 2 rank's slices) is the layer of one file holding the same tensors: the same weights, the
// same outputs and states bit for bit in both precisions; fp32 matches the float64 reference of the
// loaded weights.
TEST(Layer, ShardedBf16CheckpointRunsAsOneFile) {
  const std::string pre = "model.layers.0.self_attn.";
  auto t = mini_tensors();
  for (auto& [name, tensor] : t)
    if (name != pre + "A_log" && name != pre + "dt_bias") tensor.dtype = io::StDType::BF16;
  const auto one = testing::make_temp_dir("ckpt_one_file"), sharded = testing::make_temp_dir("ckpt_sharded");
  io::write_safetensors(one / "model.safetensors", t);
  std::map<std::string, io::StTensor> shard[2];
  nlohmann::json index = {{"metadata", nlohmann::json::object()}, {"weight_map", nlohmann::json::object()}};
  const std::string files[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
  int i = 0;
  for (const auto& [name, tensor] : t) {
    shard[i % 2][name] = tensor;
    index["weight_map"][name] = files[i % 2];
    ++i;
  }
  ASSERT_GE(shard[0].size(), 4u);
  ASSERT_GE(shard[1].size(), 4u);
  for (int s = 0; s < 2; ++s) io::write_safetensors(sharded / files[s], shard[s]);
  std::ofstream(sharded / "model.safetensors.index.json") << index.dump(2);
  for (const auto& d : {one, sharded}) fs::copy_file(testing::dumps_dir() / "config.json", d / "config.json");

  const auto cfg = io::load_config(sharded);
  const io::Checkpoint a(sharded), b(one);
  ASSERT_EQ(a.get(pre + "q_proj.weight").dtype, io::StDType::BF16);
  ASSERT_EQ(a.get(pre + "A_log").dtype, io::StDType::F32);
  const auto w = models::KdaLayerWeights::load(a, cfg, 0);
  EXPECT_EQ(w.q_proj, models::KdaLayerWeights::load(b, cfg, 0).q_proj);
  for (int r = 0; r < 2; ++r) {
    const auto wa = models::KdaLayerWeights::load(a, cfg, 0, r, 2),
               wb = models::KdaLayerWeights::load(b, cfg, 0, r, 2);
    EXPECT_EQ(wa.q_proj, wb.q_proj);
    EXPECT_EQ(wa.o_proj, wb.o_proj);
    EXPECT_EQ(wa.A_log, wb.A_log);
    EXPECT_EQ(wa.v_conv1d, wb.v_conv1d);
  }
  for (const char* name : {"varlen_initstate", "unbalanced_5_17_1_41"}) {
    SCOPED_TRACE(name);
    const auto c =
        runtime::LayerCase::from_npz(io::read_npz(testing::dumps_dir() / (std::string(name) + ".npz")), cfg);
    for (const Precision p : {Precision::FP32, Precision::BF16}) {
      SCOPED_TRACE(to_string(p));
      const auto la = models::KimiDeltaAttention::from_checkpoint(a, cfg, 0, p);
      const auto lb = models::KimiDeltaAttention::from_checkpoint(b, cfg, 0, p);
      const auto ra = runtime::run_layer_case(*la, cfg, c, 4, kernels::KernelImpl::Auto);
      const auto rb = runtime::run_layer_case(*lb, cfg, c, 4, kernels::KernelImpl::Auto);
      EXPECT_EQ(ra.out, rb.out);
      EXPECT_EQ(ra.recurrent_state, rb.recurrent_state);
      EXPECT_EQ(ra.conv_state, rb.conv_state);
      if (p != Precision::FP32) continue;
      const auto ref = testing::reference_layer(cfg, w, c.hidden_states, c.cu_seqlens,
                                                c.initial_recurrent_state, c.initial_conv_state);
      const std::vector<float> ref_out(ref.out.begin(), ref.out.end()),
          ref_state(ref.recurrent_state.begin(), ref.recurrent_state.end());
      expect_close(ra.out, ref_out, "out vs the float64 reference");
      expect_close(ra.recurrent_state, ref_state, "recurrent state vs the float64 reference");
    }
  }
}

TEST(ServerArgs, RecurrentModelAllowsRadixCacheAndSpeculation) {
  ServerArgs a;
  a.enable_mixed_chunk = true;
  a.check_server_args(true);
  EXPECT_FALSE(a.disable_radix_cache);  // the prefix cache of state snapshots
  EXPECT_TRUE(a.enable_mixed_chunk);
  ServerArgs plain;
  plain.check_server_args(false);
  EXPECT_FALSE(plain.disable_radix_cache);
  ServerArgs spec;
  spec.speculative_algorithm = "NGRAM";
  EXPECT_NO_THROW(spec.check_server_args(true));  // TARGET_VERIFY + accept
  EXPECT_FALSE(spec.disable_radix_cache);
  ServerArgs eagle;
  eagle.speculative_algorithm = "EAGLE";  // a draft model: DRAFT_EXTEND
  try {
    eagle.check_server_args(true);
    ADD_FAILURE() << "EAGLE accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("EAGLE"));
    EXPECT_THAT(e.what(), HasSubstr("not supported"));
  }
}

// The real Kimi-Linear shape (hidden 2304, 32 heads x 128) with synthetic weights: EXTEND vs
// prefill -> decode, and the reference vs the optimized kernels, through the full stack.
TEST(Layer, FullKimiShapeInvarianceAndKernelsAgree) {
  const io::KimiLinearConfig cfg = io::kimi_linear_48b_one_layer_config();
  const auto w = models::KdaLayerWeights::synthetic(cfg, 42);
  runtime::LayerCase c;
  c.D = cfg.hidden_size;
  c.cu_seqlens = {0, 70, 71, 100};
  c.N = 3;
  c.T = 100;
  c.hidden_states = testing::random_normal(c.T * c.D, 9);
  Stack opt(cfg, w, 4, kernels::KernelImpl::Auto), naive(cfg, w, 4, kernels::KernelImpl::Naive);
  const auto full = runtime::run_layer_case(*opt.layer, cfg, c, 0, kernels::KernelImpl::Auto);
  const auto tail = runtime::run_layer_case(*opt.layer, cfg, c, 8, kernels::KernelImpl::Auto);
  const auto ref = runtime::run_layer_case(*naive.layer, cfg, c, 0, kernels::KernelImpl::Naive);
  double mag = 0;
  for (float v : full.out) mag = std::max(mag, static_cast<double>(std::fabs(v)));
  EXPECT_GT(mag, 1e-3);  // the synthetic layer does produce a signal
  expect_close(tail.out, full.out, "invariance out");
  expect_close(tail.recurrent_state, full.recurrent_state, "invariance recurrent state");
  expect_close(tail.conv_state, full.conv_state, "invariance conv state");
  expect_close(full.out, ref.out, "optimized vs naive out");
  expect_close(full.recurrent_state, ref.recurrent_state, "optimized vs naive state");
}

}  // namespace
}  // namespace kda
