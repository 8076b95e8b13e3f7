#include "support/cache_compare.h"

#include <gtest/gtest.h>

#include "support/test_support.h"

namespace kda::testing {

void expect_same_as_cold(const serving::SimulateResult& hot, const serving::SimulateResult& cold,
                         double tol) {
  ASSERT_EQ(hot.serve.outputs.size(), cold.serve.outputs.size());
  const int64_t D = cold.serve.hidden;
  for (size_t i = 0; i < cold.serve.outputs.size(); ++i) {
    const auto& h = hot.serve.outputs[i];
    const auto& c = cold.serve.outputs[i];
    EXPECT_EQ(h.tokens, c.tokens) << "sequence " << i << ", request " << c.request_id;
    EXPECT_EQ(h.prompt, c.prompt) << "sequence " << i << ", request " << c.request_id;
    EXPECT_EQ(c.rows_from, 0);
    const size_t skip = static_cast<size_t>(h.rows_from * D);
    ASSERT_EQ(h.rows.size() + skip, c.rows.size()) << "sequence " << i << ", request " << c.request_id;
    EXPECT_LE(max_error_ratio(h.rows.data(), c.rows.data() + skip, h.rows.size(), tol, tol), 1.0)
        << "sequence " << i << ", request " << c.request_id;
  }
}

serving::SimulateOptions simulate_test_options(const io::KimiLinearConfig& cfg,
                                               std::vector<serving::RequestSpec> reqs) {
  serving::SimulateOptions o;
  o.synthetic_config = cfg;
  o.precision = Precision::FP32;
  o.seed = 7;
  o.requests = std::move(reqs);
  o.keep_outputs = true;
  o.state_memory = int64_t{1} << 30;
  return o;
}

serving::SimulateOptions cache_test_options(const io::KimiLinearConfig& cfg,
                                            std::vector<serving::RequestSpec> reqs, bool cache,
                                            int64_t cache_bytes) {
  auto o = simulate_test_options(cfg, std::move(reqs));
  o.server_args.disable_radix_cache = !cache;
  o.server_args.chunked_prefill_size = 48;
  o.cache_interval = 64;
  o.prefix_cache_memory = cache_bytes;
  return o;
}

}  // namespace kda::testing
