#include "kda/distributed/in_process.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

namespace kda::distributed {

// Every collective: publish this member's buffer, meet, read the others' buffers, meet again. No member
// leaves a collective (and frees its buffer) before every member has read it: an error while reading is
// carried past the closing barrier and thrown after it.
class InProcessMember final : public Communicator {
 public:
  InProcessMember(InProcessGroup& g, int rank) : g_(g), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_.size_; }

  void allreduce_sum(float* data, size_t n) override {
    std::vector<float> sum(n, 0.0f);
    publish(data, n);
    // Every member sums in the same rank order, so all end with bit-identical results.
    read_then_meet([&] {
      for (int r = 0; r < g_.size_; ++r) {
        const float* src = static_cast<const float*>(g_.slots_[r]);
        for (size_t i = 0; i < n; ++i) sum[i] += src[i];
      }
    });
    if (n) std::memcpy(data, sum.data(), n * sizeof(float));
    g_.arrive_and_wait();
  }
  bool allreduce_or(bool v) override {
    const bool mine = v;
    publish(&mine, 1);
    bool any = false;
    read_then_meet([&] {
      for (int r = 0; r < g_.size_; ++r) any = any || *static_cast<const bool*>(g_.slots_[r]);
    });
    return any;
  }
  void allgather(const float* send, size_t n, float* recv) override {
    publish(send, n);
    read_then_meet([&] {
      for (int r = 0; r < g_.size_; ++r)
        if (n) std::memcpy(recv + r * n, g_.slots_[r], n * sizeof(float));
    });
  }
  std::vector<std::vector<uint8_t>> allgather_bytes(const std::vector<uint8_t>& send) override {
    publish(send.data(), send.size());
    std::vector<std::vector<uint8_t>> out;
    read_then_meet([&] {
      out.resize(static_cast<size_t>(g_.size_));
      for (int r = 0; r < g_.size_; ++r) {
        const auto* p = static_cast<const uint8_t*>(g_.slots_[r]);
        out[r].assign(p, p + g_.sizes_[r]);
      }
    });
    return out;
  }
  void barrier() override { g_.arrive_and_wait(); }

 private:
  // Publishes this member's buffer and waits until every member has published.
  void publish(const void* p, size_t n) {
    g_.slots_[rank_] = p;
    g_.sizes_[rank_] = n;
    g_.arrive_and_wait();
  }
  template <class F>
  void read_then_meet(F&& read) {
    std::exception_ptr err;
    try {
      read();
    } catch (...) {
      err = std::current_exception();
    }
    g_.arrive_and_wait();
    if (err) std::rethrow_exception(err);
  }
  InProcessGroup& g_;
  int rank_;
};

InProcessGroup::InProcessGroup(int size) : size_(size) {
  if (size < 1) throw std::invalid_argument("InProcessGroup: size must be >= 1");
  slots_.resize(static_cast<size_t>(size));
  sizes_.resize(static_cast<size_t>(size));
}

std::unique_ptr<Communicator> InProcessGroup::member(int rank) {
  if (rank < 0 || rank >= size_)
    throw std::invalid_argument("InProcessGroup: rank " + std::to_string(rank) + " outside the group");
  return std::make_unique<InProcessMember>(*this, rank);
}

void InProcessGroup::arrive_and_wait() {
  std::unique_lock lk(mu_);
  if (aborted_) throw GroupAborted(abort_message_);
  const uint64_t gen = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lk, [&] { return generation_ != gen || aborted_; });
  // A barrier that completed before the abort still counts: the abort shows at the next collective.
  if (generation_ == gen) throw GroupAborted(abort_message_);
}

void InProcessGroup::abort(int rank, const std::string& what) {
  std::lock_guard lk(mu_);
  if (aborted_) return;
  aborted_ = true;
  abort_message_ = "in-process group of " + std::to_string(size_) + " aborted: rank " + std::to_string(rank) +
                   " failed: " + what;
  cv_.notify_all();
}

bool InProcessGroup::aborted() const {
  std::lock_guard lk(mu_);
  return aborted_;
}

void InProcessGroup::run(const std::function<void(int rank, Communicator& comm)>& fn) {
  std::mutex first_mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(size_));
  const auto body = [&](int rank) {
    try {
      auto comm = member(rank);
      fn(rank, *comm);
    } catch (...) {
      const auto e = std::current_exception();
      std::string what = "unknown exception";
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        what = x.what();
      } catch (...) {
      }
      {
        // The first failure is the cause; the GroupAborted of the members it woke come after it.
        std::lock_guard lk(first_mu);
        if (!first) first = e;
      }
      abort(rank, what);
    }
  };
  try {
    for (int r = 0; r < size_; ++r) threads.emplace_back(body, r);
  } catch (...) {  // no thread for a member: those started must not wait for it
    abort(static_cast<int>(threads.size()), "could not start its thread");
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace kda::distributed
