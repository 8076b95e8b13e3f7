// The oneDNN matmul primitives of one projection (Linear's dense path, QuantLinear's prefill tiles): one
// per call shape, created on first use and reused after. A serving engine calls with a new row count at
// almost every step, so beyond `capacity` the least recently used is dropped (oneDNN's own primitive
// cache makes re-creating a recent one cheap). Not thread-safe: its owner's mutex guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <dnnl.hpp>
#include <map>
#include <tuple>
#include <utility>

namespace kda::layers {

class MatmulCache {
 public:
  // A call shape: M rows, n output columns, the row strides and the output type.
  struct Key {
    int64_t m, n, ldx, ldy;
    bool y_bf16;
    bool operator<(const Key& o) const {
      return std::tie(m, n, ldx, ldy, y_bf16) < std::tie(o.m, o.n, o.ldx, o.ldy, o.y_bf16);
    }
  };
  struct Entry {
    dnnl::matmul matmul;
    dnnl::memory::desc src, weights, dst;
    dnnl::memory w;  // the weights it runs on, where its owner keeps them per primitive (else empty)
  };

  explicit MatmulCache(size_t capacity) : capacity_(capacity) {}

  // The entry for `key`; on a miss make() builds it (a throw there leaves the cache as it was).
  template <class Make>
  Entry& get(const Key& key, Make make) {
    auto it = map_.find(key);
    if (it == map_.end()) {
      Entry e = make();
      if (map_.size() >= capacity_) {
        auto lru = map_.begin();
        for (auto i = map_.begin(); i != map_.end(); ++i)
          if (i->second.last_use < lru->second.last_use) lru = i;
        map_.erase(lru);
      }
      it = map_.emplace(key, Slot{std::move(e), 0}).first;
    }
    it->second.last_use = ++calls_;
    return it->second.entry;
  }
  size_t size() const { return map_.size(); }

 private:
  struct Slot {
    Entry entry;
    uint64_t last_use;
  };
  size_t capacity_;
  uint64_t calls_ = 0;
  std::map<Key, Slot> map_;
};

}  // namespace kda::layers
