#include "kda/layers/packed_linears.h"

#include <stdexcept>
#include <string>

#include "kda/kernels/gemm/weight_format.h"

namespace kda::layers {

Linear make_linear(const PackedLinears& packed, const std::string& name, int64_t in, int64_t out,
                   const std::function<std::vector<float>()>& fp32, Precision precision, Weights weights) {
  const auto it = packed.find(name);
  if (it == packed.end() || !it->second) return Linear(in, out, fp32(), precision, weights);
  const kernels::gemm::PackedWeights& v = it->second->view();
  if (v.format != weights || v.in != in || v.out != out)
    throw std::invalid_argument("projection '" + name + "' is packed as " + to_string(v.format) + " [" +
                                std::to_string(v.out) + ", " + std::to_string(v.in) + "], the layer wants " +
                                to_string(weights) + " [" + std::to_string(out) + ", " + std::to_string(in) +
                                "]");
  return Linear(*it->second, precision);
}

}  // namespace kda::layers
