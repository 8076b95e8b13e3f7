#include "kda/io/packed_checkpoint.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "kda/kernels/gemm/weight_format.h"

namespace kda::io {

namespace {

namespace qg = kda::kernels::gemm;

// The tensor's pages of its file mapping made present now, at load: used in place, they would otherwise fault
// in one by one during the first prefill, whose time to first token they would lengthen (MADV_POPULATE_READ,
// Linux 5.14; an older kernel refuses it, and the pages then fault in as before).
void populate(const TensorView& v) {
#if defined(MADV_POPULATE_READ)
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(v.data) / page * page;
  const auto end = reinterpret_cast<uintptr_t>(v.data) + v.nbytes;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ);
#else
  (void)v;
#endif
}

std::string qweight_key(const std::string& name) { return name + ".qweight"; }
std::string scales_key(const std::string& name) { return name + ".scales"; }

// The stored dtype and shape of a projection's tensors.
StDType qweight_dtype(Weights w) { return w == Weights::Int8 ? StDType::I8 : StDType::U8; }
std::vector<int64_t> qweight_shape(const qg::WeightFormat& f, int64_t in, int64_t out) {
  return {out, f.data_bytes(in, out) / out};
}
std::vector<int64_t> scales_shape(const qg::WeightFormat& f, int64_t in, int64_t out) {
  const int64_t per_row = f.scale_count(in, out) / out;
  return per_row == 1 ? std::vector<int64_t>{out} : std::vector<int64_t>{out, per_row};
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

std::optional<Weights> scheme_of(const std::map<std::string, std::string>& meta, const std::string& what) {
  const auto fmt = meta.find("kda_format");
  if (fmt == meta.end()) return std::nullopt;
  if (fmt->second != kPackedFormat)
    throw std::runtime_error(what + ": packed checkpoint format '" + fmt->second + "', this build reads '" +
                             kPackedFormat + "' (quantize the source checkpoint again with this kda)");
  const auto w = meta.find("weights");
  if (w == meta.end() || (w->second != "int8" && w->second != "int4"))
    throw std::runtime_error(what + ": packed checkpoint without weights = int8 | int4 in its metadata (" +
                             (w == meta.end() ? std::string("none") : "'" + w->second + "'") + ")");
  return parse_weights(w->second);
}

}  // namespace

std::optional<Weights> packed_weights(const Checkpoint& ckpt) {
  return scheme_of(ckpt.metadata(), ckpt.root().string());
}

bool packed_for_load(const Checkpoint& ckpt, Weights weights, int tp_size) {
  const std::optional<Weights> w = packed_weights(ckpt);
  if (!w) return false;
  if (*w != weights)
    throw std::invalid_argument(ckpt.root().string() + " is a packed " + to_string(*w) +
                                " checkpoint (kda quantize): load it with --weights " + to_string(*w) +
                                ", not " + to_string(weights));
  if (tp_size > 1)
    throw std::invalid_argument(ckpt.root().string() +
                                " is a packed checkpoint: it loads on one rank (--tp 1); tensor parallelism "
                                "loads the source checkpoint");
  return true;
}

std::shared_ptr<const qg::PackedMatrix> load_packed(const Checkpoint& ckpt, const std::string& name,
                                                    Weights format, int64_t in, int64_t out) {
  const qg::WeightFormat& f = qg::weight_format(format);
  if (format == Weights::BF16)
    throw std::invalid_argument("load_packed: '" + name + "': packed-v1 holds int8 / int4 projections only");
  const std::string qk = qweight_key(name), sk = scales_key(name);
  const TensorView& q = ckpt.get(qk);
  const TensorView& s = ckpt.get(sk);
  const auto expect = [&](const TensorView& v, StDType dt, const std::vector<int64_t>& shape) {
    if (v.dtype != dt || v.shape != shape)
      throw std::runtime_error(ckpt.root().string() + ": packed tensor '" + v.name + "' is " +
                               to_string(v.dtype) + " " + shape_str(v.shape) + ", the model's " +
                               to_string(format) + " [" + std::to_string(out) + ", " + std::to_string(in) +
                               "] projection needs " + to_string(dt) + " " + shape_str(shape));
  };
  expect(q, qweight_dtype(format), qweight_shape(f, in, out));
  expect(s, StDType::F32, scales_shape(f, in, out));
  if (reinterpret_cast<uintptr_t>(s.data) % alignof(float) != 0)
    throw std::runtime_error(ckpt.root().string() + ": packed tensor '" + sk +
                             "' is not 4-byte aligned in its file, so it cannot be read in place");
  // Both tensors' files: each view keeps its own shard mapped (they are one file as kda quantize writes).
  auto qfile = ckpt.file_of(qk), sfile = ckpt.file_of(sk);
  for (const auto* file : {qfile.get(), sfile.get()}) {
    const std::optional<Weights> shard_scheme = scheme_of(file->metadata(), file->path().string());
    if (shard_scheme != format)
      throw std::runtime_error(file->path().string() + ": shard metadata says " +
                               (shard_scheme ? to_string(*shard_scheme) : "not packed") +
                               ", the checkpoint " + to_string(format));
  }
  populate(q);
  populate(s);
  // The owner keeps both mappings alive.
  auto owner = std::make_shared<
      std::pair<std::shared_ptr<const SafetensorsFile>, std::shared_ptr<const SafetensorsFile>>>(
      std::move(qfile), std::move(sfile));
  const qg::PackedWeights view{format, q.data, static_cast<const float*>(static_cast<const void*>(s.data)),
                               in, out};
  return std::make_shared<const qg::PackedMatrix>(view, std::move(owner));
}

std::map<std::string, std::string> packed_metadata(Weights weights) {
  return {{"format", "pt"}, {"kda_format", kPackedFormat}, {"weights", to_string(weights)}};
}

void append_packed(std::vector<StRawTensor>& tensors, const std::string& name, const qg::PackedMatrix& m) {
  const qg::PackedWeights& v = m.view();
  if (v.format == Weights::BF16)
    throw std::invalid_argument("append_packed: '" + name +
                                "': packed-v1 holds int8 / int4 projections only");
  const qg::WeightFormat& f = qg::weight_format(v.format);
  tensors.push_back({qweight_key(name), qweight_dtype(v.format), qweight_shape(f, v.in, v.out), v.data,
                     static_cast<size_t>(m.data_bytes())});
  tensors.push_back({scales_key(name), StDType::F32, scales_shape(f, v.in, v.out), v.scale,
                     sizeof(float) * static_cast<size_t>(m.scale_count())});
}

}  // namespace kda::io
