// Packed checkpoints (`kda quantize`): safetensors whose projections hold W already in the layout the
// kernels read (kernels/gemm/weight_format.h), so that a loader maps them and uses them in place: no
// conversion at load, and the weight pages are the file's page-cache pages, shared by every process
// that maps the same file (the mapping is read-only).
//
// Format packed-v1: every shard's __metadata__ and the index's "metadata" hold kda_format = packed-v1
// and weights = int8 | int4; config.json holds quantization_config {quant_method: "kda", kda_format,
// weights, group_size}. A projection `name` (a layer's own name for it: the fused ones are named as the
// layer fuses them, e.g. self_attn.qkv_fa_ga_b_proj, mlp.gate_up_proj; an expert's as the MoE slices
// it, experts.{e}.pieces.{p}.gate_up_proj / down_proj) is two tensors:
//   int8: name.qweight I8 [out, in] (per output channel), name.scales F32 [out]
//   int4: name.qweight U8 [out, in / 2] (groups of 32 inputs as 16 bytes, quant_gemm.h), name.scales
//         F32 [out, in / 32]
// Every other tensor (norms, conv weights, router, embedding, head) is the source checkpoint's, bytes as
// they were. A change of any layout, or of the rows a fused projection stacks, is a new kda_format.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kda/common/weights.h"
#include "kda/io/safetensors.h"

namespace kda::kernels::gemm {
class PackedMatrix;
}

namespace kda::io {

inline constexpr const char* kPackedFormat = "packed-v1";

// The weights scheme of a packed checkpoint (its metadata), or nullopt for a plain one. A kda_format
// other than this build's, or a weights value other than int8 / int4, is std::runtime_error naming it.
std::optional<Weights> packed_weights(const Checkpoint& ckpt);

// For a loader: whether `ckpt` is packed; when it is, `weights` must be its scheme and tp_size 1 (the
// row-parallel shards of a packed W are not contiguous), else std::invalid_argument saying so.
bool packed_for_load(const Checkpoint& ckpt, Weights weights, int tp_size);

// Projection `name` as the kernels read it, borrowed from the mapping (the matrix keeps its shard
// mapped). Both tensors' dtype and shape are checked against (format, in, out), their shard's metadata
// against the checkpoint's and the scales' alignment; std::runtime_error naming the tensor otherwise.
std::shared_ptr<const kernels::gemm::PackedMatrix> load_packed(const Checkpoint& ckpt,
                                                               const std::string& name, Weights format,
                                                               int64_t in, int64_t out);

// The writer's side: the metadata of a packed shard / index, and a projection's two tensors (views of
// `m`'s bytes, valid while m lives).
std::map<std::string, std::string> packed_metadata(Weights weights);
void append_packed(std::vector<StRawTensor>& tensors, const std::string& name,
                   const kernels::gemm::PackedMatrix& m);

}  // namespace kda::io
