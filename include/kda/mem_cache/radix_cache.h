// Prefix cache of recurrent state: a radix tree keyed by token ids whose nodes may own a
// snapshot -- every KDA layer's recurrent and conv state after exactly the node's tokens, held in one slot
// of the same RecurrentStatePool that serves the requests, so that one pool accounts for both.
//
// Hybrid models (KDA + MLA layers): attached to the MLA token KV pool, every edge token of the tree also
// holds its KV slot by reference (MLATokenToKVPool::inc_ref), -1 while the path was reserved by an
// in-flight prefill that has not committed yet. A hit then needs both, and has both: the snapshot at n
// restores the KDA layers, the KV slots of tokens [0, n) (MatchResult::kv_slots, shared into the request
// with HybridReqToTokenPool::share_tokens) the MLA layers. Pruning a node drops its edge's references; a
// KV slot returns to the pool only when no node and no request references it. One byte budget covers both
// kinds: snapshot slots plus every edge token's KV row (a reserved path's tokens count from the reserve on).
//
// Unlike an attention KV cache, a state snapshot covers its whole prefix by itself: a request resumes
// from the deepest snapshot on its path with one copy_slot, and needs nothing from the ancestors. So
// snapshots are evicted one by one at any depth (an interior one may go while deeper ones stay), the tree
// keeps the tokens of an evicted snapshot as long as something below them remains (a later prompt that
// diverges there is still recognised as a branch point), and a lock protects one node's snapshot only.
//
// The scheduler drives it (single-threaded, like sglang's; not thread-safe: one thread at a time):
//   hit      m = match_prefix(prompt[0, n-1)); m.hit: inc_lock_ref, pool.copy_slot(m.hit.slot, request
//            slot), prefill from m.hit.len, dec_lock_ref once the copy has run.
//   wait     m.pending: another request is prefilling that prefix now; lock it, wait until
//            state(node) is Ready (copy) or None (aborted: match again), then dec_lock_ref.
//   write    reserve(tokens, len) before a forward pass that reaches position len (end of a prompt, every
//            --cache-interval tokens, or m.matched_len when the prompt branches off a cached path there);
//            the pass writes the state at len into the returned slot; commit(node, the request's token
//            slots of [0, len)), or abort if cancelled.
//   finish   insert(tokens, len, request slot, its token slots): copies a finished request's state (turn
//            k+1 continues) and references its KV.
//   admit    a request needs a slot: ensure_free_slots(n) evicts snapshots to give the pool n free slots
//            whenever pool.available() + evictable_snapshots() >= n, so a full cache only costs speed;
//            ensure_free_kv_tokens(n) does the same for the KV pool's token slots.
//
// Handles are node ids, never reused: an id whose node left the tree (removed or merged into its child
// once it held nothing, or reset) is rejected with std::invalid_argument rather than dereferenced; a node
// whose snapshot was evicted but which still leads to others stays, in state None. Wrong-state calls (commit
// of a node that is not pending, dec_lock_ref below zero) throw std::logic_error. Every error is thrown
// before anything changes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kda/mem_cache/memory_pool.h"

namespace kda::mem_cache {

using NodeId = int64_t;
inline constexpr NodeId kNoNode = -1;

enum class SnapshotState : uint8_t {
  None,     // a plain branch / interior node, or a snapshot evicted or aborted
  Pending,  // reserved: a slot is held, an in-flight forward pass is writing it; never evicted
  Ready,    // committed: may be copied from; evictable when unlocked
};

struct Snapshot {
  NodeId node = kNoNode;  // kNoNode: no snapshot
  int64_t len = 0;        // tokens from the root: the state is the one after tokens[0, len)
  int32_t slot = -1;      // pool slot holding it
  SnapshotState state = SnapshotState::None;
  bool created = false;  // reserve / insert: this call took the slot (the caller writes it, then commits)
  explicit operator bool() const { return node != kNoNode; }
};

struct MatchResult {
  Snapshot hit;                   // the deepest Ready snapshot on the path (none: start from the zero state)
  int64_t matched_len = 0;        // how many leading tokens the tree holds, inside an edge too (>= hit.len)
  Snapshot pending;               // the deepest Pending snapshot on the path deeper than hit, if any
  std::vector<int32_t> kv_slots;  // with a KV pool: the KV slots of tokens [0, hit.len); else empty
};

class RadixCache {
 public:
  // At most floor(budget_bytes / pool.bytes_per_slot()) snapshots. budget_bytes 0: a cache that never
  // stores (match finds nothing, reserve gives no snapshot); a non-zero budget smaller than one slot is an
  // error. The pools must outlive the cache. kv_pool: the MLA token KV pool of a hybrid model (its edge
  // tokens' KV held by reference, counted in the budget); null for a KDA-only model.
  RadixCache(RecurrentStatePool& pool, size_t budget_bytes, MLATokenToKVPool* kv_pool = nullptr);
  ~RadixCache();  // returns every snapshot slot to the pool
  RadixCache(const RadixCache&) = delete;
  RadixCache& operator=(const RadixCache&) = delete;

  // Longest cached path of `tokens` (pass the prompt without its last token: that one must be run to
  // get logits). Makes the hit the most recently used snapshot; ancestors' snapshots are not touched (the
  // request does not use them, so they age and go first).
  MatchResult match_prefix(std::span<const int32_t> tokens);

  // A Pending snapshot at tokens[0, len) (1 <= len <= tokens.size()), splitting an edge if the path
  // branches inside it. When a Ready or Pending one is already there, returns it (created = false, no
  // second slot). When the budget or the pool is full, evicts the least recently used evictable snapshot
  // first; returns no snapshot (not an error) when none can be evicted or the cache is disabled. The slot
  // is taken before the path is inserted: an error (std::bad_alloc included) leaves the tree and the pool
  // as they were, save a snapshot evicted to make room.
  Snapshot reserve(std::span<const int32_t> tokens, int64_t len);
  // Pending -> Ready, after the forward pass that wrote the slot. With a KV pool, kv_slots are the
  // writer's token slots of [0, len) (at least len of them, each allocated): every edge token on the path
  // that still holds -1 takes its slot by reference. Without one kv_slots is ignored.
  void commit(NodeId node, std::span<const int32_t> kv_slots = {});
  void abort(NodeId node);  // Pending -> None: the slot goes back to the pool (e.g. request cancelled)
  // reserve + pool.copy_slot(src_slot, snapshot) + commit(kv_slots): a finished request's state at len. An
  // existing snapshot there is returned as it is (the state of the same tokens is the same).
  Snapshot insert(std::span<const int32_t> tokens, int64_t len, int32_t src_slot,
                  std::span<const int32_t> kv_slots = {});

  // A locked snapshot (Ready or Pending) is never evicted; nested locks count.
  void inc_lock_ref(NodeId node);
  void dec_lock_ref(NodeId node);

  // Evicts up to n least recently used Ready unlocked snapshots; returns how many went.
  int64_t evict(int64_t n_snapshots);
  // Evicts until at least `bytes` of snapshot slots went back to the pool, or nothing is left to evict.
  size_t evict_bytes(size_t bytes);
  // Evicts (LRU) until the pool has n free slots; evicts nothing and returns false when even evicting every
  // evictable snapshot would not reach n.
  bool ensure_free_slots(int64_t n);
  // Evicts (LRU) until the KV pool has n free token slots; evicts nothing and returns false when even
  // evicting everything evictable would not reach n. Without a KV pool: n <= 0.
  bool ensure_free_kv_tokens(int64_t n);
  // KV token slots that would return to the KV pool if every evictable snapshot went (tokens of subtrees
  // holding no Pending or locked node, referenced by the tree only). Walks the tree.
  int64_t evictable_kv_tokens() const;
  // Edge tokens whose KV slot only the tree references (no request holds it): what the cache alone keeps
  // out of the pool.
  int64_t kv_tokens_held_alone() const;

  // Frees every snapshot and empties the tree; every handle becomes stale.
  void reset();

  SnapshotState state(NodeId node) const;  // unknown node: std::invalid_argument
  int64_t lock_ref(NodeId node) const;
  bool contains(NodeId node) const { return nodes_.count(node) != 0; }

  bool enabled() const { return max_snapshots_ > 0; }
  bool attached_to(const MLATokenToKVPool* kv) const { return kv_pool_ == kv; }
  bool attached_to_kv() const { return kv_pool_ != nullptr; }
  size_t budget_bytes() const { return budget_bytes_; }
  size_t bytes_per_slot() const { return bytes_per_slot_; }
  int64_t max_snapshots() const { return max_snapshots_; }
  int64_t snapshots() const { return snapshots_; }  // Ready + Pending
  int64_t pending_snapshots() const { return pending_; }
  // Snapshot slots plus the KV rows of every edge token (0 per token without a KV pool).
  size_t bytes() const {
    return static_cast<size_t>(snapshots_) * bytes_per_slot_ + static_cast<size_t>(total_tokens_) * kv_bytes_;
  }
  size_t kv_bytes_per_token() const { return kv_bytes_; }
  int64_t kv_tokens() const { return kv_refs_; }  // edge tokens holding a KV slot reference
  int64_t evictions() const { return evictions_; }
  int64_t evictable_snapshots() const { return static_cast<int64_t>(lru_.size()); }  // Ready & unlocked
  size_t evictable_size() const { return lru_.size() * bytes_per_slot_; }            // their bytes
  int64_t total_size() const { return total_tokens_; }  // tokens held by the tree's edges
  int64_t node_count() const { return static_cast<int64_t>(nodes_.size()); }  // root excluded

  // Walks the whole tree; std::logic_error naming the first broken invariant (structure, depths, counters,
  // LRU set, slots allocated and distinct, budget, no prunable node; with a KV pool: every edge token's
  // slot allocated with at least the references the tree holds, -1 only on a path to a Pending or locked
  // node).
  void check_invariants() const;

 private:
  struct Node {
    NodeId id = kNoNode;
    Node* parent = nullptr;
    std::vector<int32_t> key;           // the edge's tokens from the parent
    std::vector<int32_t> kv;            // with a KV pool: key's KV slots (-1: not committed yet)
    int64_t depth = 0;                  // tokens from the root to the end of key
    std::map<int32_t, Node*> children;  // by first token of the child's key
    SnapshotState state = SnapshotState::None;
    int32_t slot = -1;
    int64_t lock_ref = 0;
    uint64_t last_access = 0;  // logical clock: deterministic LRU order
  };

  Node* get(NodeId id, const char* what) const;
  Node* find_exact(std::span<const int32_t> tokens);
  Node* insert_path(std::span<const int32_t> tokens);
  Snapshot describe(const Node* n, bool created) const;
  bool evictable(const Node* n) const { return n->state == SnapshotState::Ready && n->lock_ref == 0; }
  void touch(Node* n);
  void lru_add(Node* n) { lru_.insert({n->last_access, n->id}); }
  void lru_remove(Node* n) { lru_.erase({n->last_access, n->id}); }
  void evict_lru();
  void release(Node* n);  // frees a node's snapshot slot, then prunes
  void prune(Node* n);
  void drop_kv(Node* n);  // drops the references of the edge's KV slots
  bool fits(std::span<const int32_t> path) const;
  void check_kv() const;  // check_invariants' KV part
  // Post-order: visit(node, open), open = its subtree holds a Pending or locked node.
  void walk_post_order(const std::function<void(const Node*, bool)>& visit) const;

  RecurrentStatePool* pool_;
  MLATokenToKVPool* kv_pool_;
  size_t kv_bytes_ = 0;  // one token's KV rows over every MLA layer (0 without a KV pool)
  int64_t kv_refs_ = 0;
  size_t budget_bytes_;
  size_t bytes_per_slot_;
  int64_t max_snapshots_;
  Node root_;
  std::unordered_map<NodeId, std::unique_ptr<Node>> nodes_;
  std::set<std::pair<uint64_t, NodeId>> lru_;  // Ready unlocked snapshots, oldest first
  std::vector<uint8_t> is_snapshot_slot_;      // [pool size + 1]: slot held by a snapshot of this cache
  NodeId next_id_ = 1;
  uint64_t clock_ = 0;
  int64_t snapshots_ = 0, pending_ = 0, evictions_ = 0, total_tokens_ = 0;
};

}  // namespace kda::mem_cache
