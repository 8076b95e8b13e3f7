#include "kda/distributed/in_process.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace kda::distributed {

class InProcessMember final : public Communicator {
 public:
  InProcessMember(InProcessGroup& g, int rank) : g_(g), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_.size_; }

  void allreduce_sum(float* data, size_t n) override {
    publish(data, n);
    // Every member sums in the same rank order, so all end with bit-identical results.
    std::vector<float> sum(n, 0.0f);
    for (int r = 0; r < g_.size_; ++r) {
      const float* src = static_cast<const float*>(g_.slots_[r]);
      for (size_t i = 0; i < n; ++i) sum[i] += src[i];
    }
    g_.barrier_.arrive_and_wait();  // all have read every input
    if (n) std::memcpy(data, sum.data(), n * sizeof(float));
    g_.barrier_.arrive_and_wait();
  }
  bool allreduce_or(bool v) override {
    const bool mine = v;
    publish(&mine, 1);
    bool any = false;
    for (int r = 0; r < g_.size_; ++r) any = any || *static_cast<const bool*>(g_.slots_[r]);
    g_.barrier_.arrive_and_wait();
    return any;
  }
  void allgather(const float* send, size_t n, float* recv) override {
    publish(send, n);
    for (int r = 0; r < g_.size_; ++r)
      if (n) std::memcpy(recv + r * n, g_.slots_[r], n * sizeof(float));
    g_.barrier_.arrive_and_wait();
  }
  std::vector<std::vector<uint8_t>> allgather_bytes(const std::vector<uint8_t>& send) override {
    publish(send.data(), send.size());
    std::vector<std::vector<uint8_t>> out(g_.size_);
    for (int r = 0; r < g_.size_; ++r) {
      const auto* p = static_cast<const uint8_t*>(g_.slots_[r]);
      out[r].assign(p, p + g_.sizes_[r]);
    }
    g_.barrier_.arrive_and_wait();
    return out;
  }
  void barrier() override { g_.barrier_.arrive_and_wait(); }

 private:
  // Publishes this member's buffer and waits until every member has published.
  void publish(const void* p, size_t n) {
    g_.slots_[rank_] = p;
    g_.sizes_[rank_] = n;
    g_.barrier_.arrive_and_wait();
  }
  InProcessGroup& g_;
  int rank_;
};

InProcessGroup::InProcessGroup(int size) : size_(size), barrier_(size), slots_(size), sizes_(size) {
  if (size < 1) throw std::invalid_argument("InProcessGroup: size must be >= 1");
}

std::unique_ptr<Communicator> InProcessGroup::member(int rank) {
  if (rank < 0 || rank >= size_)
    throw std::invalid_argument("InProcessGroup: rank " + std::to_string(rank) + " outside the group");
  return std::make_unique<InProcessMember>(*this, rank);
}

}  // namespace kda::distributed
