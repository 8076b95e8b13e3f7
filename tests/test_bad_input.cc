// Bad input to the end, at the io layer: a corrupted .npz member (CRC-32, sizes), a file of the wrong
// kind (empty, truncated, a directory, a FIFO, text) where an .npz / .npy / config / checkpoint / trace is
// expected, and outputs that are never partial (written to a temporary name, renamed when complete).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/io/config.h"
#include "kda/io/file.h"
#include "kda/io/npy.h"
#include "kda/io/safetensors.h"
#include "kda/model_executor/forward_batch_info.h"
#include "kda/serving/trace.h"
#include "support/test_support.h"

namespace kda::io {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

std::vector<uint8_t> slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void dump(const fs::path& p, const std::vector<uint8_t>& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  ASSERT_TRUE(out.good());
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

uint32_t le32(const std::vector<uint8_t>& b, size_t at) {
  return b[at] | b[at + 1] << 8 | b[at + 2] << 16 | static_cast<uint32_t>(b[at + 3]) << 24;
}
void put_le32(std::vector<uint8_t>& b, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
}

// An archive of two stored members, "a" (64 distinct floats) and "b"; returns its bytes.
std::vector<uint8_t> two_member_npz(std::vector<float>& a_values) {
  a_values.resize(64);
  for (size_t i = 0; i < a_values.size(); ++i) a_values[i] = 0.25f * static_cast<float>(i) + 1.0f;
  const std::vector<int32_t> b = {7, 8, 9};
  NpzArchive z;
  z["a"] = NpyArray::from_f32({8, 8}, a_values.data());
  z["b"] = NpyArray::from_i32({3}, b.data());
  return serialize_npz(z);
}

size_t find_bytes(const std::vector<uint8_t>& hay, const void* needle, size_t n) {
  const auto* p = static_cast<const uint8_t*>(needle);
  const auto it = std::search(hay.begin(), hay.end(), p, p + n);
  return it == hay.end() ? std::string::npos : static_cast<size_t>(it - hay.begin());
}

TEST(NpzCrc, AFlippedByteInAStoredMemberIsRefusedNamingTheMember) {
  std::vector<float> a;
  std::vector<uint8_t> img = two_member_npz(a);
  ASSERT_NO_THROW(parse_npz(img.data(), img.size(), "ok.npz"));
  const size_t at = find_bytes(img, a.data(), a.size() * sizeof(float));
  ASSERT_NE(at, std::string::npos);
  for (size_t off : {size_t{0}, size_t{17}, a.size() * sizeof(float) - 1}) {
    std::vector<uint8_t> bad = img;
    bad[at + off] ^= 0x40;
    const std::string msg = error_of([&] { parse_npz(bad.data(), bad.size(), "bad.npz"); });
    EXPECT_THAT(msg, HasSubstr("bad.npz:a.npy")) << off;
    EXPECT_THAT(msg, HasSubstr("Bad CRC-32")) << off;
  }
  // The same through the file reader, as `kda run --input` reads it.
  const auto dir = kda::testing::make_temp_dir("npz_crc");
  img[at + 5] ^= 1;
  dump(dir / "bad.npz", img);
  EXPECT_THAT(error_of([&] { read_npz(dir / "bad.npz"); }), HasSubstr((dir / "bad.npz").string() + ":a.npy"));
}

TEST(NpzCrc, AFlippedByteInADeflatedMemberIsRefusedNamingTheMember) {
  // np.savez_compressed's archive (tests/fuzz/npz/deflated.npz): members "out" and "g", deflated.
  const std::vector<uint8_t> img = slurp(fs::path(KDA_TEST_DATA_DIR) / "../fuzz/npz/deflated.npz");
  ASSERT_GT(img.size(), 100u);
  ASSERT_NO_THROW(parse_npz(img.data(), img.size(), "ok.npz"));
  // The first member's compressed data starts after its local header (30 bytes + name + extra).
  ASSERT_EQ(le32(img, 0), 0x04034b50u);
  const size_t name_len = img[26] | img[27] << 8, extra_len = img[28] | img[29] << 8;
  const std::string name(img.begin() + 30, img.begin() + 30 + static_cast<long>(name_len));
  const size_t data = 30 + name_len + extra_len;
  for (size_t off = 0; off < 8; ++off) {
    std::vector<uint8_t> bad = img;
    bad[data + off] ^= 0x10;
    EXPECT_THAT(error_of([&] { parse_npz(bad.data(), bad.size(), "bad.npz"); }), HasSubstr("bad.npz:" + name))
        << off;
  }
}

TEST(NpzCrc, SizesThatDisagreeWithTheDataAreRefusedNamingTheMember) {
  std::vector<float> a;
  const std::vector<uint8_t> img = two_member_npz(a);
  // The central directory entry of a.npy: its compressed (offset 20) and uncompressed (24) sizes.
  const uint8_t sig[4] = {0x50, 0x4b, 0x01, 0x02};
  const size_t cd = find_bytes(img, sig, 4);
  ASSERT_NE(cd, std::string::npos);
  ASSERT_EQ(std::string(img.begin() + static_cast<long>(cd) + 46, img.begin() + static_cast<long>(cd) + 51),
            "a.npy");
  const uint32_t size = le32(img, cd + 24);
  for (uint32_t declared : {size - 4, size + 4}) {
    std::vector<uint8_t> bad = img;
    put_le32(bad, cd + 20, declared);
    put_le32(bad, cd + 24, declared);
    EXPECT_THAT(error_of([&] { parse_npz(bad.data(), bad.size(), "bad.npz"); }), HasSubstr("bad.npz:a.npy"))
        << declared;
  }
  // A stored member whose two sizes differ.
  std::vector<uint8_t> bad = img;
  put_le32(bad, cd + 24, size + 1);
  EXPECT_THAT(error_of([&] { parse_npz(bad.data(), bad.size(), "bad.npz"); }), HasSubstr("bad.npz:a.npy"));
  // A size beyond the archive: libzip refuses it when opening.
  put_le32(bad, cd + 20, 0x7fffffffu);
  put_le32(bad, cd + 24, 0x7fffffffu);
  EXPECT_THAT(error_of([&] { parse_npz(bad.data(), bad.size(), "bad.npz"); }), HasSubstr("bad.npz"));

  // A deflated member declaring more than deflate can expand its compressed bytes to is refused before
  // anything is allocated from the size (local and central header agree, so libzip opens it).
  std::vector<uint8_t> deflated = slurp(fs::path(KDA_TEST_DATA_DIR) / "../fuzz/npz/deflated.npz");
  const size_t dcd = find_bytes(deflated, sig, 4);
  ASSERT_NE(dcd, std::string::npos);
  ASSERT_EQ(le32(deflated, dcd + 20), le32(deflated, 18));  // no zip64: the sizes are in the headers
  const uint32_t huge = le32(deflated, dcd + 20) * 2000;
  put_le32(deflated, 22, huge);
  put_le32(deflated, dcd + 24, huge);
  EXPECT_THAT(error_of([&] { parse_npz(deflated.data(), deflated.size(), "big.npz"); }),
              HasSubstr("more than deflate can expand"));
}

// The wrong kinds of file where an input is expected: each refused, naming the path.
struct WrongKinds {
  fs::path dir, empty, text, truncated, folder, fifo;
};
WrongKinds make_wrong_kinds(const std::string& tag) {
  WrongKinds w;
  w.dir = kda::testing::make_temp_dir(tag);
  w.empty = w.dir / "empty.npz";
  dump(w.empty, {});
  w.text = w.dir / "text.npz";
  const std::string t = "this is a text file, not an archive\n";
  dump(w.text, std::vector<uint8_t>(t.begin(), t.end()));
  std::vector<float> a;
  std::vector<uint8_t> img = two_member_npz(a);
  img.resize(img.size() / 2);
  w.truncated = w.dir / "truncated.npz";
  dump(w.truncated, img);
  w.folder = w.dir / "folder.npz";
  fs::create_directory(w.folder);
  w.fifo = w.dir / "fifo.npz";
  EXPECT_EQ(::mkfifo(w.fifo.c_str(), 0600), 0);
  return w;
}

TEST(BadInput, EveryReaderRefusesEmptyTruncatedTextDirectoryAndFifo) {
  const WrongKinds w = make_wrong_kinds("bad_kinds");
  for (const fs::path& p : {w.empty, w.text, w.truncated, w.folder, w.fifo}) {
    EXPECT_THAT(error_of([&] { read_npz(p); }), HasSubstr(p.string())) << p;
    EXPECT_THAT(error_of([&] { read_npy(p); }), HasSubstr(p.string())) << p;
    EXPECT_THAT(error_of([&] { SafetensorsFile f(p); }), HasSubstr(p.string())) << p;
    EXPECT_THAT(error_of([&] { load_config(p); }), HasSubstr(p.string())) << p;
    EXPECT_THAT(error_of([&] { serving::load_trace(p); }), HasSubstr(p.string())) << p;
  }
  EXPECT_THAT(error_of([&] { read_npz(w.folder); }), HasSubstr("is a directory"));
  EXPECT_THAT(error_of([&] { read_npz(w.fifo); }), HasSubstr("FIFO"));
  EXPECT_THAT(error_of([&] { read_npz(w.empty); }), HasSubstr("empty file"));
  // A checkpoint folder whose config.json / model.safetensors is a FIFO or a folder: refused, not hung.
  const fs::path ck = w.dir / "ckpt";
  fs::create_directory(ck);
  ASSERT_EQ(::mkfifo((ck / "config.json").c_str(), 0600), 0);
  fs::create_directory(ck / "model.safetensors");
  EXPECT_THAT(error_of([&] { load_config(ck); }), HasSubstr("FIFO"));
  EXPECT_THAT(error_of([&] { Checkpoint c(ck); }), HasSubstr("is a directory"));
}

TEST(AtomicOutput, ReplacesWholeOrLeavesTheOldFileAndNoTemporary) {
  const auto dir = kda::testing::make_temp_dir("atomic_out");
  const fs::path out = dir / "out.npz";
  std::vector<float> a;
  const std::vector<uint8_t> first = two_member_npz(a);
  write_file_atomic(out, first.data(), first.size());
  EXPECT_EQ(slurp(out), first);
  EXPECT_EQ(names_in(dir), std::vector<std::string>{"out.npz"});
  // Permissions as a plain create gives them (the umask), not the 0600 of a temporary file.
  const mode_t mask = ::umask(0);
  ::umask(mask);
  EXPECT_EQ(fs::status(out).permissions(), static_cast<fs::perms>(0666 & ~mask));

  // A write that fails part-way (an array whose bytes do not match its shape) leaves the old file.
  NpzArchive bad;
  bad["x"] = NpyArray::from_f32({2}, a.data());
  bad["y"].shape = {5};  // float32 [5] with no bytes
  EXPECT_THAT(error_of([&] { write_npz(out, bad); }), HasSubstr("byte size"));
  EXPECT_EQ(slurp(out), first);
  EXPECT_EQ(names_in(dir), std::vector<std::string>{"out.npz"});

  // An output path that is a directory, or in a folder that does not exist: refused, nothing created.
  fs::create_directory(dir / "sub");
  EXPECT_THAT(error_of([&] { write_npz(dir / "sub", {}); }), HasSubstr("is a directory"));
  EXPECT_THAT(error_of([&] { write_npy(dir / "absent" / "x.npy", bad["x"]); }), HasSubstr("absent"));
  EXPECT_EQ(names_in(dir), (std::vector<std::string>{"out.npz", "sub"}));
  EXPECT_TRUE(fs::is_empty(dir / "sub"));

  // Each writer goes through it and reads back.
  write_npy(dir / "x.npy", bad["x"]);
  EXPECT_EQ(read_npy(dir / "x.npy").to_f32(), std::vector<float>(a.begin(), a.begin() + 2));
  write_safetensors(dir / "w.safetensors", {{"w", StTensor{{2}, {1.5f, -2.0f}, StDType::F32}}});
  EXPECT_EQ(Checkpoint(dir / "w.safetensors").load_f32("w", {2}), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(names_in(dir), (std::vector<std::string>{"out.npz", "sub", "w.safetensors", "x.npy"}));
}

TEST(SafetensorsIndex, ShardNamesStayInsideTheCheckpoint) {
  const auto ok =
      parse_safetensors_index(R"({"weight_map": {"a": "m-1.safetensors", "b": "sub/m.st"}})", "i");
  EXPECT_EQ(ok.at("b"), "sub/m.st");
  for (const char* shard : {"/etc/passwd", "../m.safetensors", "sub/../../m", "m\\u0000.safetensors"}) {
    const std::string text = std::string(R"({"weight_map": {"a": ")") + shard + "\"}}";
    EXPECT_THAT(error_of([&] { parse_safetensors_index(text, "idx.json"); }),
                HasSubstr("idx.json: weight_map entry for tensor 'a'"))
        << shard;
  }
}

// A value nested 300000 levels deep (600 KB of brackets) in each JSON input: refused with a message,
// not a stack overflow (nlohmann's dump() recursed once per level when an error message showed it).
TEST(BadInput, DeeplyNestedJsonIsRefusedWithoutOverflowingTheStack) {
  const size_t depth = 300000;
  const std::string deep = std::string(depth, '[') + std::string(depth, ']');
  EXPECT_THAT(error_of([&] { parse_config(R"({"model_type": )" + deep + "}", "cfg.json"); }),
              HasSubstr("cfg.json: field 'model_type' must be \"kimi_linear\", got a list of 1 element"));
  EXPECT_THAT(error_of([&] { serving::parse_trace("[" + deep + "]", "trace.json"); }),
              HasSubstr("trace.json: request 0 is not an object: a list of 1 element"));
  EXPECT_THAT(error_of([&] { serving::parse_trace(R"([{"output_len": )" + deep + "}]", "trace.json"); }),
              HasSubstr("field 'output_len' must be an integer, got a list of 1 element"));
  EXPECT_THAT(
      error_of([&] { parse_safetensors_index(R"({"weight_map": {"w": )" + deep + "}}", "idx.json"); }),
      HasSubstr("idx.json: weight_map entry for tensor 'w' is not a file name"));
  const std::string header = R"({"w": {"dtype": "F32", "data_offsets": [0, 0], "shape": )" + deep + "}}";
  // The 8-byte length, then the header (built in one pass: GCC 12 warns, wrongly, on an insert after
  // a vector of 8).
  std::vector<uint8_t> st;
  st.reserve(8 + header.size());
  for (int i = 0; i < 8; ++i)
    st.push_back(static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i)));
  for (const char c : header) st.push_back(static_cast<uint8_t>(c));
  EXPECT_THAT(
      error_of([&] { parse_safetensors(st.data(), st.size(), "deep.safetensors"); }),
      HasSubstr("deep.safetensors: tensor 'w': shape a list of 1 element holds something other than"));
}

// Lengths whose sums would overflow or whose buffers would ask for terabytes: a trace, a generated
// workload and a workload given as it is are refused before any request is allocated, naming the request
// and the field; the bounds themselves are served.
TEST(BadInput, HugeWorkloadLengthsAreRefusedNamingTheRequest) {
  using serving::kMaxRequestTokens;
  const std::string max = std::to_string(kMaxRequestTokens);
  EXPECT_THAT(
      error_of([] {
        serving::parse_trace(R"([{"prompt_len": 2147483647, "output_len": 5, "arrival_step": 0}])", "t.json");
      }),
      HasSubstr(
          "t.json: request 0: prompt_len + output_len is 2147483652 tokens, more than a request may have"));
  EXPECT_THAT(
      error_of([&] {
        serving::parse_trace(
            "[{\"prompt_len\": 4, \"output_len\": 0, \"arrival_step\": 0},"
            " {\"prompt_len\": " +
                max + ", \"output_len\": 1, \"arrival_step\": 0}]",
            "t.json");
      }),
      HasSubstr("t.json: request 1: prompt_len + output_len is " + std::to_string(kMaxRequestTokens + 1)));
  EXPECT_EQ(serving::parse_trace("[{\"prompt_len\": " + std::to_string(kMaxRequestTokens - 1) +
                                     ", \"output_len\": 1, \"arrival_step\": 0}]",
                                 "t.json")
                .size(),
            1u);
  // A session's turns add up.
  EXPECT_THAT(
      error_of([&] {
        serving::parse_trace("[{\"prompt_len\": " + std::to_string(kMaxRequestTokens / 2) +
                                 ", \"output_len\": 0, \"arrival_step\": 0, \"session\": 0, \"turn\": 0},"
                                 " {\"prompt_len\": " +
                                 std::to_string(kMaxRequestTokens / 2) +
                                 ", \"output_len\": 0, \"session\": 0, \"turn\": 1}]",
                             "t.json");
      }),
      HasSubstr("t.json: request 1: prompt_len + output_len is " + std::to_string(kMaxRequestTokens + 1)));

  // Generated: every request within the bound, and the whole workload within its own.
  serving::WorkloadOptions w;
  w.requests = 2;
  w.prompt = {kMaxRequestTokens, kMaxRequestTokens};
  w.output_len = 1;
  EXPECT_THAT(
      error_of([&] { serving::make_workload(w); }),
      HasSubstr("--prompt-len / --shared-prefix-len / --output-len: request 0: prompt_len + output_len is"));
  w.prompt = {kMaxRequestTokens - 1, kMaxRequestTokens - 1};
  w.requests = serving::kMaxWorkloadTokens / kMaxRequestTokens + 1;
  EXPECT_THAT(
      error_of([&] { serving::make_workload(w); }),
      HasSubstr("more than a workload may have (" + std::to_string(serving::kMaxWorkloadTokens) + ")"));
  w.kind = serving::WorkloadKind::kMultiTurn;
  w.requests = 1;
  w.turns = 3;
  w.prompt = {kMaxRequestTokens / 3, kMaxRequestTokens / 3};
  w.output_len = 0;
  EXPECT_THAT(error_of([&] { serving::make_workload(w); }), HasSubstr("--turns: request 2 (turn 2)"));

  // Given as it is.
  std::vector<serving::RequestSpec> reqs(1);
  reqs[0].prompt_len = static_cast<int32_t>(kMaxRequestTokens);
  reqs[0].output_len = 2147483647 - reqs[0].prompt_len;
  EXPECT_THAT(error_of([&] { serving::validate_workload(reqs); }),
              HasSubstr("request 0: prompt_len + output_len is 2147483647 tokens"));
}

// A verify row of INT32_MAX drafts would run INT32_MAX + 1 tokens: refused, not wrapped.
TEST(BadInput, AVerifyRowWhoseTokenCountOverflowsIsRefused) {
  EXPECT_THAT(error_of([] {
                model_executor::ForwardBatch::target_verify({0, 1}, {2, 2147483647});
              }),
              HasSubstr("ForwardBatch::target_verify: row 1 has 2147483647 drafts"));
  EXPECT_EQ(model_executor::ForwardBatch::target_verify({0}, {2147483646}).extend_seq_lens[0], 2147483647);
}

}  // namespace
}  // namespace kda::io
