#include "targets.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/io/config.h"
#include "kda/io/npy.h"
#include "kda/io/safetensors.h"
#include "kda/serving/trace.h"
#include "kda/tokenizer/tokenizer.h"
#include "kda/tokenizer/utf8.h"

namespace kda::fuzz {

namespace {

// A broken invariant on an accepted input: abort, so that libFuzzer keeps the input as a crash.
#define KDA_FUZZ_CHECK(cond)                                                                       \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      std::fprintf(stderr, "kda fuzz: invariant failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                                \
    }                                                                                              \
  } while (0)

// Runs a parse; its own errors are a refusal, any other exception escapes to the caller.
template <class F>
bool refused_cleanly(F&& f) {
  try {
    f();
    return true;
  } catch (const std::invalid_argument&) {
    return false;
  } catch (const std::out_of_range&) {
    throw;  // a logic_error but not a parser's message: let it escape
  } catch (const std::runtime_error&) {
    return false;
  }
}

std::string as_text(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

// Touches every element an accepted array claims, through the converting loaders.
void convert_all(const io::NpyArray& a) {
  try {
    const auto f = a.to_f32();
    KDA_FUZZ_CHECK(static_cast<int64_t>(f.size()) == a.numel());
  } catch (const std::invalid_argument&) {
  }
  try {
    const auto i = a.to_i32();
    KDA_FUZZ_CHECK(static_cast<int64_t>(i.size()) == a.numel());
  } catch (const std::invalid_argument&) {  // not an integer dtype
  } catch (const std::out_of_range&) {      // an int64 value beyond int32
  }
}

bool same(const io::NpyArray& a, const io::NpyArray& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes;
}

}  // namespace

bool npy(const uint8_t* data, size_t size) {
  return refused_cleanly([&] {
    const io::NpyArray a = io::parse_npy(data, size, "fuzz.npy");
    convert_all(a);
    // What was accepted writes back and reads back as the same array.
    const std::vector<uint8_t> img = io::serialize_npy(a);
    KDA_FUZZ_CHECK(same(io::parse_npy(img.data(), img.size(), "round trip"), a));
  });
}

bool npz(const uint8_t* data, size_t size) {
  return refused_cleanly([&] {
    const io::NpzArchive z = io::parse_npz(data, size, "fuzz.npz");
    for (const auto& [key, a] : z) convert_all(a);
    const std::vector<uint8_t> img = io::serialize_npz(z);
    const io::NpzArchive back = io::parse_npz(img.data(), img.size(), "round trip");
    KDA_FUZZ_CHECK(back.size() == z.size());
    for (const auto& [key, a] : z) KDA_FUZZ_CHECK(back.count(key) && same(back.at(key), a));
  });
}

bool safetensors(const uint8_t* data, size_t size) {
  return refused_cleanly([&] {
    const io::SafetensorsHeader h = io::parse_safetensors(data, size, "fuzz.safetensors");
    // Every view lies inside the image: read each byte (ASan reports a view that does not).
    unsigned sum = 0;
    for (const auto& [name, v] : h.tensors) {
      KDA_FUZZ_CHECK(v.data >= data && v.data + v.nbytes <= data + size);
      for (size_t i = 0; i < v.nbytes; ++i) sum += v.data[i];
      KDA_FUZZ_CHECK(v.numel() >= 0);
    }
    (void)sum;
  });
}

bool safetensors_index(const uint8_t* data, size_t size) {
  return refused_cleanly([&] {
    const auto m = io::parse_safetensors_index(as_text(data, size), "fuzz.index.json");
    for (const auto& [tensor, shard] : m)
      KDA_FUZZ_CHECK(!shard.empty() && shard.find('\0') == std::string::npos);
  });
}

bool config(const uint8_t* data, size_t size) {
  return refused_cleanly([&] {
    const io::KimiLinearConfig c = io::parse_config(as_text(data, size), "fuzz.config.json");
    KDA_FUZZ_CHECK(c.hidden_size > 0 && c.num_heads > 0 && c.head_dim > 0 && c.projection_size() > 0);
    // Within the bounds, so that the sizes derived from an accepted config cannot overflow.
    KDA_FUZZ_CHECK(c.hidden_size <= io::kMaxHiddenSize && c.num_heads <= io::kMaxHeads &&
                   c.head_dim <= io::kMaxHeadDim && c.short_conv_kernel_size <= io::kMaxConvKernel &&
                   c.num_hidden_layers <= io::kMaxHiddenLayers &&
                   c.hidden_size * c.projection_size() <= io::kMaxProjectionElements);
    for (int id : c.kda_layer_ids()) KDA_FUZZ_CHECK(id >= 0 && id < c.num_hidden_layers);
    // The whole decoder's reading of the same text: refused cleanly, or every layer is KDA or MLA and
    // the MoE's top-k fits its experts.
    try {
      const io::KimiLinearConfig m = io::parse_model_config(as_text(data, size), "fuzz.config.json");
      for (int i = 0; i < m.num_hidden_layers; ++i) KDA_FUZZ_CHECK(m.is_kda_layer(i) != m.is_mla_layer(i));
      KDA_FUZZ_CHECK(m.num_experts == 0 ||
                     (m.num_experts_per_token >= 1 && m.num_experts_per_token <= m.num_experts));
      KDA_FUZZ_CHECK(m.vocab_size > 0 && m.vocab_size <= io::kMaxVocab);
    } catch (const std::runtime_error&) {
    }
  });
}

bool trace(const uint8_t* data, size_t size) {
  // vocab 1000 exercises the id range check; vocab 0 skips it.
  const std::string text = as_text(data, size);
  std::vector<serving::RequestSpec> reqs;
  if (!refused_cleanly([&] { reqs = serving::parse_trace(text, "fuzz.trace.json", 1000); })) return false;
  // A trace the parser accepts is a workload the engine accepts: parse_trace's errors come before
  // any work, so validate_workload must not find another.
  try {
    serving::validate_workload(reqs, 1000);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda fuzz: parse_trace accepted what validate_workload refuses: %s\n", e.what());
    std::abort();
  }
  KDA_FUZZ_CHECK(serving::parse_trace(text, "again", 0).size() == reqs.size());
  return true;
}

bool tokenizer_text(const uint8_t* data, size_t size) {
  // A vocabulary with merges and Kimi's special tokens; built once.
  static const tokenizer::Tokenizer tok = tokenizer::Tokenizer::synthetic(4096, 1);
  const std::string text(reinterpret_cast<const char*>(data), size);
  // The bytes as single-byte tokens through the streaming decoder: always valid UTF-8, the same text as
  // decoding the whole buffer at once, and the text itself when the bytes are valid.
  tokenizer::StreamDecoder sd(tok);
  std::string streamed;
  for (size_t i = 0; i < size; ++i) {
    const std::string piece = sd.push(data[i]);  // synthetic(): rank b is the byte b
    KDA_FUZZ_CHECK(tokenizer::utf8_invalid_offset(piece) == std::string::npos);
    streamed += piece;
  }
  streamed += sd.flush();
  std::string whole;
  tokenizer::utf8_decode_replace(text, whole, /*final=*/true);
  KDA_FUZZ_CHECK(streamed == whole);
  std::vector<int32_t> ids;
  if (!refused_cleanly([&] { ids = tok.encode(text); })) {
    KDA_FUZZ_CHECK(tokenizer::utf8_invalid_offset(text) != std::string::npos);
    return false;
  }
  KDA_FUZZ_CHECK(streamed == text);
  KDA_FUZZ_CHECK(tok.decode(ids) == text);
  const auto plain = tok.encode(text, /*allow_special=*/false);
  for (int32_t id : plain) KDA_FUZZ_CHECK(!tok.is_special(id));
  KDA_FUZZ_CHECK(tok.decode_bytes(plain) == text);
  return true;
}

}  // namespace kda::fuzz
