#include "kda/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "kda/io/file.h"
#include "kda/io/json_brief.h"

namespace kda::io {

// Element bytes are reinterpreted in place; safetensors is little-endian, so the host must be too.
static_assert(std::endian::native == std::endian::little, "kda::io assumes a little-endian host");

namespace {

using nlohmann::json;

bool parse_st_dtype(const std::string& s, StDType& out) {
  for (StDType t : {StDType::F32, StDType::BF16, StDType::F16, StDType::I8, StDType::U8})
    if (s == to_string(t)) {
      out = t;
      return true;
    }
  return false;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// A non-negative JSON integer as uint64, or false.
bool json_uint(const json& j, uint64_t& out) {
  if (j.is_number_unsigned()) {
    out = j.get<uint64_t>();
    return true;
  }
  if (j.is_number_integer() && j.get<int64_t>() >= 0) {
    out = static_cast<uint64_t>(j.get<int64_t>());
    return true;
  }
  return false;
}

struct Range {
  uint64_t begin, end;
  const std::string* name;
};

}  // namespace

const char* to_string(StDType t) {
  switch (t) {
    case StDType::F32:
      return "F32";
    case StDType::BF16:
      return "BF16";
    case StDType::F16:
      return "F16";
    case StDType::I8:
      return "I8";
    case StDType::U8:
      return "U8";
  }
  return "?";
}

size_t dtype_size(StDType t) {
  switch (t) {
    case StDType::F32:
      return 4;
    case StDType::BF16:
    case StDType::F16:
      return 2;
    case StDType::I8:
    case StDType::U8:
      return 1;
  }
  return 1;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsHeader parse_safetensors(const uint8_t* base, size_t size, const std::string& file) {
  auto fail = [&](const std::string& problem) -> void { throw std::runtime_error(file + ": " + problem); };
  if (size < 8) fail("file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");

  SafetensorsHeader out;
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | base[i];
  if (header_len > size - 8)
    fail("header length " + std::to_string(header_len) + " is larger than the file (" + std::to_string(size) +
         " bytes): file truncated or not a safetensors file");
  const char* text = reinterpret_cast<const char*>(base + 8);
  const uint8_t* data = base + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;

  json header;
  try {
    header = json::parse(text, text + header_len);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1E999
    fail(std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail("header is not a JSON object");

  std::vector<Range> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail("__metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) fail("__metadata__ value for '" + k + "' is not a string");
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "'";
    if (!entry.is_object()) fail(where + ": entry is not an object");

    TensorView view;
    view.name = name;
    const auto dt = entry.find("dtype");
    if (dt == entry.end() || !dt->is_string()) fail(where + ": missing or non-string dtype");
    if (!parse_st_dtype(dt->get<std::string>(), view.dtype))
      throw std::runtime_error("unknown dtype '" + dt->get<std::string>() + "' for " + where + " in " + file +
                               " (supported: F32, BF16, F16, I8, U8)");

    const auto sh = entry.find("shape");
    if (sh == entry.end() || !sh->is_array()) fail(where + ": missing or non-array shape");
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : *sh) {
      uint64_t v = 0;
      if (!json_uint(d, v) || v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail(where + ": shape " + json_brief(*sh) + " holds something other than a non-negative integer");
      view.shape.push_back(static_cast<int64_t>(v));
      overflow |= __builtin_mul_overflow(numel, v, &numel);
    }

    const auto off = entry.find("data_offsets");
    uint64_t begin = 0, end = 0;
    if (off == entry.end() || !off->is_array() || off->size() != 2 || !json_uint((*off)[0], begin) ||
        !json_uint((*off)[1], end))
      fail(where + ": data_offsets must be [begin, end] with non-negative integers");
    if (begin > end)
      fail(where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
           "] have begin > end");
    if (end > data_size)
      fail(where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
           "] point past the end of the file (data section is " + std::to_string(data_size) +
           " bytes): offsets past the end of the file");
    uint64_t expected = 0;
    overflow |= __builtin_mul_overflow(numel, dtype_size(view.dtype), &expected);
    if (overflow || end - begin != expected)
      fail(where + ": byte size " + std::to_string(end - begin) + " does not match dtype " +
           to_string(view.dtype) + " and shape " + shape_str(view.shape) +
           (overflow ? std::string(" (size overflows)") : " (" + std::to_string(expected) + " bytes)"));

    view.data = data + begin;
    view.nbytes = static_cast<size_t>(end - begin);
    auto [it, inserted] = out.tensors.emplace(name, std::move(view));
    (void)inserted;  // JSON object keys are unique
    ranges.push_back({begin, end, &it->first});
  }

  // Empty tensors occupy no bytes, so they cannot overlap anything.
  std::erase_if(ranges, [](const Range& r) { return r.begin == r.end; });
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].begin < ranges[i - 1].end)
      fail("tensors '" + *ranges[i - 1].name + "' and '" + *ranges[i].name + "' overlap (byte ranges [" +
           std::to_string(ranges[i - 1].begin) + ", " + std::to_string(ranges[i - 1].end) + ") and [" +
           std::to_string(ranges[i].begin) + ", " + std::to_string(ranges[i].end) + "))");
  return out;
}

std::map<std::string, std::string> parse_safetensors_index(const std::string& json_text,
                                                           const std::string& what,
                                                           std::map<std::string, std::string>* metadata) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1E999
    throw std::runtime_error(what + ": not valid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw std::runtime_error(what + ": missing or non-object \"weight_map\"");
  if (metadata && j.contains("metadata")) {
    if (!j["metadata"].is_object()) throw std::runtime_error(what + ": \"metadata\" is not an object");
    for (const auto& [k, v] : j["metadata"].items())
      (*metadata)[k] = v.is_string() ? v.get<std::string>() : v.dump();
  }
  std::map<std::string, std::string> weight_map;
  for (const auto& [tensor, shard] : j["weight_map"].items()) {
    if (!shard.is_string() || shard.get<std::string>().empty())
      throw std::runtime_error(what + ": weight_map entry for tensor '" + tensor + "' is not a file name");
    const std::string name = shard.get<std::string>();
    // A shard lives inside the checkpoint's folder: a NUL would cut the name short at open(), and an
    // absolute path or a '..' would read a file outside it.
    const std::filesystem::path p(name);
    const bool escapes =
        p.is_absolute() || std::any_of(p.begin(), p.end(), [](const auto& c) { return c == ".."; });
    if (name.find('\0') != std::string::npos || escapes)
      throw std::runtime_error(what + ": weight_map entry for tensor '" + tensor + "' names shard '" +
                               std::string(name.c_str()) +
                               "', which is not a file inside the checkpoint's folder");
    weight_map[tensor] = name;
  }
  return weight_map;
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : path_(path) {
  const std::string file = path.string();
  uint64_t size = 0;
  const int fd = open_regular_file(path, "safetensors file", size);
  if (size < 8) {
    ::close(fd);
    throw std::runtime_error(file + ": file is " + std::to_string(size) +
                             " bytes, shorter than the 8-byte header length");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) throw std::runtime_error(file + ": cannot mmap: " + std::strerror(map_errno));
  map_ = map;
  map_size_ = size;

  try {
    SafetensorsHeader h = parse_safetensors(static_cast<const uint8_t*>(map_), map_size_, file);
    tensors_ = std::move(h.tensors);
    metadata_ = std::move(h.metadata);
  } catch (...) {
    ::munmap(map_, map_size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

const TensorView* SafetensorsFile::find(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, view] : tensors_) out.push_back(name);
  return out;
}

Checkpoint::Checkpoint(const std::filesystem::path& dir_or_file) : root_(dir_or_file) {
  namespace fs = std::filesystem;
  if (fs::is_directory(root_)) {
    const fs::path index = root_ / "model.safetensors.index.json";
    if (fs::exists(index)) {
      const std::string what = index.string();
      weight_map_ = parse_safetensors_index(read_regular_text(index, "index file"), what, &metadata_);
      // Check shards exist now, but map them only when used.
      for (const auto& [tensor, shard] : weight_map_)
        if (!fs::is_regular_file(root_ / shard))
          throw std::runtime_error(what + ": shard '" + shard + "' (holding tensor '" + tensor +
                                   "') does not exist in " + root_.string());
      return;
    }
    const fs::path single = root_ / "model.safetensors";
    if (!fs::exists(single))
      throw std::runtime_error(root_.string() +
                               ": checkpoint directory holds neither model.safetensors nor "
                               "model.safetensors.index.json");
    files_.emplace("model.safetensors", std::make_shared<const SafetensorsFile>(single));
  } else {
    if (!fs::exists(root_)) throw std::runtime_error(root_.string() + ": checkpoint path does not exist");
    files_.emplace(root_.filename().string(), std::make_shared<const SafetensorsFile>(root_));
  }
  metadata_ = files_.begin()->second->metadata();
}

Checkpoint::~Checkpoint() = default;

std::shared_ptr<const SafetensorsFile> Checkpoint::file_for(const std::string& shard) const {
  std::lock_guard<std::mutex> lock(files_mu_);
  auto it = files_.find(shard);
  if (it == files_.end())
    it = files_.emplace(shard, std::make_shared<const SafetensorsFile>(root_ / shard)).first;
  return it->second;
}

std::shared_ptr<const SafetensorsFile> Checkpoint::file_of(const std::string& name) const {
  if (weight_map_.empty()) {
    if (!contains(name)) throw std::runtime_error("missing tensor '" + name + "' in " + root_.string());
    return files_.begin()->second;
  }
  return file_for(shard_of(name));
}

bool Checkpoint::contains(const std::string& name) const {
  if (weight_map_.empty()) {
    // Single-file checkpoints are mapped in the constructor and never change.
    return !files_.empty() && files_.begin()->second->find(name) != nullptr;
  }
  return weight_map_.count(name) != 0;
}

const TensorView& Checkpoint::get(const std::string& name) const {
  {
    std::lock_guard<std::mutex> lock(accessed_mu_);
    accessed_.insert(name);
  }
  if (weight_map_.empty()) {
    const TensorView* v = files_.empty() ? nullptr : files_.begin()->second->find(name);
    if (!v) throw std::runtime_error("missing tensor '" + name + "' in " + root_.string());
    return *v;
  }
  const auto it = weight_map_.find(name);
  if (it == weight_map_.end()) throw std::runtime_error("missing tensor '" + name + "' in " + root_.string());
  // The checkpoint keeps the shard mapped until release_shard(), so the view outlives this pointer.
  const std::shared_ptr<const SafetensorsFile> f = file_for(it->second);
  const TensorView* v = f->find(name);
  if (!v)
    throw std::runtime_error("missing tensor '" + name + "' in " + f->path().string() + " (the index of " +
                             root_.string() + " lists it there)");
  return *v;
}

std::vector<std::string> Checkpoint::names() const {
  if (weight_map_.empty())
    return files_.empty() ? std::vector<std::string>{} : files_.begin()->second->names();
  std::vector<std::string> out;
  out.reserve(weight_map_.size());
  for (const auto& [name, shard] : weight_map_) out.push_back(name);
  return out;
}

std::string Checkpoint::shard_of(const std::string& name) const {
  if (weight_map_.empty()) {
    if (!contains(name)) throw std::runtime_error("missing tensor '" + name + "' in " + root_.string());
    return "";
  }
  const auto it = weight_map_.find(name);
  if (it == weight_map_.end()) throw std::runtime_error("missing tensor '" + name + "' in " + root_.string());
  return it->second;
}

void Checkpoint::release_shard(const std::string& shard) {
  if (weight_map_.empty()) return;
  std::lock_guard<std::mutex> lock(files_mu_);
  files_.erase(shard);
}

std::vector<std::string> Checkpoint::accessed() const {
  std::lock_guard<std::mutex> lock(accessed_mu_);
  return {accessed_.begin(), accessed_.end()};
}

namespace {

const TensorView& check_shape(const TensorView& v, const std::vector<int64_t>& expected) {
  if (v.dtype == StDType::I8 || v.dtype == StDType::U8)
    throw std::runtime_error("tensor '" + v.name + "' holds packed " + to_string(v.dtype) +
                             " bytes, not float values (a packed checkpoint's projection: kda quantize)");
  if (v.shape != expected)
    throw std::runtime_error("tensor '" + v.name + "' has shape " + shape_str(v.shape) + " but " +
                             shape_str(expected) + " was expected");
  return v;
}

// The mapping may place a tensor at any byte offset, so elements are copied out rather than loaded.
uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace

namespace {

// Converts n consecutive elements starting at element `first` of a mapped tensor into fp32.
void convert_f32(const TensorView& v, size_t first, size_t n, float* out) {
  switch (v.dtype) {
    case StDType::F32:
      if (n) std::memcpy(out, v.data + 4 * first, n * sizeof(float));
      break;
    case StDType::BF16:
      for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(load_u16(v.data + 2 * (first + i)));
      break;
    case StDType::F16:
      for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32(load_u16(v.data + 2 * (first + i)));
      break;
    case StDType::I8:
    case StDType::U8:
      throw std::logic_error("convert_f32: packed bytes");  // check_shape refused them first
  }
}

// convert_f32 over n elements in chunks on the OpenMP threads when there are many (the LM head's blocks,
// an embedding table): a load converts what a packed checkpoint keeps converting, so its time is the
// mapped load's. The dtype was checked (check_shape); a chunk that throws all the same is rethrown after
// the loop, never out of the OpenMP region.
void convert_f32_parallel(const TensorView& v, size_t first, size_t n, float* out) {
  constexpr size_t kChunk = size_t{1} << 16;
  if (n < 16 * kChunk) return convert_f32(v, first, n, out);
  const auto chunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
  std::exception_ptr error;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    try {
      const size_t b = static_cast<size_t>(c) * kChunk;
      convert_f32(v, first + b, std::min(kChunk, n - b), out + b);
    } catch (...) {
#pragma omp critical(kda_convert_f32)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// A converting load has copied what it needs, so the tensor's whole pages of the read-only file mapping
// leave the resident set (they are clean: read again, they come back from the file). Loading a checkpoint
// tensor by tensor then holds one tensor's mapped pages at a time beside the weights built so far, not
// every tensor of the shards still open.
void drop_resident_pages(const TensorView& v) { drop_resident(v.data, v.nbytes); }

}  // namespace

void drop_resident(const void* data, size_t nbytes) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(data), end = begin + nbytes;
  const uintptr_t lo = (begin + page - 1) / page * page, hi = end / page * page;
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

std::vector<float> Checkpoint::load_f32(const std::string& name,
                                        const std::vector<int64_t>& expected_shape) const {
  const TensorView& v = check_shape(get(name), expected_shape);
  std::vector<float> out(static_cast<size_t>(v.numel()));
  convert_f32_parallel(v, 0, out.size(), out.data());
  drop_resident_pages(v);
  return out;
}

std::vector<float> Checkpoint::load_f32_slice(const std::string& name,
                                              const std::vector<int64_t>& expected_shape, int dim,
                                              int64_t begin, int64_t end) const {
  std::vector<float> out;
  load_f32_slice_into(name, expected_shape, dim, begin, end, out);
  return out;
}

void Checkpoint::load_f32_slice_into(const std::string& name, const std::vector<int64_t>& expected_shape,
                                     int dim, int64_t begin, int64_t end, std::vector<float>& out) const {
  const TensorView& v = check_shape(get(name), expected_shape);
  if (dim < 0 || dim >= static_cast<int>(v.shape.size()) || begin < 0 || end < begin || end > v.shape[dim])
    throw std::runtime_error("tensor '" + name + "' of shape " + shape_str(v.shape) + ": cannot take [" +
                             std::to_string(begin) + ", " + std::to_string(end) + ") of dimension " +
                             std::to_string(dim));
  // [outer, shape[dim], inner] -> [outer, end - begin, inner]: only the slice is read from the mapping.
  size_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= static_cast<size_t>(v.shape[d]);
  for (size_t d = dim + 1; d < v.shape.size(); ++d) inner *= static_cast<size_t>(v.shape[d]);
  const size_t run = static_cast<size_t>(end - begin) * inner,
               extent = static_cast<size_t>(v.shape[dim]) * inner;
  out.resize(outer * run);
  for (size_t o = 0; o < outer; ++o)
    convert_f32_parallel(v, o * extent + static_cast<size_t>(begin) * inner, run, out.data() + o * run);
  drop_resident_pages(v);
}

std::vector<bf16_t> Checkpoint::load_bf16(const std::string& name,
                                          const std::vector<int64_t>& expected_shape) const {
  const TensorView& v = check_shape(get(name), expected_shape);
  const size_t n = static_cast<size_t>(v.numel());
  std::vector<bf16_t> out(n);
  switch (v.dtype) {
    case StDType::F32:
      for (size_t i = 0; i < n; ++i) {
        float f;
        std::memcpy(&f, v.data + 4 * i, sizeof f);
        out[i] = f32_to_bf16(f);
      }
      break;
    case StDType::BF16:
      if (n) std::memcpy(out.data(), v.data, n * sizeof(bf16_t));
      break;
    case StDType::F16:
      // Every f16 value is exact in f32; the only rounding is f32 -> bf16.
      for (size_t i = 0; i < n; ++i) out[i] = f32_to_bf16(f16_to_f32(load_u16(v.data + 2 * i)));
      break;
    case StDType::I8:
    case StDType::U8:
      throw std::logic_error("load_bf16: packed bytes");  // check_shape refused them first
  }
  drop_resident_pages(v);
  return out;
}

void write_safetensors(const std::filesystem::path& path, const std::map<std::string, StTensor>& tensors) {
  json header = json::object();
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    if (n != static_cast<int64_t>(t.values.size()))
      throw std::runtime_error("write_safetensors: tensor '" + name + "' has " +
                               std::to_string(t.values.size()) + " values for shape " + shape_str(t.shape));
    if (t.dtype != StDType::F32 && t.dtype != StDType::BF16)
      throw std::runtime_error("write_safetensors: tensor '" + name + "': " + to_string(t.dtype) +
                               " is not written from floats (F32, BF16; write_safetensors_raw takes bytes)");
    const size_t bytes = t.values.size() * (t.dtype == StDType::F32 ? sizeof(float) : sizeof(bf16_t));
    header[name] = {
        {"dtype", to_string(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text += ' ';  // keeps the data section 8-byte aligned, as the format advises
  // Built in memory, then written atomically: a failed write leaves no partial checkpoint behind.
  const uint64_t n = text.size();
  std::vector<uint8_t> image(sizeof n + text.size() + offset);
  std::memcpy(image.data(), &n, sizeof n);
  std::memcpy(image.data() + sizeof n, text.data(), text.size());
  uint8_t* at = image.data() + sizeof n + text.size();
  for (const auto& [name, t] : tensors) {
    if (t.dtype == StDType::F32) {
      if (!t.values.empty()) std::memcpy(at, t.values.data(), t.values.size() * sizeof(float));
      at += t.values.size() * sizeof(float);
    } else {
      std::vector<bf16_t> b(t.values.size());
      f32_to_bf16_array(t.values.data(), b.data(), b.size());
      if (!b.empty()) std::memcpy(at, b.data(), b.size() * sizeof(bf16_t));
      at += b.size() * sizeof(bf16_t);
    }
  }
  write_file_atomic(path, image.data(), image.size());
}

void write_safetensors_raw(const std::filesystem::path& path, const std::vector<StRawTensor>& tensors,
                           const std::map<std::string, std::string>& metadata) {
  constexpr size_t kAlign = 64;
  std::set<std::string> seen;
  for (const StRawTensor& t : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    if (static_cast<size_t>(n) * dtype_size(t.dtype) != t.nbytes || (t.nbytes && !t.data))
      throw std::runtime_error("write_safetensors_raw: tensor '" + t.name + "' has " +
                               std::to_string(t.nbytes) + " bytes for dtype " + to_string(t.dtype) +
                               " and shape " + shape_str(t.shape));
    if (!seen.insert(t.name).second || t.name == "__metadata__")
      throw std::runtime_error("write_safetensors_raw: tensor name '" + t.name + "' repeats or is reserved");
  }
  // The layout order: sizes that are multiples of kAlign first (all stay aligned), then larger elements
  // before smaller ones (each tensor stays aligned to its element size); no gaps, as the format asks.
  std::vector<const StRawTensor*> order;
  for (const StRawTensor& t : tensors) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(), [&](const StRawTensor* a, const StRawTensor* b) {
    const bool a64 = a->nbytes % kAlign == 0, b64 = b->nbytes % kAlign == 0;
    if (a64 != b64) return a64;
    return dtype_size(a->dtype) > dtype_size(b->dtype);
  });
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const StRawTensor* t : order) {
    header[t->name] = {
        {"dtype", to_string(t->dtype)}, {"shape", t->shape}, {"data_offsets", {offset, offset + t->nbytes}}};
    offset += t->nbytes;
  }
  std::string text = header.dump();
  while ((sizeof(uint64_t) + text.size()) % kAlign != 0) text += ' ';
  const uint64_t n = text.size();
  std::vector<uint8_t> image(sizeof n + text.size() + offset);
  std::memcpy(image.data(), &n, sizeof n);
  std::memcpy(image.data() + sizeof n, text.data(), text.size());
  uint8_t* at = image.data() + sizeof n + text.size();
  for (const StRawTensor* t : order) {
    if (t->nbytes) std::memcpy(at, t->data, t->nbytes);
    at += t->nbytes;
  }
  write_file_atomic(path, image.data(), image.size());
}

}  // namespace kda::io
