// Projections whose W comes already packed in the kernels' layout (a checkpoint `kda quantize` wrote,
// mapped and used in place: io/packed_checkpoint.h), by the name the layer gives each projection. A
// layer's weights carry them beside (instead of) the fp32 values, and the layer builds each projection
// from its packed W when there is one, else from the fp32 values as before.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kda/common/precision.h"
#include "kda/common/weights.h"
#include "kda/layers/linear.h"

namespace kda::kernels::gemm {
class PackedMatrix;
}

namespace kda::layers {

using PackedLinears = std::map<std::string, std::shared_ptr<const kernels::gemm::PackedMatrix>>;

// The projection `name` [out, in]: from packed.at(name) when present (its format must be `weights` and
// its shape [out, in], else std::invalid_argument naming the projection), else from fp32() converted as
// Linear(in, out, fp32(), precision, weights) does.
Linear make_linear(const PackedLinears& packed, const std::string& name, int64_t in, int64_t out,
                   const std::function<std::vector<float>()>& fp32, Precision precision, Weights weights);

}  // namespace kda::layers
