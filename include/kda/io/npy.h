// NumPy .npy (v1.0/v2.0, little-endian, C order) and .npz (zip of .npy members, stored or deflated)
// reading and writing. The dumps and the CLI's inputs and outputs use these.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace kda::io {

enum class NpyDType { F32, F64, F16, I32, I64, U8, Bool };

const char* to_string(NpyDType t);
size_t dtype_size(NpyDType t);

struct NpyArray {
  NpyDType dtype = NpyDType::F32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // raw little-endian element data, C order

  int64_t numel() const;
  // Converting copies; throw std::invalid_argument when the dtype cannot convert (e.g. float -> int).
  std::vector<float> to_f32() const;
  std::vector<int32_t> to_i32() const;

  static NpyArray from_f32(std::vector<int64_t> shape, const float* data);
  static NpyArray from_i32(std::vector<int64_t> shape, const int32_t* data);
};

// An ordered name -> array map, as an .npz holds it (names without the ".npy" suffix).
using NpzArchive = std::map<std::string, NpyArray>;

// Parse / serialise one .npy image. Errors (std::runtime_error) name the file or member.
NpyArray parse_npy(const uint8_t* data, size_t size, const std::string& what);
std::vector<uint8_t> serialize_npy(const NpyArray& a);

// Parse / serialise one .npz image (a zip of .npy members, stored or deflated). Every member's sizes and
// CRC-32 are checked as it is read; errors (std::runtime_error) name the file and the member.
NpzArchive parse_npz(const uint8_t* data, size_t size, const std::string& what);
std::vector<uint8_t> serialize_npz(const NpzArchive& arrays);

// Reads accept regular files only; writes are atomic (kda/io/file.h): a temporary file beside `path`,
// renamed over it when complete, so `path` never holds a partial file.
NpyArray read_npy(const std::filesystem::path& path);
void write_npy(const std::filesystem::path& path, const NpyArray& a);

NpzArchive read_npz(const std::filesystem::path& path);
void write_npz(const std::filesystem::path& path, const NpzArchive& arrays);

}  // namespace kda::io
