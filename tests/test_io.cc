// Tests for kda::io: .npy/.npz, safetensors checkpoints and config.json.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zip.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/io/config.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/io/npy.h"
#include "kda/io/safetensors.h"
#include "support/test_support.h"

namespace kda::io {
namespace {

namespace fs = std::filesystem;

// round_bf16 (32-bit lanes, for simd loops) is the value f32_to_bf16 stores, bit for bit: ties to even,
// carries into the exponent, overflow to inf, infinities, signed zeros, subnormals and NaNs.
TEST(Bf16, RoundEqualsConvertAndBackOnEveryExponent) {
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
  };
  auto check = [&](uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    ASSERT_EQ(bits(round_bf16(f)), bits(bf16_to_f32(f32_to_bf16(f)))) << std::hex << u;
  };
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) {  // every sign, exponent and bf16 mantissa
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) check(hi << 16 | lo);
  }
  uint32_t x = 12345;
  for (int i = 0; i < 1000000; ++i) {  // and random low halves
    x = x * 1664525u + 1013904223u;
    check(x);
  }
  std::vector<float> v = {1.0f + 1.0f / 256, -3.0f, 0.0f, -0.0f, 1e-40f, 65504.0f};
  for (int i = 0; i < 300; ++i) v.push_back(static_cast<float>(i) * 0.7071f - 100.0f);
  std::vector<float> r = v;
  round_bf16_inplace(r.data(), r.size());
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(bits(r[i]), bits(round_bf16(v[i]))) << i;
}
using ::testing::HasSubstr;

// The message of the std::runtime_error `fn` throws; fails the test if it throws nothing.
std::string runtime_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::runtime_error";
  return "";
}

void write_bytes(const fs::path& p, const std::vector<uint8_t>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good());
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good());
}

// A hand-made .npy image with the given header text (padded like numpy's) and payload.
std::vector<uint8_t> make_npy(const std::string& header, const std::vector<uint8_t>& payload, int major = 1) {
  const size_t prefix = major == 1 ? 10 : 12;
  std::string h = header;
  while ((prefix + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  std::vector<uint8_t> out = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<uint8_t>(major), 0};
  for (size_t i = 0; i < prefix - 8; ++i) out.push_back(static_cast<uint8_t>(h.size() >> (8 * i)));
  out.insert(out.end(), h.begin(), h.end());
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// ---------------------------------------------------------------------------------------------------------
// .npy / .npz

TEST(Npz, ReadsVendoredDump) {
  const NpzArchive a = read_npz(kda::testing::dumps_dir() / "varlen_initstate.npz");
  ASSERT_TRUE(a.count("hidden_states"));
  ASSERT_TRUE(a.count("cu_seqlens"));
  const NpyArray& hs = a.at("hidden_states");
  EXPECT_EQ(hs.dtype, NpyDType::F32);
  EXPECT_EQ(hs.shape, (std::vector<int64_t>{64, 256}));
  EXPECT_EQ(hs.to_f32().size(), 64u * 256u);
  const NpyArray& cu = a.at("cu_seqlens");
  EXPECT_EQ(cu.dtype, NpyDType::I32);
  EXPECT_EQ(cu.shape, (std::vector<int64_t>{5}));
  const std::vector<int32_t> cuv = cu.to_i32();
  ASSERT_EQ(cuv.size(), 5u);
  EXPECT_EQ(cuv.front(), 0);
  EXPECT_EQ(cuv.back(), 64);
  EXPECT_TRUE(std::is_sorted(cuv.begin(), cuv.end()));
  EXPECT_THROW(hs.to_i32(), std::invalid_argument);
}

TEST(Npy, RoundTripF32MultiDim) {
  const auto dir = kda::testing::make_temp_dir("npy_f32");
  std::vector<float> v(2 * 3 * 4);
  std::iota(v.begin(), v.end(), -5.5f);
  const NpyArray a = NpyArray::from_f32({2, 3, 4}, v.data());
  write_npy(dir / "a.npy", a);
  const NpyArray b = read_npy(dir / "a.npy");
  EXPECT_EQ(b.dtype, NpyDType::F32);
  EXPECT_EQ(b.shape, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(b.to_f32(), v);
  EXPECT_THROW(b.to_i32(), std::invalid_argument);
  // The header keeps the data 64-byte aligned, as numpy writes it.
  const std::vector<uint8_t> img = serialize_npy(a);
  EXPECT_EQ((img.size() - v.size() * 4) % 64, 0u);
  EXPECT_EQ(img[6], 1);
}

TEST(Npy, RoundTripI32ScalarAndEmpty) {
  const std::vector<int32_t> v = {7, -3, 2147483647, -2147483647 - 1};
  const NpyArray a = NpyArray::from_i32({4}, v.data());
  const std::vector<uint8_t> img = serialize_npy(a);
  const NpyArray b = parse_npy(img.data(), img.size(), "mem");
  EXPECT_EQ(b.dtype, NpyDType::I32);
  EXPECT_EQ(b.shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(b.to_i32(), v);
  EXPECT_EQ(b.to_f32()[1], -3.0f);

  const float s = 3.25f;
  const NpyArray scalar = NpyArray::from_f32({}, &s);
  const std::vector<uint8_t> simg = serialize_npy(scalar);
  const NpyArray sb = parse_npy(simg.data(), simg.size(), "scalar");
  EXPECT_TRUE(sb.shape.empty());
  EXPECT_EQ(sb.numel(), 1);
  EXPECT_EQ(sb.to_f32(), std::vector<float>{3.25f});

  const NpyArray empty = NpyArray::from_f32({0, 5}, nullptr);
  const std::vector<uint8_t> eimg = serialize_npy(empty);
  const NpyArray eb = parse_npy(eimg.data(), eimg.size(), "empty");
  EXPECT_EQ(eb.shape, (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(eb.numel(), 0);
  EXPECT_TRUE(eb.to_f32().empty());
}

TEST(Npy, ParsesOtherDtypesAndV2Header) {
  auto parse = [](const std::string& header, const std::vector<uint8_t>& payload, int major = 1) {
    const std::vector<uint8_t> img = make_npy(header, payload, major);
    return parse_npy(img.data(), img.size(), "mem");
  };
  // '<f8' under a v2.0 header
  const std::vector<double> d = {1.5, -0.25};
  NpyArray a = parse("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", as_bytes(d), 2);
  EXPECT_EQ(a.dtype, NpyDType::F64);
  EXPECT_EQ(a.to_f32(), (std::vector<float>{1.5f, -0.25f}));
  EXPECT_THROW(a.to_i32(), std::invalid_argument);

  // '<f2': 1.5, -2, 65504, smallest subnormal
  const std::vector<uint16_t> h = {0x3e00, 0xc000, 0x7bff, 0x0001};
  NpyArray f16 = parse("{'descr': '<f2', 'fortran_order': False, 'shape': (4,), }", as_bytes(h));
  EXPECT_EQ(f16.dtype, NpyDType::F16);
  EXPECT_EQ(f16.to_f32(), (std::vector<float>{1.5f, -2.0f, 65504.0f, std::ldexp(1.0f, -24)}));
  EXPECT_THROW(f16.to_i32(), std::invalid_argument);

  const std::vector<int64_t> i64 = {-1, 1LL << 31};
  NpyArray big = parse("{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }", as_bytes(i64));
  EXPECT_EQ(big.to_f32(), (std::vector<float>{-1.0f, 2147483648.0f}));
  EXPECT_THROW(big.to_i32(), std::out_of_range);
  const std::vector<int64_t> small = {-7, 9};
  EXPECT_EQ(parse("{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }", as_bytes(small)).to_i32(),
            (std::vector<int32_t>{-7, 9}));

  const std::vector<uint8_t> u8 = {0, 200, 255};
  NpyArray u = parse("{'descr': '|u1', 'fortran_order': False, 'shape': (3,), }", u8);
  EXPECT_EQ(u.to_i32(), (std::vector<int32_t>{0, 200, 255}));
  EXPECT_EQ(u.to_f32(), (std::vector<float>{0.0f, 200.0f, 255.0f}));

  const std::vector<uint8_t> b1 = {1, 0, 1, 1};
  NpyArray bools = parse("{'descr': '|b1', 'fortran_order': False, 'shape': (2, 2), }", b1);
  EXPECT_EQ(bools.dtype, NpyDType::Bool);
  EXPECT_EQ(bools.to_i32(), (std::vector<int32_t>{1, 0, 1, 1}));
  EXPECT_EQ(bools.to_f32(), (std::vector<float>{1.0f, 0.0f, 1.0f, 1.0f}));

  // Key order is free and double quotes are Python too.
  const std::vector<int32_t> one = {42};
  EXPECT_EQ(parse("{\"shape\": (1,), \"fortran_order\": False, \"descr\": \"<i4\"}", as_bytes(one)).to_i32(),
            one);
}

TEST(Npy, RejectsBadInput) {
  const std::vector<float> v = {1, 2, 3, 4, 5, 6};
  const std::string good = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  auto err = [](const std::vector<uint8_t>& img) {
    return runtime_error_of([&] { parse_npy(img.data(), img.size(), "member.npy"); });
  };

  std::vector<uint8_t> truncated = make_npy(good, as_bytes(v));
  truncated.resize(truncated.size() - 3);
  EXPECT_THAT(err(truncated), HasSubstr("truncated data"));
  EXPECT_THAT(err(truncated), HasSubstr("member.npy"));

  std::vector<uint8_t> bad_magic = make_npy(good, as_bytes(v));
  bad_magic[1] = 'X';
  EXPECT_THAT(err(bad_magic), HasSubstr("bad magic"));
  EXPECT_THAT(err({0x93, 'N'}), HasSubstr("bad magic"));

  EXPECT_THAT(err(make_npy("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", as_bytes(v))),
              HasSubstr("fortran_order"));
  EXPECT_THAT(err(make_npy("{'descr': '<c8', 'fortran_order': False, 'shape': (3,), }", as_bytes(v))),
              HasSubstr("unknown descr '<c8'"));
  EXPECT_THAT(err(make_npy("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", as_bytes(v))),
              HasSubstr("big-endian"));
  EXPECT_THAT(
      err(make_npy("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,), }", as_bytes(v))),
      HasSubstr("descr"));
  EXPECT_THAT(err(make_npy("{'descr': '<f4', 'fortran_order': False, }", as_bytes(v))), HasSubstr("'shape'"));
  EXPECT_THAT(err(make_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", as_bytes(v), 7)),
              HasSubstr("version"));
  EXPECT_THAT(err(make_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }", as_bytes(v))),
              HasSubstr("size mismatch"));

  std::vector<uint8_t> short_header = make_npy(good, {});
  short_header.resize(40);
  EXPECT_THAT(err(short_header), HasSubstr("truncated .npy header"));

  const auto dir = kda::testing::make_temp_dir("npy_bad");
  EXPECT_THAT(runtime_error_of([&] { read_npy(dir / "absent.npy"); }), HasSubstr("absent.npy"));
}

TEST(Npz, RoundTrip) {
  const auto dir = kda::testing::make_temp_dir("npz_rt");
  std::vector<float> f(3 * 5);
  std::iota(f.begin(), f.end(), 0.5f);
  const std::vector<int32_t> i = {0, 17, 22, 64};
  NpzArchive out;
  out["x"] = NpyArray::from_f32({3, 5}, f.data());
  out["cu_seqlens"] = NpyArray::from_i32({4}, i.data());
  out["empty"] = NpyArray::from_f32({0}, nullptr);
  const float s = -1.0f;
  out["scalar"] = NpyArray::from_f32({}, &s);
  write_npz(dir / "a.npz", out);

  const NpzArchive in = read_npz(dir / "a.npz");
  ASSERT_EQ(in.size(), 4u);
  EXPECT_EQ(in.at("x").shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(in.at("x").to_f32(), f);
  EXPECT_EQ(in.at("cu_seqlens").to_i32(), i);
  EXPECT_EQ(in.at("empty").shape, (std::vector<int64_t>{0}));
  EXPECT_TRUE(in.at("scalar").shape.empty());
  EXPECT_EQ(in.at("scalar").to_f32(), std::vector<float>{-1.0f});

  // Members are stored, as np.savez writes them.
  int err = 0;
  zip_t* z = zip_open((dir / "a.npz").c_str(), ZIP_RDONLY, &err);
  ASSERT_NE(z, nullptr);
  zip_stat_t st;
  ASSERT_EQ(zip_stat(z, "x.npy", 0, &st), 0);
  EXPECT_EQ(st.comp_method, ZIP_CM_STORE);
  zip_discard(z);

  write_npz(dir / "none.npz", {});
  EXPECT_TRUE(read_npz(dir / "none.npz").empty());
}

TEST(Npz, ReadsDeflatedMember) {
  const auto dir = kda::testing::make_temp_dir("npz_deflate");
  const fs::path path = dir / "d.npz";
  std::vector<float> v(4096, 0.0f);
  for (size_t k = 0; k < v.size(); k += 7) v[k] = static_cast<float>(k);
  const std::vector<uint8_t> img = serialize_npy(NpyArray::from_f32({64, 64}, v.data()));
  {
    int err = 0;
    zip_t* z = zip_open(path.c_str(), ZIP_CREATE | ZIP_TRUNCATE, &err);
    ASSERT_NE(z, nullptr);
    zip_source_t* src = zip_source_buffer(z, img.data(), img.size(), 0);
    ASSERT_NE(src, nullptr);
    const zip_int64_t idx = zip_file_add(z, "w.npy", src, 0);
    ASSERT_GE(idx, 0);
    ASSERT_EQ(zip_set_file_compression(z, static_cast<zip_uint64_t>(idx), ZIP_CM_DEFLATE, 9), 0);
    ASSERT_EQ(zip_close(z), 0);
  }
  {
    int err = 0;
    zip_t* z = zip_open(path.c_str(), ZIP_RDONLY, &err);
    ASSERT_NE(z, nullptr);
    zip_stat_t st;
    ASSERT_EQ(zip_stat(z, "w.npy", 0, &st), 0);
    EXPECT_EQ(st.comp_method, ZIP_CM_DEFLATE);
    EXPECT_LT(st.comp_size, st.size);
    zip_discard(z);
  }
  const NpzArchive a = read_npz(path);
  ASSERT_EQ(a.count("w"), 1u);
  EXPECT_EQ(a.at("w").shape, (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(a.at("w").to_f32(), v);
}

TEST(Npz, RejectsBadArchives) {
  const auto dir = kda::testing::make_temp_dir("npz_bad");
  write_bytes(dir / "junk.npz", {'n', 'o', 't', ' ', 'a', ' ', 'z', 'i', 'p'});
  EXPECT_THAT(runtime_error_of([&] { read_npz(dir / "junk.npz"); }), HasSubstr("junk.npz"));
  EXPECT_THAT(runtime_error_of([&] { read_npz(dir / "absent.npz"); }), HasSubstr("absent.npz"));

  // A member whose .npy is truncated: the error names the archive and the member.
  const std::vector<float> v = {1, 2, 3, 4};
  std::vector<uint8_t> img =
      make_npy("{'descr': '<f4', 'fortran_order': True, 'shape': (4,), }", as_bytes(v));
  int err = 0;
  zip_t* z = zip_open((dir / "bad.npz").c_str(), ZIP_CREATE | ZIP_TRUNCATE, &err);
  ASSERT_NE(z, nullptr);
  ASSERT_GE(zip_file_add(z, "f.npy", zip_source_buffer(z, img.data(), img.size(), 0), 0), 0);
  ASSERT_EQ(zip_close(z), 0);
  const std::string msg = runtime_error_of([&] { read_npz(dir / "bad.npz"); });
  EXPECT_THAT(msg, HasSubstr("bad.npz:f.npy"));
  EXPECT_THAT(msg, HasSubstr("fortran_order"));
}

// ---------------------------------------------------------------------------------------------------------
// safetensors

struct StTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
  // Overrides for malformed files; by default tensors are laid out one after another.
  int64_t begin = -1, end = -1;
};

// Writes a safetensors file: 8-byte LE header length, JSON header, then the data section.
void write_safetensors(const fs::path& path, const std::vector<StTensor>& tensors,
                       const nlohmann::json& metadata = nullptr, size_t extra_data = 0) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.is_null()) header["__metadata__"] = metadata;
  std::vector<uint8_t> data;
  for (const auto& t : tensors) {
    int64_t b = static_cast<int64_t>(data.size());
    data.insert(data.end(), t.bytes.begin(), t.bytes.end());
    int64_t e = static_cast<int64_t>(data.size());
    if (t.begin >= 0) b = t.begin;
    if (t.end >= 0) e = t.end;
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {b, e}}};
  }
  data.resize(data.size() + extra_data);
  std::string h = header.dump();
  while (h.size() % 8 != 3) h += ' ';  // an odd length leaves the data unaligned, which readers must handle
  std::vector<uint8_t> out(8);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(static_cast<uint64_t>(h.size()) >> (8 * i));
  out.insert(out.end(), h.begin(), h.end());
  out.insert(out.end(), data.begin(), data.end());
  write_bytes(path, out);
}

StTensor f32_tensor(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
  return {name, "F32", std::move(shape), as_bytes(v)};
}

TEST(Safetensors, VendoredCheckpointMatchesWeightsNpz) {
  const Checkpoint ckpt(kda::testing::dumps_dir());
  const std::string name = "model.layers.0.self_attn.q_proj.weight";
  ASSERT_TRUE(ckpt.contains(name));
  EXPECT_FALSE(ckpt.contains("model.layers.0.self_attn.nope"));
  const TensorView& v = ckpt.get(name);
  EXPECT_EQ(v.dtype, StDType::F32);
  EXPECT_EQ(v.shape, (std::vector<int64_t>{512, 256}));
  EXPECT_EQ(v.nbytes, 512u * 256u * 4u);

  const std::vector<float> w = ckpt.load_f32(name, {512, 256});
  const NpzArchive ref = read_npz(kda::testing::dumps_dir() / "weights.npz");
  const std::vector<float> r = ref.at("q_proj.weight").to_f32();
  ASSERT_EQ(w.size(), r.size());
  EXPECT_EQ(w[0], r[0]);
  EXPECT_EQ(w[12345], r[12345]);
  EXPECT_EQ(w, r);

  const std::vector<bf16_t> wb = ckpt.load_bf16(name, {512, 256});
  EXPECT_EQ(wb[777], f32_to_bf16(r[777]));

  // A path to the file works the same.
  const Checkpoint by_file(kda::testing::dumps_dir() / "model.safetensors");
  EXPECT_EQ(by_file.load_f32("model.layers.0.self_attn.A_log", {1, 1, 4, 1}), ref.at("A_log").to_f32());
}

// What a layer-by-layer loader asks of a sharded checkpoint: every name, each one's shard, which names
// were read, and a shard unmapped once done (mapped again if asked for later).
TEST(Safetensors, ShardedCheckpointNamesShardsReleaseAndAccessed) {
  Checkpoint ckpt(kda::testing::model_dumps_dir());
  const auto names = ckpt.names();
  EXPECT_EQ(names.size(), 151u);
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  const std::string first = "model.embed_tokens.weight", last = "lm_head.weight";
  EXPECT_EQ(ckpt.shard_of(first), "model-00001-of-00002.safetensors");
  EXPECT_EQ(ckpt.shard_of(last), "model-00002-of-00002.safetensors");
  EXPECT_THROW(ckpt.shard_of("model.nope"), std::runtime_error);
  EXPECT_TRUE(ckpt.accessed().empty());
  const auto head = ckpt.load_f32(last, {512, 256});
  ckpt.release_shard(ckpt.shard_of(last));
  ckpt.release_shard("not-a-shard.safetensors");     // a no-op
  EXPECT_EQ(ckpt.load_f32(last, {512, 256}), head);  // mapped again
  const auto slice = ckpt.load_f32_slice(first, {512, 256}, 0, 3, 5);
  EXPECT_EQ(slice.size(), 2u * 256u);
  EXPECT_EQ(ckpt.accessed(), (std::vector<std::string>{last, first}));
  // A single-file checkpoint: every name in shard "".
  const Checkpoint single(kda::testing::dumps_dir());
  EXPECT_EQ(single.shard_of("model.layers.0.self_attn.A_log"), "");
  EXPECT_FALSE(single.names().empty());
}

// A converting load leaves its tensor's mapped pages out of the resident set: a loader going tensor by
// tensor holds the weights built so far, not every tensor it read from the shards still open. A load's
// RSS growth is its own copy (with the mapped pages resident too, it would be twice that); read again, the
// pages come back from the file.
TEST(Safetensors, ALoadLeavesItsTensorsMappedPagesOutOfTheResidentSet) {
  if (kda::testing::kSanitizedMalloc) GTEST_SKIP() << "a sanitizer's allocator measures its own bookkeeping";
  const auto dir = kda::testing::make_temp_dir("st_rss");
  constexpr int64_t n = int64_t{16} << 20;  // 64 MiB of fp32
  {
    io::StTensor t{{n}, std::vector<float>(static_cast<size_t>(n)), StDType::F32};
    for (int64_t i = 0; i < n; ++i) t.values[static_cast<size_t>(i)] = static_cast<float>(i % 1000);
    io::write_safetensors(dir / "model.safetensors", {{"w", t}});
  }
  const Checkpoint ckpt(dir);
  constexpr int64_t kSlackKb = 16 << 10;
  const int64_t before = kda::testing::proc_status_kb("VmRSS");
  ASSERT_GT(before, 0);
  const auto a = ckpt.load_f32("w", {n});
  EXPECT_LT(kda::testing::proc_status_kb("VmRSS") - before, n * 4 / 1024 + kSlackKb);
  EXPECT_EQ(a[12345], 345.0f);
  const int64_t mid = kda::testing::proc_status_kb("VmRSS");
  const auto b = ckpt.load_bf16("w", {n});
  EXPECT_LT(kda::testing::proc_status_kb("VmRSS") - mid, n * 2 / 1024 + kSlackKb);
  EXPECT_EQ(bf16_to_f32(b[255]), 255.0f);
  EXPECT_EQ(ckpt.load_f32_slice("w", {n}, 0, 12345, 12346), std::vector<float>{345.0f});
}

TEST(Safetensors, ConvertsF32Bf16F16) {
  const auto dir = kda::testing::make_temp_dir("st_good");
  const std::vector<float> f = {1.0f, -2.5f, 3.14159f, 1e-30f, 65536.0f, -0.0f};
  const std::vector<bf16_t> b = {f32_to_bf16(0.15625f), f32_to_bf16(-3.0f), 0x7f80 /* inf */, 0x0001};
  // 1.5, -2, 65504 (max), smallest subnormal, -0, a subnormal 0x03ff
  const std::vector<uint16_t> h = {0x3e00, 0xc000, 0x7bff, 0x0001, 0x8000, 0x03ff};
  write_safetensors(dir / "model.safetensors",
                    {f32_tensor("f", {2, 3}, f),
                     {"b", "BF16", {4}, as_bytes(b)},
                     {"h", "F16", {3, 2}, as_bytes(h)},
                     {"e", "F32", {0, 4}, {}}},
                    {{"format", "pt"}});

  const SafetensorsFile file(dir / "model.safetensors");
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.names(), (std::vector<std::string>{"b", "e", "f", "h"}));
  EXPECT_EQ(file.find("absent"), nullptr);

  const Checkpoint ckpt(dir);
  EXPECT_EQ(ckpt.load_f32("f", {2, 3}), f);
  EXPECT_EQ(ckpt.load_bf16("f", {2, 3})[2], f32_to_bf16(3.14159f));

  const std::vector<float> bf = ckpt.load_f32("b", {4});
  EXPECT_EQ(bf[0], 0.15625f);
  EXPECT_EQ(bf[1], -3.0f);
  EXPECT_TRUE(std::isinf(bf[2]));
  EXPECT_EQ(bf[3], bf16_to_f32(0x0001));
  EXPECT_EQ(ckpt.load_bf16("b", {4}), b);  // a plain copy

  const std::vector<float> hf = ckpt.load_f32("h", {3, 2});
  EXPECT_EQ(hf[0], 1.5f);
  EXPECT_EQ(hf[1], -2.0f);
  EXPECT_EQ(hf[2], 65504.0f);
  EXPECT_EQ(hf[3], std::ldexp(1.0f, -24));
  EXPECT_EQ(hf[4], 0.0f);
  EXPECT_TRUE(std::signbit(hf[4]));
  EXPECT_EQ(hf[5], std::ldexp(1023.0f, -24));
  const std::vector<bf16_t> hb = ckpt.load_bf16("h", {3, 2});
  EXPECT_EQ(bf16_to_f32(hb[0]), 1.5f);
  EXPECT_EQ(hb[2], f32_to_bf16(65504.0f));

  EXPECT_TRUE(ckpt.load_f32("e", {0, 4}).empty());
}

TEST(Safetensors, ShardedCheckpoint) {
  const auto dir = kda::testing::make_temp_dir("st_sharded");
  write_safetensors(dir / "model-00001-of-00002.safetensors",
                    {f32_tensor("a", {2}, {1.0f, 2.0f}), f32_tensor("b", {1}, {3.0f})});
  write_safetensors(dir / "model-00002-of-00002.safetensors", {f32_tensor("c", {2, 1}, {4.0f, 5.0f})});
  nlohmann::json index = {{"metadata", {{"total_size", 20}}},
                          {"weight_map",
                           {{"a", "model-00001-of-00002.safetensors"},
                            {"b", "model-00001-of-00002.safetensors"},
                            {"c", "model-00002-of-00002.safetensors"}}}};
  write_text(dir / "model.safetensors.index.json", index.dump(2));
  // A stray model.safetensors must not win over the index.
  write_safetensors(dir / "model.safetensors", {f32_tensor("a", {2}, {9.0f, 9.0f})});

  const Checkpoint ckpt(dir);
  EXPECT_TRUE(ckpt.contains("a"));
  EXPECT_TRUE(ckpt.contains("c"));
  EXPECT_FALSE(ckpt.contains("d"));
  EXPECT_EQ(ckpt.load_f32("a", {2}), (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(ckpt.load_f32("b", {1}), (std::vector<float>{3.0f}));
  EXPECT_EQ(ckpt.load_f32("c", {2, 1}), (std::vector<float>{4.0f, 5.0f}));
  EXPECT_EQ(&ckpt.get("a"), &ckpt.get("a"));  // the shard is cached
  EXPECT_THAT(runtime_error_of([&] { ckpt.get("d"); }), HasSubstr("missing tensor 'd' in " + dir.string()));

  // An index pointing at a shard that lacks the tensor.
  index["weight_map"]["z"] = "model-00002-of-00002.safetensors";
  write_text(dir / "model.safetensors.index.json", index.dump());
  const Checkpoint lying(dir);
  EXPECT_THAT(runtime_error_of([&] { lying.get("z"); }), HasSubstr("missing tensor 'z'"));

  // An index pointing at a shard that does not exist.
  index["weight_map"]["z"] = "model-00003-of-00002.safetensors";
  write_text(dir / "model.safetensors.index.json", index.dump());
  EXPECT_THAT(runtime_error_of([&] { Checkpoint c(dir); }), HasSubstr("model-00003-of-00002.safetensors"));
}

TEST(Safetensors, RejectsMalformedFiles) {
  const auto dir = kda::testing::make_temp_dir("st_bad");
  const std::vector<float> four = {1, 2, 3, 4};
  auto open_err = [&](const std::string& file) {
    return runtime_error_of([&] { SafetensorsFile f(dir / file); });
  };

  write_bytes(dir / "tiny.safetensors", {1, 2, 3});
  EXPECT_THAT(open_err("tiny.safetensors"), HasSubstr("shorter than the 8-byte header length"));
  EXPECT_THAT(open_err("tiny.safetensors"), HasSubstr("tiny.safetensors"));
  write_bytes(dir / "empty.safetensors", {});
  EXPECT_THAT(open_err("empty.safetensors"), HasSubstr("shorter than"));

  // Truncated: a good file cut short, so the last tensor runs past the end.
  write_safetensors(dir / "trunc.safetensors", {f32_tensor("w", {4}, four)});
  fs::resize_file(dir / "trunc.safetensors", fs::file_size(dir / "trunc.safetensors") - 5);
  EXPECT_THAT(open_err("trunc.safetensors"), HasSubstr("offsets past the end of the file"));
  EXPECT_THAT(open_err("trunc.safetensors"), HasSubstr("tensor 'w'"));

  // Header length larger than the file.
  write_safetensors(dir / "hdr.safetensors", {f32_tensor("w", {4}, four)});
  fs::resize_file(dir / "hdr.safetensors", 20);
  EXPECT_THAT(open_err("hdr.safetensors"), HasSubstr("larger than the file"));

  StTensor past = f32_tensor("w", {4}, four);
  past.begin = 8;
  past.end = 24;
  write_safetensors(dir / "past.safetensors", {past});
  EXPECT_THAT(open_err("past.safetensors"), HasSubstr("offsets past the end of the file"));

  write_safetensors(dir / "i16.safetensors", {{"q", "I16", {2}, {1, 2, 3, 4}}});
  EXPECT_THAT(open_err("i16.safetensors"),
              HasSubstr("unknown dtype 'I16' for tensor 'q' in " + (dir / "i16.safetensors").string()));
  EXPECT_THAT(open_err("i16.safetensors"), HasSubstr("i16.safetensors"));
  write_safetensors(dir / "f64.safetensors", {{"d", "F64", {2}, as_bytes(std::vector<double>{1, 2})}});
  EXPECT_THAT(open_err("f64.safetensors"), HasSubstr("unknown dtype 'F64' for tensor 'd'"));

  write_safetensors(dir / "size.safetensors", {f32_tensor("w", {5}, four)});
  EXPECT_THAT(open_err("size.safetensors"), HasSubstr("byte size 16 does not match"));

  StTensor b = f32_tensor("b", {4}, four);
  b.begin = 8;
  b.end = 24;
  write_safetensors(dir / "overlap.safetensors", {f32_tensor("a", {4}, four), b}, nullptr, 8);
  const std::string overlap = open_err("overlap.safetensors");
  EXPECT_THAT(overlap, HasSubstr("overlap"));
  EXPECT_THAT(overlap, HasSubstr("'a'"));
  EXPECT_THAT(overlap, HasSubstr("'b'"));

  StTensor backwards = f32_tensor("r", {0}, {});
  backwards.begin = 4;
  backwards.end = 0;
  write_safetensors(dir / "backwards.safetensors", {backwards}, nullptr, 8);
  EXPECT_THAT(open_err("backwards.safetensors"), HasSubstr("begin > end"));

  write_safetensors(dir / "negshape.safetensors", {{"n", "F32", {-1}, {}}});
  EXPECT_THAT(open_err("negshape.safetensors"), HasSubstr("non-negative"));

  const std::string text = "{not json";
  std::vector<uint8_t> raw(8);
  raw[0] = static_cast<uint8_t>(text.size());
  raw.insert(raw.end(), text.begin(), text.end());
  write_bytes(dir / "json.safetensors", raw);
  EXPECT_THAT(open_err("json.safetensors"), HasSubstr("not valid JSON"));

  const std::string arr = "[1, 2]";
  raw.assign(8, 0);
  raw[0] = static_cast<uint8_t>(arr.size());
  raw.insert(raw.end(), arr.begin(), arr.end());
  write_bytes(dir / "array.safetensors", raw);
  EXPECT_THAT(open_err("array.safetensors"), HasSubstr("not a JSON object"));

  write_safetensors(dir / "meta.safetensors", {}, {{"n", 3}});
  EXPECT_THAT(open_err("meta.safetensors"), HasSubstr("__metadata__"));

  EXPECT_THAT(open_err("absent.safetensors"), HasSubstr("cannot open"));
}

TEST(Safetensors, CheckpointErrors) {
  const auto dir = kda::testing::make_temp_dir("st_ckpt_err");
  EXPECT_THAT(runtime_error_of([&] { Checkpoint c(dir); }), HasSubstr("neither model.safetensors"));
  EXPECT_THAT(runtime_error_of([&] { Checkpoint c(dir / "nothing"); }), HasSubstr("does not exist"));

  write_safetensors(dir / "model.safetensors", {f32_tensor("w", {2, 2}, {1, 2, 3, 4})});
  const Checkpoint ckpt(dir);
  EXPECT_THAT(runtime_error_of([&] { ckpt.get("nope"); }),
              HasSubstr("missing tensor 'nope' in " + dir.string()));
  EXPECT_THAT(runtime_error_of([&] { ckpt.load_f32("nope", {2, 2}); }), HasSubstr("missing tensor 'nope'"));
  // Same element count, different shape: still an error.
  EXPECT_THAT(runtime_error_of([&] { ckpt.load_f32("w", {4}); }),
              HasSubstr("tensor 'w' has shape [2, 2] but [4] was expected"));
  EXPECT_THAT(runtime_error_of([&] {
                ckpt.load_bf16("w", {2, 3});
              }),
              HasSubstr("tensor 'w' has shape [2, 2] but [2, 3] was expected"));

  write_text(dir / "model.safetensors.index.json", "{\"metadata\": {}}");
  EXPECT_THAT(runtime_error_of([&] { Checkpoint c(dir); }), HasSubstr("weight_map"));
}

// ---------------------------------------------------------------------------------------------------------
// config.json

TEST(Config, MiniDump) {
  const KimiLinearConfig c = load_config(kda::testing::dumps_dir());
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.num_hidden_layers, 1);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.projection_size(), 512);
  EXPECT_EQ(c.short_conv_kernel_size, 4);
  EXPECT_EQ(c.kda_layers, std::vector<int>{1});
  EXPECT_TRUE(c.full_attn_layers.empty());
  EXPECT_TRUE(c.is_kda_layer(0));
  EXPECT_FALSE(c.is_kda_layer(1));
  EXPECT_EQ(c.kda_layer_ids(), std::vector<int>{0});
  // A path to the file works the same.
  EXPECT_EQ(load_config(kda::testing::dumps_dir() / "config.json").hidden_size, 256);
}

// The published config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct (the fuzz corpus's seed).
nlohmann::json config_48b() {
  return nlohmann::json::parse(
      kda::testing::read_file(std::filesystem::path(KDA_FUZZ_DIR) / "config" / "kimi_linear_48b.json"));
}

TEST(Config, Kimi48B) {
  const auto dir = kda::testing::make_temp_dir("cfg_48b");
  write_text(dir / "config.json", config_48b().dump(2));
  const KimiLinearConfig c = load_config(dir);
  EXPECT_EQ(c.hidden_size, 2304);
  EXPECT_EQ(c.num_hidden_layers, 27);
  EXPECT_EQ(c.projection_size(), 32 * 128);
  const std::vector<int> ids = c.kda_layer_ids();
  EXPECT_EQ(ids, (std::vector<int>{0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, 16, 17, 18, 20, 21, 22, 24, 25}));
  EXPECT_EQ(ids.size(), 20u);
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const bool full = i == 3 || i == 7 || i == 11 || i == 15 || i == 19 || i == 23 || i == 26;
    EXPECT_EQ(c.is_kda_layer(i), !full) << "layer " << i;
  }
  EXPECT_EQ(c.full_attn_layers.size(), 7u);
}

// The preset the synthetic models, tests and benchmarks use (kda/io/kimi_linear_48b.h) is the published
// config, field by field, and its compile-time shape agrees with it.
TEST(Config, Kimi48BPresetIsThePublishedConfig) {
  const KimiLinearConfig c = parse_model_config(config_48b().dump(), "config_48b");
  kda::testing::expect_same_stack_config(kimi_linear_48b_config(), c);
  using S = KimiLinear48bShape;
  EXPECT_EQ(S::kHidden, c.hidden_size);
  EXPECT_EQ(S::kHeads, c.num_heads);
  EXPECT_EQ(S::kHeadDim, c.head_dim);
  EXPECT_EQ(S::kProjection, c.projection_size());
  EXPECT_EQ(S::kConvKernel, c.short_conv_kernel_size);
  EXPECT_EQ(S::kLayers, c.num_hidden_layers);
  EXPECT_EQ(S::kKdaLayers, static_cast<int>(c.kda_layer_ids().size()));
  EXPECT_EQ(S::kRmsNormEps, c.rms_norm_eps);
  const KimiLinearConfig one = kimi_linear_48b_one_layer_config();
  EXPECT_EQ(one.num_hidden_layers, 1);
  EXPECT_EQ(one.kda_layer_ids(), std::vector<int>{0});
  EXPECT_EQ(one.hidden_size, c.hidden_size);
}

TEST(Config, ModelFieldsOfThe48BModel) {
  const KimiLinearConfig c = parse_model_config(config_48b().dump(), "cfg.json");
  EXPECT_TRUE(c.has_model_fields);
  EXPECT_EQ(c.mla_layer_ids(), (std::vector<int>{3, 7, 11, 15, 19, 23, 26}));
  EXPECT_EQ(c.qk_head_dim(), 192);
  EXPECT_EQ(c.kv_cache_dim(), 576);
  EXPECT_FALSE(c.is_moe_layer(0));  // first_k_dense_replace 1: layer 0 is dense
  for (int i = 1; i < 27; ++i) EXPECT_TRUE(c.is_moe_layer(i)) << i;
  // The KDA-only reading leaves the model fields unset.
  EXPECT_FALSE(parse_config(config_48b().dump(), "cfg.json").has_model_fields);
}

// The vendored tiny model's config: 4 layers in the real pattern (3 KDA, then MLA; layer 0 dense).
TEST(Config, TinyModelDumpsConfig) {
  const KimiLinearConfig c = load_model_config(kda::testing::model_dumps_dir());
  EXPECT_EQ(c.kda_layer_ids(), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(c.mla_layer_ids(), std::vector<int>{3});
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.qk_head_dim(), 48);
  EXPECT_EQ(c.kv_cache_dim(), 80);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_token, 2);
  EXPECT_EQ(c.moe_intermediate_size, 64);
  EXPECT_EQ(c.intermediate_size, 256);
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1) && c.is_moe_layer(2) && c.is_moe_layer(3));
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.446);
}

// What the spec does not define is refused by the whole decoder's reading, naming the field.
TEST(Config, ModelConfigRefusesWhatTheSpecDoesNotDefine) {
  auto err = [](const nlohmann::json& j) {
    return runtime_error_of([&] { parse_model_config(j.dump(), "cfg.json"); });
  };
  struct Bad {
    const char* needle;
    std::function<void(nlohmann::json&)> set;
  };
  const Bad bad[] = {
      {"'q_lora_rank' must be null", [](auto& j) { j["q_lora_rank"] = 1536; }},
      {"'mla_use_nope' must be true", [](auto& j) { j["mla_use_nope"] = false; }},
      {"'moe_router_activation_func' must be \"sigmoid\"",
       [](auto& j) { j["moe_router_activation_func"] = "softmax"; }},
      {"'num_expert_group' must be 1", [](auto& j) { j["num_expert_group"] = 8; }},
      {"'topk_group' must be 1", [](auto& j) { j["topk_group"] = 4; }},
      {"'num_key_value_heads' must equal", [](auto& j) { j["num_key_value_heads"] = 8; }},
      {"'num_experts_per_token' must be in 1..256", [](auto& j) { j["num_experts_per_token"] = 300; }},
      {"'hidden_act' must be \"silu\"", [](auto& j) { j["hidden_act"] = "gelu"; }},
      {"'vocab_size' is missing", [](auto& j) { j.erase("vocab_size"); }},
      {"'kv_lora_rank' is missing", [](auto& j) { j.erase("kv_lora_rank"); }},
      {"layer 27 is in neither",
       [](auto& j) { j["linear_attn_config"]["full_attn_layers"] = {4, 8, 12, 16, 20, 24}; }},
      {"'routed_scaling_factor' must be a finite number",
       [](auto& j) { j["routed_scaling_factor"] = "2.4"; }},
  };
  for (const auto& b : bad) {
    nlohmann::json j = config_48b();
    b.set(j);
    EXPECT_THAT(err(j), HasSubstr(b.needle)) << b.needle;
    EXPECT_THAT(err(j), HasSubstr("cfg.json")) << b.needle;
  }
  // Grouped top-k with one group is the published model's and is accepted.
  nlohmann::json j = config_48b();
  j["use_grouped_topk"] = false;
  j["num_expert_group"] = 8;
  EXPECT_EQ(parse_model_config(j.dump(), "cfg.json").num_experts, 256);
}

TEST(Config, RejectsBadConfigs) {
  auto err = [](const nlohmann::json& j) {
    return runtime_error_of([&] { parse_config(j.dump(), "cfg.json"); });
  };
  nlohmann::json j = config_48b();
  j.erase("rms_norm_eps");
  EXPECT_THAT(err(j), HasSubstr("cfg.json: field 'rms_norm_eps' is missing"));

  j = config_48b();
  j["linear_attn_config"]["kda_layers"] = {0, 1, 2};
  EXPECT_THAT(err(j), HasSubstr("linear_attn_config.kda_layers"));
  EXPECT_THAT(err(j), HasSubstr("holds layer 0"));

  j = config_48b();
  j["linear_attn_config"]["kda_layers"] = {1, 28};
  EXPECT_THAT(err(j), HasSubstr("holds layer 28"));

  j = config_48b();
  j["linear_attn_config"]["kda_layers"] = {1, 2, 2};
  EXPECT_THAT(err(j), HasSubstr("twice"));

  j = config_48b();
  j["hidden_size"] = 0;
  EXPECT_THAT(err(j), HasSubstr("'hidden_size' must be positive"));

  j = config_48b();
  j["linear_attn_config"]["head_dim"] = "128";
  EXPECT_THAT(err(j), HasSubstr("'linear_attn_config.head_dim' must be an integer"));

  j = config_48b();
  j["linear_attn_config"].erase("num_heads");
  EXPECT_THAT(err(j), HasSubstr("'linear_attn_config.num_heads' is missing"));

  j = config_48b();
  j.erase("linear_attn_config");
  EXPECT_THAT(err(j), HasSubstr("'linear_attn_config' is missing"));

  j = config_48b();
  j["linear_attn_config"]["full_attn_layers"] = {1, 4};
  EXPECT_THAT(err(j), HasSubstr("full_attn_layers"));

  j = config_48b();
  j["rms_norm_eps"] = -1.0;
  EXPECT_THAT(err(j), HasSubstr("rms_norm_eps"));

  // Another architecture's config, or none named.
  j = config_48b();
  j["model_type"] = "deepseek_v3";
  EXPECT_THAT(err(j), HasSubstr("cfg.json: field 'model_type' must be \"kimi_linear\", got \"deepseek_v3\""));
  j.erase("model_type");
  EXPECT_THAT(err(j), HasSubstr("cfg.json: field 'model_type' is missing"));
  j["model_type"] = 7;
  EXPECT_THAT(err(j), HasSubstr("'model_type' must be"));

  // full_attn_layers may be absent.
  j = config_48b();
  j["linear_attn_config"].erase("full_attn_layers");
  EXPECT_TRUE(parse_config(j.dump(), "cfg.json").full_attn_layers.empty());

  // Sizes so large that what is derived from them (weights, a slot's state) overflows int64 or asks for
  // terabytes: refused, naming the field.
  struct Huge {
    const char* field;  // as the error names it
    std::function<void(nlohmann::json&)> set;
  };
  const Huge huge[] = {
      {"'hidden_size' is too large", [](auto& c) { c["hidden_size"] = int64_t{1} << 40; }},
      {"'num_hidden_layers' is too large", [](auto& c) { c["num_hidden_layers"] = 1 << 30; }},
      {"'linear_attn_config.num_heads' is too large",
       [](auto& c) { c["linear_attn_config"]["num_heads"] = 1 << 20; }},
      {"'linear_attn_config.head_dim' is too large",
       [](auto& c) { c["linear_attn_config"]["head_dim"] = 1 << 30; }},
      {"'linear_attn_config.short_conv_kernel_size' is too large",
       [](auto& c) { c["linear_attn_config"]["short_conv_kernel_size"] = 1 << 30; }},
      {"'hidden_size' times linear_attn_config.num_heads x head_dim",
       [](auto& c) {
         c["hidden_size"] = kMaxHiddenSize;
         c["linear_attn_config"]["num_heads"] = kMaxHeads;
         c["linear_attn_config"]["head_dim"] = kMaxHeadDim;
       }},
  };
  for (const auto& h : huge) {
    j = config_48b();
    h.set(j);
    EXPECT_THAT(err(j), HasSubstr("cfg.json: field " + std::string(h.field))) << h.field;
  }
  // The bounds themselves are accepted.
  j = config_48b();
  j["hidden_size"] = kMaxHiddenSize;
  j["linear_attn_config"]["short_conv_kernel_size"] = kMaxConvKernel;
  j["linear_attn_config"]["head_dim"] = kMaxHeadDim;
  EXPECT_EQ(parse_config(j.dump(), "cfg.json").head_dim, kMaxHeadDim);

  EXPECT_THAT(runtime_error_of([] { parse_config("{oops", "cfg.json"); }),
              HasSubstr("cfg.json: not valid JSON"));
  EXPECT_THAT(runtime_error_of([] { load_config("/nonexistent/kda/dir"); }), HasSubstr("cannot open config"));
}

}  // namespace
}  // namespace kda::io
