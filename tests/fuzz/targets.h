// The fuzz targets' bodies: one per parser of outside input, each feeding bytes through the same entry
// point the file-reading path calls. Shared by the libFuzzer binaries (fuzz_<name>.cc, KDA_FUZZ=ON) and
// the regression test (tests/test_fuzz_regressions.cc), which replays every seed and every input that
// ever broke a target.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kda::fuzz {

// Returns true when the input was accepted, false when it was refused with the parser's own error
// (std::runtime_error or std::invalid_argument naming what is wrong). Anything else escapes: another
// exception type (a JSON library's type_error, std::out_of_range, std::bad_alloc, ...) is a bug the
// fuzzer reports as a crash, and so is a broken round trip of an accepted input.
bool npy(const uint8_t* data, size_t size);
bool npz(const uint8_t* data, size_t size);
bool safetensors(const uint8_t* data, size_t size);
bool safetensors_index(const uint8_t* data, size_t size);
bool config(const uint8_t* data, size_t size);
bool trace(const uint8_t* data, size_t size);
// Text through the tokenizer: encode (invalid UTF-8 refused), decode round trips, the streaming decoder.
bool tokenizer_text(const uint8_t* data, size_t size);

struct Target {
  const char* name;  // the folder of its seeds: tests/fuzz/<name>/, regressions/<name>/
  bool (*run)(const uint8_t*, size_t);
};
inline constexpr Target kTargets[] = {
    {"npy", npy},
    {"npz", npz},
    {"safetensors", safetensors},
    {"safetensors_index", safetensors_index},
    {"config", config},
    {"trace", trace},
    {"tokenizer_text", tokenizer_text},
};

}  // namespace kda::fuzz
