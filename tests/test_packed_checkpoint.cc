// Packed checkpoints (kda quantize, io/packed_checkpoint.h): a quantized checkpoint loads by mmap in
// place with outputs equal bit for bit to converting the source at load; its projections, experts and
// MLPs borrow the mapping; malformed, truncated or mismatched packed checkpoints and bad CLI arguments are
// refused naming what is wrong; the raw writer's layout; the bf16 embedding table read in place; the packed
// tensors' pages present after load.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kda/io/config.h"
#include "kda/io/file.h"
#include "kda/io/packed_checkpoint.h"
#include "kda/io/safetensors.h"
#include "kda/kernels/gemm/weight_format.h"
#include "kda/layers/moe/swiglu.h"
#include "kda/models/kimi_linear_case.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/models/quantize_checkpoint.h"
#include "support/model_checkpoint.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace fs = std::filesystem;
using models::KimiLinearForCausalLM;
using models::ModelCaseOptions;
using models::ModelOptions;
using ::testing::HasSubstr;

ModelOptions opts(Precision p, Weights w) {
  ModelOptions o;
  o.precision = p;
  o.weights = w;
  return o;
}

const std::vector<int32_t> kIds = {1, 5, 299, 7, 0, 42, 8, 9, 10, 11, 300, 2, 77};
const std::vector<int32_t> kCu = {0, 6, 13};

// One packed checkpoint per scheme of the tiny model (every layer kind: KDA, MLA, dense MLP, MoE with a
// shared expert), written once for the tests that read it.
const fs::path& packed_tiny(Weights w) {
  static std::map<Weights, fs::path> dirs;
  auto it = dirs.find(w);
  if (it == dirs.end()) {
    const fs::path out = testing::make_temp_dir(std::string("packed_") + to_string(w)) / "out";
    models::quantize_checkpoint(testing::model_dumps_dir(), out, w);
    it = dirs.emplace(w, out).first;
  }
  return it->second;
}

// Every projection of the model, by where it is.
std::vector<std::pair<std::string, const layers::Linear*>> projections(KimiLinearForCausalLM& m) {
  std::vector<std::pair<std::string, const layers::Linear*>> out;
  for (int i = 0; i < m.num_layers(); ++i) {
    auto& l = m.model().layer(i);
    const std::string at = "layer " + std::to_string(i) + " ";
    if (l.kda())
      for (const auto& [n, p] : l.kda()->projections()) out.push_back({at + n, p});
    if (l.mla())
      for (const auto& [n, p] : l.mla()->projections()) out.push_back({at + n, p});
    if (l.mlp()) {
      out.push_back({at + "mlp.gate_up", &l.mlp()->mlp().gate_up()});
      out.push_back({at + "mlp.down", &l.mlp()->mlp().down()});
    }
    if (l.moe()) {
      for (int e = 0; e < l.moe()->num_experts(); ++e)
        for (int p = 0; p < l.moe()->expert(e).pieces(); ++p) {
          const std::string x = at + "expert " + std::to_string(e) + " piece " + std::to_string(p);
          out.push_back({x, &l.moe()->expert(e).piece(p).gate_up()});
          out.push_back({x + " down", &l.moe()->expert(e).piece(p).down()});
        }
      out.push_back({at + "shared", &l.moe()->shared_expert()->piece(0).gate_up()});
    }
  }
  return out;
}

TEST(PackedCheckpoint, MappedLoadEqualsConvertingLoadBitForBit) {
  for (Weights w : {Weights::Int8, Weights::Int4})
    for (Precision p : {Precision::FP32, Precision::BF16}) {
      SCOPED_TRACE(std::string(to_string(w)) + " " + to_string(p));
      auto converted = KimiLinearForCausalLM::from_pretrained(testing::model_dumps_dir(), opts(p, w));
      auto mapped = KimiLinearForCausalLM::from_pretrained(packed_tiny(w), opts(p, w));
      const auto a = models::run_model_case(*converted, kIds, kCu, ModelCaseOptions{3, 1, true});
      const auto b = models::run_model_case(*mapped, kIds, kCu, ModelCaseOptions{3, 1, true});
      EXPECT_EQ(a.logits, b.logits);
      EXPECT_EQ(a.hidden_final, b.hidden_final);
      EXPECT_EQ(a.kda_recurrent_state, b.kda_recurrent_state);
      EXPECT_EQ(a.mla_ckv, b.mla_ckv);
      EXPECT_EQ(converted->weight_bytes(), mapped->weight_bytes());
      // The mapped model's projections borrow the file's bytes; the converted one's own theirs.
      const auto pc = projections(*converted), pm = projections(*mapped);
      ASSERT_EQ(pc.size(), pm.size());
      for (size_t i = 0; i < pm.size(); ++i) {
        ASSERT_NE(pm[i].second->packed(), nullptr) << pm[i].first;
        EXPECT_TRUE(pm[i].second->packed()->borrowed()) << pm[i].first;
        EXPECT_FALSE(pc[i].second->packed()->borrowed()) << pc[i].first;
        EXPECT_EQ(pm[i].second->weights(), w) << pm[i].first;
      }
    }
}

TEST(PackedCheckpoint, TheFolderSaysItsSchemeAndKeepsTheOtherTensorsAsTheyWere) {
  const fs::path& out = packed_tiny(Weights::Int4);
  const auto config = nlohmann::json::parse(testing::read_file(out / "config.json"));
  EXPECT_EQ(config["quantization_config"]["quant_method"], "kda");
  EXPECT_EQ(config["quantization_config"]["kda_format"], io::kPackedFormat);
  EXPECT_EQ(config["quantization_config"]["weights"], "int4");
  EXPECT_EQ(config["quantization_config"]["group_size"], 32);
  EXPECT_EQ(config["hidden_size"], 256);  // the source's fields kept
  const io::Checkpoint ckpt(out), src(testing::model_dumps_dir());
  EXPECT_EQ(io::packed_weights(ckpt), Weights::Int4);
  EXPECT_EQ(io::packed_weights(src), std::nullopt);
  // A projection: U8 [out, in / 2] + F32 [out, in / 32]; the KDA projections fused as the layer fuses them.
  const auto& q = ckpt.get("model.layers.0.self_attn.qkv_fa_ga_b_proj.qweight");
  EXPECT_EQ(q.dtype, io::StDType::U8);
  const int64_t fused = 3 * 256 + 2 * 128 + 2;  // q|k|v (P = 2 x 128), f_a|g_a (K = 128), b (H = 2)
  EXPECT_EQ(q.shape, (std::vector<int64_t>{fused, 128}));
  EXPECT_EQ(ckpt.get("model.layers.0.self_attn.qkv_fa_ga_b_proj.scales").shape,
            (std::vector<int64_t>{fused, 8}));
  EXPECT_FALSE(ckpt.contains("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_FALSE(ckpt.contains("model.layers.1.block_sparse_moe.experts.0.w1.weight"));
  // Experts in the MoE's slices (MoeOptions::pieces, 1 by default: one slice, the whole expert).
  EXPECT_TRUE(ckpt.contains("model.layers.1.block_sparse_moe.experts.7.pieces.0.gate_up_proj.qweight"));
  EXPECT_TRUE(ckpt.contains("model.layers.1.block_sparse_moe.experts.7.pieces.0.down_proj.scales"));
  EXPECT_FALSE(ckpt.contains("model.layers.1.block_sparse_moe.experts.7.pieces.1.gate_up_proj.qweight"));
  // Everything else byte for byte.
  for (const char* key :
       {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.A_log",
        "model.layers.1.block_sparse_moe.gate.weight", "model.layers.3.self_attn.kv_a_layernorm.weight"}) {
    const auto &a = ckpt.get(key), &b = src.get(key);
    EXPECT_EQ(a.dtype, b.dtype) << key;
    EXPECT_EQ(a.shape, b.shape) << key;
    ASSERT_EQ(a.nbytes, b.nbytes) << key;
    EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes), 0) << key;
  }
  // The packed bytes are those a converting load packs.
  const auto w = src.load_f32("model.layers.0.self_attn.o_proj.weight", {256, 256});
  const kernels::gemm::PackedMatrix want(Weights::Int4, w.data(), 256, 256);
  const auto got = io::load_packed(ckpt, "model.layers.0.self_attn.o_proj", Weights::Int4, 256, 256);
  EXPECT_TRUE(got->borrowed());
  EXPECT_EQ(std::memcmp(got->view().data, want.view().data, static_cast<size_t>(want.data_bytes())), 0);
  EXPECT_EQ(std::memcmp(got->view().scale, want.view().scale, sizeof(float) * want.scale_count()), 0);
}

// How many of the pages of [p, p + n) this process's page tables map (/proc/self/pagemap's present bit).
int64_t present_pages(const void* p, size_t n) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) / page,
                  last = (reinterpret_cast<uintptr_t>(p) + n - 1) / page;
  const int fd = ::open("/proc/self/pagemap", O_RDONLY);
  if (fd < 0) return -1;
  int64_t present = 0;
  for (uintptr_t v = first; v <= last; ++v) {
    uint64_t e = 0;
    if (::pread(fd, &e, sizeof e, static_cast<off_t>(v * sizeof e)) == static_cast<ssize_t>(sizeof e) &&
        (e >> 63) != 0)
      ++present;
  }
  ::close(fd);
  return present;
}

// The packed tensors' pages are mapped at load (MADV_POPULATE_READ), not faulted in one by one by the first
// prefill: every page of the tensor is present before anything reads it. (A tensor near the end of its
// shard: the header's reads fault in only the pages around the header.)
TEST(PackedCheckpoint, TheTensorsPagesArePresentAfterLoad) {
  io::Checkpoint ckpt(packed_tiny(Weights::Int8));
  const auto m = io::load_packed(ckpt, "model.layers.3.block_sparse_moe.experts.7.pieces.0.down_proj",
                                 Weights::Int8, 64, 256);
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  const auto* d = static_cast<const char*>(m->view().data);
  const auto n = static_cast<size_t>(m->data_bytes());
  const int64_t pages = static_cast<int64_t>((reinterpret_cast<uintptr_t>(d) + n - 1) / page -
                                             reinterpret_cast<uintptr_t>(d) / page + 1);
  EXPECT_EQ(present_pages(d, n), pages);
}

TEST(PackedCheckpoint, TheMappingOutlivesTheCheckpointObject) {
  std::shared_ptr<const kernels::gemm::PackedMatrix> m;
  {
    io::Checkpoint ckpt(packed_tiny(Weights::Int8));
    m = io::load_packed(ckpt, "model.layers.0.mlp.down_proj", Weights::Int8, 256, 256);
    ckpt.release_shard(ckpt.shard_of("model.layers.0.mlp.down_proj.qweight"));
  }
  const auto w = kernels::gemm::dequantize(m->view());  // reads the mapping after both went away
  EXPECT_EQ(w.size(), 256u * 256u);
}

// --- refused -----------------------------------------------------------------------------------------

// A copy of the int4 packed tiny model to break.
fs::path copy_of_packed(const std::string& tag) {
  const fs::path dir = testing::make_temp_dir(tag) / "ckpt";
  fs::copy(packed_tiny(Weights::Int4), dir, fs::copy_options::recursive);
  return dir;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Rewrites the shard holding `key` with edit() applied to its tensor list (same metadata unless changed).
void rewrite_shard(
    const fs::path& dir, const std::string& key,
    const std::function<void(std::vector<io::StRawTensor>&, std::map<std::string, std::string>&)>& edit) {
  const io::Checkpoint ckpt(dir);
  const fs::path shard = dir / ckpt.shard_of(key);
  std::vector<uint8_t> image;
  std::vector<io::StRawTensor> tensors;
  std::map<std::string, std::string> meta;
  {
    const io::SafetensorsFile f(shard);
    meta = f.metadata();
    // Bytes copied out first: the file is rewritten in place.
    size_t total = 0;
    for (const auto& n : f.names()) total += f.find(n)->nbytes;
    image.resize(total);
    size_t at = 0;
    for (const auto& n : f.names()) {
      const io::TensorView* v = f.find(n);
      std::memcpy(image.data() + at, v->data, v->nbytes);
      tensors.push_back({n, v->dtype, v->shape, image.data() + at, v->nbytes});
      at += v->nbytes;
    }
  }
  edit(tensors, meta);
  io::write_safetensors_raw(shard, tensors, meta);
}

TEST(PackedCheckpoint, ASchemeOtherThanTheOneAskedForIsRefused) {
  const fs::path& dir = packed_tiny(Weights::Int4);
  for (Weights w : {Weights::Int8, Weights::BF16}) {
    const std::string e =
        error_of([&] { KimiLinearForCausalLM::from_pretrained(dir, opts(Precision::FP32, w)); });
    EXPECT_THAT(e, HasSubstr("packed int4 checkpoint"));
    EXPECT_THAT(e, HasSubstr("--weights int4"));
  }
  const io::Checkpoint ckpt(dir);
  testing::expect_throw_with<std::invalid_argument>([&] { io::packed_for_load(ckpt, Weights::Int4, 2); },
                                                    "one rank (--tp 1)");
  EXPECT_FALSE(io::packed_for_load(io::Checkpoint(testing::model_dumps_dir()), Weights::Int4, 2));
  // A packed projection is no float tensor.
  testing::expect_throw_with<std::runtime_error>(
      [&] {
        ckpt.load_f32("model.layers.0.mlp.down_proj.qweight", {256, 128});
      },
      "holds packed U8 bytes");
}

TEST(PackedCheckpoint, ATruncatedShardNamesTheFile) {
  const fs::path dir = copy_of_packed("packed_trunc");
  const io::Checkpoint probe(dir);
  const fs::path shard =
      dir / probe.shard_of("model.layers.1.block_sparse_moe.experts.3.pieces.0.down_proj.qweight");
  fs::resize_file(shard, fs::file_size(shard) - 100);
  const std::string e =
      error_of([&] { KimiLinearForCausalLM::from_pretrained(dir, opts(Precision::FP32, Weights::Int4)); });
  EXPECT_THAT(e, HasSubstr(shard.string()));
  EXPECT_THAT(e, HasSubstr("past the end of the file"));
}

TEST(PackedCheckpoint, AMisShapedOrMissingPackedTensorIsNamed) {
  const std::string key = "model.layers.2.self_attn.f_b_proj.qweight";
  {
    const fs::path dir = copy_of_packed("packed_shape");
    rewrite_shard(dir, key, [&](auto& tensors, auto&) {
      for (auto& t : tensors)
        if (t.name == key) t.shape = {t.shape[1], t.shape[0]};  // the same bytes, transposed shape
    });
    const std::string e =
        error_of([&] { KimiLinearForCausalLM::from_pretrained(dir, opts(Precision::FP32, Weights::Int4)); });
    EXPECT_THAT(e, HasSubstr("packed tensor '" + key + "' is U8 [64, 256]"));
    EXPECT_THAT(e, HasSubstr("needs U8 [256, 64]"));
  }
  {
    const fs::path dir = copy_of_packed("packed_dtype");
    rewrite_shard(dir, key, [&](auto& tensors, auto&) {
      for (auto& t : tensors)
        if (t.name == key) t.dtype = io::StDType::I8;
    });
    EXPECT_THAT(
        error_of([&] { KimiLinearForCausalLM::from_pretrained(dir, opts(Precision::FP32, Weights::Int4)); }),
        HasSubstr("packed tensor '" + key + "' is I8"));
  }
  {
    const fs::path dir = copy_of_packed("packed_missing");
    rewrite_shard(dir, key, [&](auto& tensors, auto&) {
      std::erase_if(tensors, [&](const io::StRawTensor& t) { return t.name == key; });
    });
    EXPECT_THAT(
        error_of([&] { KimiLinearForCausalLM::from_pretrained(dir, opts(Precision::FP32, Weights::Int4)); }),
        HasSubstr("missing tensor '" + key + "'"));
  }
  {
    // A shard whose own metadata disagrees with the checkpoint's.
    const fs::path dir = copy_of_packed("packed_shard_meta");
    rewrite_shard(dir, key, [&](auto&, auto& meta) { meta["weights"] = "int8"; });
    const std::string e =
        error_of([&] { KimiLinearForCausalLM::from_pretrained(dir, opts(Precision::FP32, Weights::Int4)); });
    EXPECT_THAT(e, HasSubstr("shard metadata says int8, the checkpoint int4"));
  }
}

TEST(PackedCheckpoint, AnotherFormatVersionIsRefused) {
  const fs::path dir = copy_of_packed("packed_version");
  auto index = nlohmann::json::parse(testing::read_file(dir / "model.safetensors.index.json"));
  index["metadata"]["kda_format"] = "packed-v0";
  const std::string text = index.dump();
  io::write_file_atomic(dir / "model.safetensors.index.json", text.data(), text.size());
  const std::string e =
      error_of([&] { KimiLinearForCausalLM::from_pretrained(dir, opts(Precision::FP32, Weights::Int4)); });
  EXPECT_THAT(e, HasSubstr("packed checkpoint format 'packed-v0', this build reads 'packed-v1'"));
}

TEST(PackedCheckpoint, QuantizeRefusesBadArgumentsBeforeWriting) {
  const fs::path tmp = testing::make_temp_dir("quantize_args");
  const fs::path src = testing::model_dumps_dir();
  testing::expect_throw_with<std::invalid_argument>(
      [&] { models::quantize_checkpoint(src, tmp / "a", Weights::BF16); }, "--weights must be int8 or int4");
  fs::create_directories(tmp / "busy");
  io::write_file_atomic(tmp / "busy" / "x", "x", 1);
  testing::expect_throw_with<std::invalid_argument>(
      [&] { models::quantize_checkpoint(src, tmp / "busy", Weights::Int4); }, "exists and is not empty");
  testing::expect_throw_with<std::invalid_argument>(
      [&] { models::quantize_checkpoint(packed_tiny(Weights::Int8), tmp / "b", Weights::Int4); },
      "already a packed int8 checkpoint");
  EXPECT_FALSE(fs::exists(tmp / "a"));
  EXPECT_FALSE(fs::exists(tmp / "b" / "model.safetensors.index.json"));
}

testing::CommandResult run_kda(const std::string& args) {
  return testing::run_command(std::string(KDA_BINARY_PATH) + " " + args + " 2>&1");
}

TEST(PackedCheckpoint, Cli) {
  const fs::path tmp = testing::make_temp_dir("quantize_cli");
  const std::string src = testing::model_dumps_dir().string();
  auto r = run_kda("quantize --model " + src + " --weights int4");
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("--out"));
  r = run_kda("quantize --model " + src + " --weights int3 --out " + (tmp / "x").string());
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("int3"));
  fs::create_directories(tmp / "busy");
  io::write_file_atomic(tmp / "busy" / "x", "x", 1);
  r = run_kda("quantize --model " + src + " --weights int8 --out " + (tmp / "busy").string());
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.output, HasSubstr("exists and is not empty"));
  r = run_kda("quantize --model " + src + " --weights int8 --out " + (tmp / "ok").string() + " --check");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("projections packed as int8"));
  EXPECT_THAT(r.output, HasSubstr("logits identical"));
  // The packed folder runs through the other commands as a checkpoint.
  r = run_kda("run --model " + (tmp / "ok").string() + " --tokens " + src + "/T7.npz --output " +
              (tmp / "o.npz").string() + " --weights int8");
  EXPECT_EQ(r.code, 0) << r.output;
  r = run_kda("run --model " + (tmp / "ok").string() + " --tokens " + src + "/T7.npz --output " +
              (tmp / "o.npz").string() + " --weights int4");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.output, HasSubstr("load it with --weights int8"));
}

// --- the raw writer and the bf16 table -------------------------------------------------------------

TEST(PackedCheckpoint, RawWriterAlignsAndRoundTrips) {
  const fs::path path = testing::make_temp_dir("raw_writer") / "r.safetensors";
  std::vector<uint8_t> odd(37, 7), big(128, 3);
  std::vector<float> f(5, 1.5f);
  std::vector<int8_t> q(64, -2);
  io::write_safetensors_raw(path,
                            {{"odd", io::StDType::U8, {37}, odd.data(), odd.size()},
                             {"f", io::StDType::F32, {5}, f.data(), 20},
                             {"big", io::StDType::U8, {2, 64}, big.data(), big.size()},
                             {"q", io::StDType::I8, {8, 8}, q.data(), q.size()}},
                            {{"kda_format", "x"}});
  const io::SafetensorsFile file(path);
  EXPECT_EQ(file.metadata().at("kda_format"), "x");
  for (const char* n : {"big", "q"}) EXPECT_EQ(reinterpret_cast<uintptr_t>(file.find(n)->data) % 64, 0u) << n;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(file.find("f")->data) % 4, 0u);
  EXPECT_EQ(std::vector<uint8_t>(file.find("odd")->data, file.find("odd")->data + 37), odd);
  EXPECT_EQ(file.find("q")->dtype, io::StDType::I8);
  EXPECT_EQ(file.find("big")->shape, (std::vector<int64_t>{2, 64}));
  testing::expect_throw_with<std::runtime_error>(
      [&] {
        io::write_safetensors_raw(path, {{"f", io::StDType::F32, {6}, f.data(), 20}}, {});
      },
      "has 20 bytes for dtype F32 and shape [6]");
}

TEST(PackedCheckpoint, TheBf16EmbeddingTableIsReadInPlace) {
  const auto cfg = io::load_model_config(testing::model_dumps_dir());
  const fs::path dir = testing::make_temp_dir("embed_in_place");
  testing::write_model_checkpoint(dir, cfg, testing::random_model_weights(cfg, 3, io::StDType::BF16), 2);
  auto bf16 = KimiLinearForCausalLM::from_pretrained(dir, opts(Precision::BF16, Weights::BF16));
  EXPECT_TRUE(bf16->model().embed_mapped());
  const io::Checkpoint ckpt(dir);
  const auto want = ckpt.load_bf16("model.embed_tokens.weight", {cfg.vocab_size, cfg.hidden_size});
  EXPECT_EQ(std::memcmp(bf16->model().embed_bf16(), want.data(), want.size() * sizeof(bf16_t)), 0);
  // An fp32-stored table is converted (the tiny dumps are fp32).
  auto from_f32 = KimiLinearForCausalLM::from_pretrained(testing::model_dumps_dir(),
                                                         opts(Precision::BF16, Weights::BF16));
  EXPECT_FALSE(from_f32->model().embed_mapped());
  EXPECT_EQ(bf16->model().weight_bytes() - from_f32->model().weight_bytes(), 0)
      << "the mapped table counts as the copy did";
}

}  // namespace
}  // namespace kda
