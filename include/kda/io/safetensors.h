// Memory-mapped safetensors checkpoints: one file, or shards listed by model.safetensors.index.json.
//
// The header is validated when a file is opened: JSON well formed, dtype known (F32, BF16, F16, and the
// raw bytes I8 / U8 of packed checkpoints, kda quantize), every
// tensor's byte range inside the file's data section, byte size == dtype size x product(shape), and no
// two tensors overlapping. Errors (std::runtime_error) name the file and the tensor.
#pragma once

#include <cstddef>
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

// I8 / U8 hold packed weights (io/packed_checkpoint.h): read in place, never converted to floats.
enum class StDType { F32, BF16, F16, I8, U8 };
const char* to_string(StDType t);
size_t dtype_size(StDType t);

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
// Its "metadata" object (values as strings; a number is written out) into *metadata when given.
std::map<std::string, std::string> parse_safetensors_index(
    const std::string& json_text, const std::string& what,
    std::map<std::string, std::string>* metadata = nullptr);

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

// Writes tensors given as raw bytes in their stored dtype (any, F16 and I8 / U8 included) with
// `metadata` as __metadata__, as one .safetensors file, atomically. The data section starts 64-byte
// aligned and the tensors are laid out without gaps, those whose size is a multiple of 64 bytes first
// (each stays 64-byte aligned), then by element size (each stays aligned to it), so that the kernels
// read a mapped tensor in place. Throws std::runtime_error when a size disagrees with dtype and shape,
// a name repeats, or the file cannot be written.
struct StRawTensor {
  std::string name;
  StDType dtype = StDType::U8;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;
};
void write_safetensors_raw(const std::filesystem::path& path, const std::vector<StRawTensor>& tensors,
                           const std::map<std::string, std::string>& metadata);

// Bytes of a read-only file mapping that the caller read in place and is done with: their whole pages leave
// the resident set, as a converting load's do (clean pages: read again, they come back from the file).
// For a tensor whose shard stays mapped for others used in place (a packed checkpoint's).
void drop_resident(const void* data, size_t nbytes);

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
  // std::runtime_error names the tensor, its shape and the expected one; so does a packed (I8 / U8)
  // tensor, which has no float values.
  std::vector<float> load_f32(const std::string& name, const std::vector<int64_t>& expected_shape) const;
  // The slice [begin, end) of dimension `dim` (after checking the full shape), converted to fp32;
  // only the slice's bytes are read from the mapping (tensor-parallel ranks load their shards).
  std::vector<float> load_f32_slice(const std::string& name, const std::vector<int64_t>& expected_shape,
                                    int dim, int64_t begin, int64_t end) const;
  // The same into `out`, resized (its storage reused when large enough: a loader's block after block).
  void load_f32_slice_into(const std::string& name, const std::vector<int64_t>& expected_shape, int dim,
                           int64_t begin, int64_t end, std::vector<float>& out) const;
  std::vector<bf16_t> load_bf16(const std::string& name, const std::vector<int64_t>& expected_shape) const;

  const std::filesystem::path& root() const { return root_; }
  // The checkpoint's metadata: model.safetensors.index.json's "metadata", or the single file's
  // __metadata__.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The mapped file holding `name` (mapping its shard if needed): a view into it stays valid while the
  // returned pointer lives, even after release_shard() or the checkpoint's end. Throws like get().
  std::shared_ptr<const SafetensorsFile> file_of(const std::string& name) const;

  // Every tensor name of the checkpoint (sorted), and the shard file holding `name` ("" for a
  // single-file checkpoint; std::runtime_error when absent).
  std::vector<std::string> names() const;
  std::string shard_of(const std::string& name) const;
  // Unmaps a shard of a sharded checkpoint (it is mapped again if a tensor of it is asked for later),
  // so that a loader's resident set does not keep every shard it has read. Views from get() into that
  // shard become invalid unless a file_of() pointer keeps it mapped. No-op for a shard not mapped, and
  // for a single-file checkpoint.
  void release_shard(const std::string& shard);
  // Names get() (and every load) was asked for since construction: a loader lists the unused rest.
  std::vector<std::string> accessed() const;

 private:
  std::shared_ptr<const SafetensorsFile> file_for(const std::string& shard) const;
  std::filesystem::path root_;
  std::map<std::string, std::string> weight_map_;  // tensor -> shard file name (sharded)
  std::map<std::string, std::string> metadata_;
  mutable std::mutex files_mu_;  // guards files_: shards are mapped lazily from const methods
  // Shared: packed weights borrowed from a mapping keep their file mapped (file_of()).
  mutable std::map<std::string, std::shared_ptr<const SafetensorsFile>> files_;
  mutable std::mutex accessed_mu_;
  mutable std::set<std::string> accessed_;
};

}  // namespace kda::io
