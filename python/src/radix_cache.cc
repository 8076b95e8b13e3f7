// RadixCache: the prefix cache of KDA state snapshots (mem_cache/radix_cache.h) under its C++ names, for a
// Python scheduler. A snapshot lives in a slot of the RecurrentStatePool the cache was made on: the cache
// keeps that pool alive, and every call holds the GIL, so that Python threads take turns on it (the cache is
// single-threaded, like the scheduler that drives it). Bad input -- a stale or wrong-state node handle, a
// length outside the tokens, a slot not allocated -- is a ValueError thrown before anything changes.
#include "kda/mem_cache/radix_cache.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "args.h"
#include "bindings.h"
#include "tensor.h"

namespace kda::python {

namespace {

using mem_cache::MatchResult;
using mem_cache::NodeId;
using mem_cache::RadixCache;
using mem_cache::Snapshot;
using mem_cache::SnapshotState;

// Token ids: a contiguous 1-D int32 NumPy array or torch tensor is read in place; any other sequence of
// ints is converted.
class Tokens {
 public:
  Tokens(const py::handle& obj, const char* name) {
    if (py::isinstance<py::array>(obj) || py::hasattr(obj, "__dlpack__")) {
      TensorView t = as_tensor(obj, name);
      if (t.dtype == DType::I32 && t.ndim() == 1 && t.contiguous()) {
        view_ = std::move(t);
        span_ = {view_.ptr<const int32_t>(), static_cast<size_t>(view_.shape[0])};
        return;
      }
      if (t.ndim() != 1) expect_ndim(t, 1);
    }
    copy_ = to_i32(obj, name);
    span_ = copy_;
  }
  std::span<const int32_t> span() const { return span_; }

 private:
  TensorView view_;
  std::vector<int32_t> copy_;
  std::span<const int32_t> span_;
};

// The cache's wrong-state errors (commit of a node that is not pending, dec_lock_ref below zero) are
// std::logic_error: for a Python caller they are bad arguments like the stale handles, so ValueError.
template <class F>
decltype(auto) checked(F f) {
  try {
    return f();
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::logic_error& e) {
    throw py::value_error(e.what());
  }
}

const char* state_name(SnapshotState s) {
  switch (s) {
    case SnapshotState::None:
      return "None";
    case SnapshotState::Pending:
      return "Pending";
    case SnapshotState::Ready:
      return "Ready";
  }
  return "?";
}

std::string snapshot_repr(const Snapshot& s) {
  if (!s) return "Snapshot(none)";
  return "Snapshot(node=" + std::to_string(s.node) + ", len=" + std::to_string(s.len) +
         ", slot=" + std::to_string(s.slot) + ", state=" + state_name(s.state) +
         ", created=" + (s.created ? "True" : "False") + ")";
}

}  // namespace

void register_radix_cache(py::module_& m) {
  py::enum_<SnapshotState>(m, "SnapshotState")
      .value("NONE", SnapshotState::None)
      .value("PENDING", SnapshotState::Pending)
      .value("READY", SnapshotState::Ready);

  py::class_<Snapshot>(m, "Snapshot",
                       "A snapshot handle: node (-1: none), len (the state is the one after tokens[0, len)), "
                       "slot (the pool slot holding it), state, created (this call took the slot: write it, "
                       "then commit). False when there is none.")
      .def_readonly("node", &Snapshot::node)
      .def_readonly("len", &Snapshot::len)
      .def_readonly("slot", &Snapshot::slot)
      .def_readonly("state", &Snapshot::state)
      .def_readonly("created", &Snapshot::created)
      .def("__bool__", [](const Snapshot& s) { return static_cast<bool>(s); })
      .def("__repr__", &snapshot_repr);

  py::class_<MatchResult>(m, "MatchResult",
                          "match_prefix's answer: hit (the deepest Ready snapshot on the path), matched_len "
                          "(leading tokens the tree holds), pending (a deeper snapshot being written now).")
      .def_readonly("hit", &MatchResult::hit)
      .def_readonly("matched_len", &MatchResult::matched_len)
      .def_readonly("pending", &MatchResult::pending)
      .def("__repr__", [](const MatchResult& r) {
        return "MatchResult(hit=" + snapshot_repr(r.hit) + ", matched_len=" + std::to_string(r.matched_len) +
               ", pending=" + snapshot_repr(r.pending) + ")";
      });

  py::class_<RadixCache>(
      m, "RadixCache",
      "Prefix cache of recurrent state: a radix tree of token ids whose nodes may own a snapshot (every KDA "
      "layer's recurrent and conv state after exactly the node's tokens) in a slot of the pool. A request "
      "resumes from m = match_prefix(prompt[:-1]): inc_lock_ref(m.hit.node), pool.copy_slot(m.hit.slot, "
      "its slot), dec_lock_ref, prefill from m.hit.len. Snapshots are written by an EXTEND: s = reserve("
      "tokens, len), ForwardBatch.state_snapshots = [(row, len - prefix, s.slot)], the layers' forward, "
      "commit(s.node) (abort on cancel); or insert(tokens, len, slot) copies a finished request's state. "
      "Not thread-safe beyond the GIL: pool changes (reserve, insert, evictions) must not overlap a forward "
      "on the same pool.")
      .def(py::init([](const py::object& pools, int64_t budget_bytes) {
             if (budget_bytes < 0)
               throw py::value_error("RadixCache: budget_bytes must be >= 0, got " +
                                     std::to_string(budget_bytes));
             return std::make_unique<RadixCache>(pool_of(pools), static_cast<size_t>(budget_bytes));
           }),
           py::arg("pools"), py::arg("budget_bytes"), py::keep_alive<1, 2>(),
           "pools: MemoryPools or a RecurrentStatePool (kept alive by the cache). At most budget_bytes // "
           "pool bytes per slot snapshots; 0: a cache that never stores.")
      .def(
          "match_prefix",
          [](RadixCache& c, const py::object& tokens) {
            const Tokens t(tokens, "tokens");
            return c.match_prefix(t.span());
          },
          py::arg("tokens"), "Longest cached path of tokens (pass the prompt without its last token).")
      .def(
          "reserve",
          [](RadixCache& c, const py::object& tokens, int64_t len) {
            const Tokens t(tokens, "tokens");
            return checked([&] { return c.reserve(t.span(), len); });
          },
          py::arg("tokens"), py::arg("len"),
          "A Pending snapshot at tokens[:len] (1 <= len <= len(tokens)), for a forward to write; an existing "
          "one is returned (created False); no snapshot (falsy) when nothing can be evicted for it.")
      .def(
          "commit", [](RadixCache& c, NodeId n) { checked([&] { c.commit(n); }); }, py::arg("node"),
          "Pending -> Ready, after the forward that wrote the slot.")
      .def(
          "abort", [](RadixCache& c, NodeId n) { checked([&] { c.abort(n); }); }, py::arg("node"),
          "Pending -> None: the slot goes back to the pool.")
      .def(
          "insert",
          [](RadixCache& c, const py::object& tokens, int64_t len, int32_t src_slot) {
            const Tokens t(tokens, "tokens");
            return checked([&] { return c.insert(t.span(), len, src_slot); });
          },
          py::arg("tokens"), py::arg("len"), py::arg("src_slot"),
          "reserve + pool.copy_slot(src_slot, snapshot) + commit: a finished request's state at len.")
      .def(
          "inc_lock_ref", [](RadixCache& c, NodeId n) { checked([&] { c.inc_lock_ref(n); }); },
          py::arg("node"), "A locked snapshot is never evicted; locks nest.")
      .def(
          "dec_lock_ref", [](RadixCache& c, NodeId n) { checked([&] { c.dec_lock_ref(n); }); },
          py::arg("node"))
      .def(
          "evict", [](RadixCache& c, int64_t n) { return checked([&] { return c.evict(n); }); },
          py::arg("n_snapshots"), "Evicts up to n least recently used evictable snapshots; returns how many.")
      .def(
          "evict_bytes",
          [](RadixCache& c, int64_t bytes) {
            if (bytes < 0)
              throw py::value_error("evict_bytes: bytes must be >= 0, got " + std::to_string(bytes));
            return c.evict_bytes(static_cast<size_t>(bytes));
          },
          py::arg("bytes"))
      .def(
          "ensure_free_slots",
          [](RadixCache& c, int64_t n) { return checked([&] { return c.ensure_free_slots(n); }); },
          py::arg("n"),
          "Evicts until the pool has n free slots; evicts nothing and returns False when it cannot reach n.")
      .def("reset", &RadixCache::reset, "Frees every snapshot; every handle becomes stale.")
      .def(
          "state", [](const RadixCache& c, NodeId n) { return checked([&] { return c.state(n); }); },
          py::arg("node"))
      .def(
          "lock_ref", [](const RadixCache& c, NodeId n) { return checked([&] { return c.lock_ref(n); }); },
          py::arg("node"))
      .def("contains", &RadixCache::contains, py::arg("node"))
      .def("check_invariants", &RadixCache::check_invariants,
           "Walks the tree; RuntimeError naming the first broken invariant.")
      .def_property_readonly("enabled", &RadixCache::enabled)
      .def_property_readonly("budget_bytes", &RadixCache::budget_bytes)
      .def_property_readonly("bytes_per_slot", &RadixCache::bytes_per_slot)
      .def_property_readonly("max_snapshots", &RadixCache::max_snapshots)
      .def_property_readonly("snapshots", &RadixCache::snapshots, "Ready + Pending.")
      .def_property_readonly("pending_snapshots", &RadixCache::pending_snapshots)
      .def_property_readonly("bytes", &RadixCache::bytes)
      .def_property_readonly("evictions", &RadixCache::evictions)
      .def_property_readonly("evictable_snapshots", &RadixCache::evictable_snapshots)
      .def_property_readonly("evictable_size", &RadixCache::evictable_size)
      .def_property_readonly("total_size", &RadixCache::total_size, "Tokens held by the tree's edges.")
      .def_property_readonly("node_count", &RadixCache::node_count)
      .def("__repr__", [](const RadixCache& c) {
        return "RadixCache(snapshots=" + std::to_string(c.snapshots()) + "/" +
               std::to_string(c.max_snapshots()) + ", pending=" + std::to_string(c.pending_snapshots()) +
               ", nodes=" + std::to_string(c.node_count()) + ", tokens=" + std::to_string(c.total_size()) +
               ", evictions=" + std::to_string(c.evictions()) + ")";
      });
}

}  // namespace kda::python
