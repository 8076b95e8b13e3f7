// Memory-mapped safetensors checkpoints: one file, or shards listed by model.safetensors.index.json.
//
// The header is validated when a file is opened: JSON well formed, dtype known (F32, BF16, F16), every
// tensor's byte range inside the file's data section, byte size == dtype size x product(shape), and no
// two tensors overlapping. Errors (std::runtime_error) name the file and the tensor.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "kda/common/bf16.h"

namespace kda::io {

enum class StDType { F32, BF16, F16 };
const char* to_string(StDType t);

struct TensorView {
  std::string name;
  StDType dtype = StDType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // inside the mapping; valid while the file is open
  size_t nbytes = 0;
  int64_t numel() const;
};

// A parsed and validated safetensors header; the views point into the image it was parsed from.
struct SafetensorsHeader {
  std::map<std::string, TensorView> tensors;
  std::map<std::string, std::string> metadata;
};
// Parses the image [data, data + size) of a .safetensors file (the 8-byte length, the JSON header, the
// data section) with the checks above; `what` names it in errors. SafetensorsFile maps a file and
// calls this.
SafetensorsHeader parse_safetensors(const uint8_t* data, size_t size, const std::string& what);

// model.safetensors.index.json's "weight_map": tensor name -> shard file name (relative, inside the
// checkpoint's folder). Throws std::runtime_error naming `what` and the entry.
std::map<std::string, std::string> parse_safetensors_index(const std::string& json_text,
                                                           const std::string& what);

// One mapped .safetensors file.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const TensorView* find(const std::string& name) const;  // null when absent
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors (name -> {shape, values, dtype stored}) as one .safetensors file, tensors in name order;
// BF16 stores each value rounded to nearest even. Used to make checkpoints for tests and tools; throws
// std::runtime_error when a size is off, the dtype is F16 (not written), or the file cannot be written.
struct StTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
  StDType dtype = StDType::F32;
};
void write_safetensors(const std::filesystem::path& path, const std::map<std::string, StTensor>& tensors);

// A checkpoint: a directory holding model.safetensors or model.safetensors.index.json (shards mapped
// lazily, only when one of their tensors is asked for), or a path to a single .safetensors file.
class Checkpoint {
 public:
  explicit Checkpoint(const std::filesystem::path& dir_or_file);
  ~Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  bool contains(const std::string& name) const;
  // Throws std::runtime_error "missing tensor '<name>' in <checkpoint>" when absent.
  const TensorView& get(const std::string& name) const;

  // Converting loads (F32/BF16/F16 -> fp32 or bf16). `expected_shape` must match exactly, else a
  // std::runtime_error names the tensor, its shape and the expected one.
  std::vector<float> load_f32(const std::string& name, const std::vector<int64_t>& expected_shape) const;
  // The slice [begin, end) of dimension `dim` (after checking the full shape), converted to fp32;
  // only the slice's bytes are read from the mapping (tensor-parallel ranks load their shards).
  std::vector<float> load_f32_slice(const std::string& name, const std::vector<int64_t>& expected_shape,
                                    int dim, int64_t begin, int64_t end) const;
  std::vector<bf16_t> load_bf16(const std::string& name, const std::vector<int64_t>& expected_shape) const;

  const std::filesystem::path& root() const { return root_; }

  // Every tensor name of the checkpoint (sorted), and the shard file holding `name` ("" for a
  // single-file checkpoint; std::runtime_error when absent).
  std::vector<std::string> names() const;
  std::string shard_of(const std::string& name) const;
  // Unmaps a shard of a sharded checkpoint (it is mapped again if a tensor of it is asked for later),
  // so that a loader's resident set does not keep every shard it has read. Views from get() into that
  // shard become invalid. No-op for a shard not mapped, and for a single-file checkpoint.
  void release_shard(const std::string& shard);
  // Names get() (and every load) was asked for since construction: a loader lists the unused rest.
  std::vector<std::string> accessed() const;

 private:
  const SafetensorsFile& file_for(const std::string& shard) const;
  std::filesystem::path root_;
  std::map<std::string, std::string> weight_map_;  // tensor -> shard file name (sharded)
  mutable std::mutex files_mu_;  // guards files_: shards are mapped lazily from const methods
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  mutable std::mutex accessed_mu_;
  mutable std::set<std::string> accessed_;
};

}  // namespace kda::io
