#include "kda/mem_cache/radix_cache.h"

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>

namespace kda::mem_cache {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

const char* name(SnapshotState s) {
  switch (s) {
    case SnapshotState::None:
      return "none";
    case SnapshotState::Pending:
      return "pending";
    case SnapshotState::Ready:
      return "ready";
  }
  return "?";
}

// Length of the common prefix of an edge and the rest of a path.
size_t common_prefix(const std::vector<int32_t>& key, std::span<const int32_t> rest) {
  const size_t n = std::min(key.size(), rest.size());
  size_t i = 0;
  while (i < n && key[i] == rest[i]) ++i;
  return i;
}

void check_len(std::span<const int32_t> tokens, int64_t len, const char* what) {
  if (len < 1 || len > static_cast<int64_t>(tokens.size())) {
    throw std::invalid_argument(std::string(what) + ": len " + str(len) + " is outside [1, " +
                                str(static_cast<int64_t>(tokens.size())) + "] (the tokens given)");
  }
}

}  // namespace

RadixCache::RadixCache(RecurrentStatePool& pool, size_t budget_bytes, MLATokenToKVPool* kv_pool)
    : pool_(&pool),
      kv_pool_(kv_pool),
      kv_bytes_(kv_pool ? static_cast<size_t>(kv_pool->bytes_per_token()) : 0),
      budget_bytes_(budget_bytes),
      bytes_per_slot_(pool.bytes_per_slot()) {
  if (budget_bytes != 0 && budget_bytes < bytes_per_slot_) {
    throw std::invalid_argument("RadixCache: budget of " + str(static_cast<int64_t>(budget_bytes)) +
                                " bytes is smaller than one snapshot (" +
                                str(static_cast<int64_t>(bytes_per_slot_)) +
                                " bytes per slot); use 0 to disable the cache");
  }
  max_snapshots_ = static_cast<int64_t>(budget_bytes / bytes_per_slot_);
  root_.id = 0;  // never in nodes_, so never accepted as a handle
  is_snapshot_slot_.assign(pool.size() + 1, 0);
}

RadixCache::~RadixCache() { reset(); }

void RadixCache::reset() {
  std::vector<int32_t> slots;
  for (const auto& [id, n] : nodes_) {
    if (n->slot >= 0) slots.push_back(n->slot);
  }
  pool_->free(slots);
  for (const auto& [id, n] : nodes_) drop_kv(n.get());
  std::fill(is_snapshot_slot_.begin(), is_snapshot_slot_.end(), 0);
  nodes_.clear();
  root_.children.clear();
  lru_.clear();
  snapshots_ = pending_ = total_tokens_ = 0;  // next_id_ keeps counting: old handles stay unknown
}

RadixCache::Node* RadixCache::get(NodeId id, const char* what) const {
  const auto it = nodes_.find(id);
  if (it == nodes_.end()) {
    throw std::invalid_argument(std::string("RadixCache::") + what + ": node " + str(id) +
                                " is not in the tree (never made, or evicted, pruned or reset since)");
  }
  return it->second.get();
}

Snapshot RadixCache::describe(const Node* n, bool created) const {
  return Snapshot{n->id, n->depth, n->slot, n->state, created};
}

void RadixCache::touch(Node* n) {
  if (evictable(n)) lru_remove(n);
  n->last_access = ++clock_;
  if (evictable(n)) lru_add(n);
}

MatchResult RadixCache::match_prefix(std::span<const int32_t> tokens) {
  MatchResult r;
  const Node* node = &root_;
  Node *best = nullptr, *pending = nullptr;
  std::vector<const Node*> path;
  size_t pos = 0;
  while (pos < tokens.size()) {
    const auto it = node->children.find(tokens[pos]);
    if (it == node->children.end()) break;
    Node* c = it->second;
    const size_t k = common_prefix(c->key, tokens.subspan(pos));
    pos += k;
    if (k < c->key.size()) break;  // diverges (or ends) inside the edge: no node there
    node = c;
    path.push_back(c);
    if (c->state == SnapshotState::Ready) best = c;
    if (c->state == SnapshotState::Pending) pending = c;
  }
  r.matched_len = static_cast<int64_t>(pos);
  if (best) {
    touch(best);
    r.hit = describe(best, false);
    if (kv_pool_) {
      r.kv_slots.reserve(static_cast<size_t>(best->depth));
      for (const Node* c : path) {
        r.kv_slots.insert(r.kv_slots.end(), c->kv.begin(), c->kv.end());
        if (c == best) break;
      }
    }
  }
  if (pending && (!best || pending->depth > best->depth)) r.pending = describe(pending, false);
  return r;
}

RadixCache::Node* RadixCache::find_exact(std::span<const int32_t> tokens) {
  Node* node = &root_;
  size_t pos = 0;
  while (pos < tokens.size()) {
    const auto it = node->children.find(tokens[pos]);
    if (it == node->children.end()) return nullptr;
    const size_t k = common_prefix(it->second->key, tokens.subspan(pos));
    if (k < it->second->key.size()) return nullptr;
    pos += k;
    node = it->second;
  }
  return node == &root_ ? nullptr : node;
}

// The node at exactly `tokens`, made if the tree lacks it: a leaf for the rest of the path, after
// splitting the edge the path leaves inside (a new interior node takes the edge's first tokens; the old
// child keeps the rest, its id and its snapshot, which is the state at the deep end). Strong guarantee:
// every allocation is made before the tree is touched, so a std::bad_alloc leaves it as it was.
RadixCache::Node* RadixCache::insert_path(std::span<const int32_t> tokens) {
  Node* node = &root_;
  Node* cut = nullptr;  // the child whose edge the path leaves (or ends) inside
  size_t pos = 0, k = 0;
  while (pos < tokens.size()) {
    const auto it = node->children.find(tokens[pos]);
    if (it == node->children.end()) break;
    Node* c = it->second;
    k = common_prefix(c->key, tokens.subspan(pos));
    pos += k;
    if (k < c->key.size()) {
      cut = c;
      break;
    }
    node = c;
  }
  if (!cut && pos == tokens.size()) return node;

  // Allocations: the new nodes, their edges, their child maps and their ids' entries.
  NodeId id = next_id_;
  auto make = [&](Node* parent, std::vector<int32_t> key) {
    auto n = std::make_unique<Node>();
    n->id = id++;
    n->parent = parent;
    n->depth = parent->depth + static_cast<int64_t>(key.size());
    n->key = std::move(key);
    return n;
  };
  auto head = [](const std::vector<int32_t>& v, size_t k) {
    return v.empty() ? std::vector<int32_t>{}
                     : std::vector<int32_t>(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k));
  };
  std::unique_ptr<Node> mid, leaf;
  if (cut) {
    mid =
        make(node, std::vector<int32_t>(cut->key.begin(), cut->key.begin() + static_cast<std::ptrdiff_t>(k)));
    mid->kv = head(cut->kv, k);
    mid->children.emplace(cut->key[k], cut);
  }
  Node* leaf_parent = mid ? mid.get() : node;
  if (pos < tokens.size()) {
    leaf = make(leaf_parent,
                std::vector<int32_t>(tokens.begin() + static_cast<std::ptrdiff_t>(pos), tokens.end()));
    if (kv_pool_) leaf->kv.assign(leaf->key.size(), -1);  // filled by the commit
    if (mid) mid->children.emplace(leaf->key[0], leaf.get());
  }
  Node* const result = leaf ? leaf.get() : mid.get();
  std::vector<NodeId> registered;
  registered.reserve(2);
  try {
    for (auto* owned : {&mid, &leaf}) {
      if (!*owned) continue;
      const NodeId nid = (*owned)->id;
      nodes_.emplace(nid, nullptr);
      registered.push_back(nid);
    }
    // The one insertion into a node already in the tree: a map insert changes nothing when it throws.
    if (leaf && !mid) node->children.emplace(leaf->key[0], leaf.get());
  } catch (...) {
    for (const NodeId nid : registered) nodes_.erase(nid);
    throw;
  }

  // Nothing below allocates.
  next_id_ = id;
  if (mid) {
    node->children.find(cut->key[0])->second = mid.get();  // same first token as the edge it cuts
    cut->key.erase(cut->key.begin(), cut->key.begin() + static_cast<std::ptrdiff_t>(k));
    if (!cut->kv.empty()) cut->kv.erase(cut->kv.begin(), cut->kv.begin() + static_cast<std::ptrdiff_t>(k));
    cut->parent = mid.get();
    nodes_.find(mid->id)->second = std::move(mid);
  }
  if (leaf) {
    total_tokens_ += static_cast<int64_t>(leaf->key.size());
    nodes_.find(leaf->id)->second = std::move(leaf);
  }
  return result;
}

Snapshot RadixCache::reserve(std::span<const int32_t> tokens, int64_t len) {
  check_len(tokens, len, "RadixCache::reserve");
  if (!enabled()) return {};
  const auto path = tokens.first(static_cast<size_t>(len));
  if (Node* n = find_exact(path); n && n->state != SnapshotState::None) {
    touch(n);
    return describe(n, false);
  }
  // Evicts until the pool has a slot and the budget room for one more snapshot and the path's new tokens.
  // The path is walked only afterwards: evicting a snapshot below it may prune or merge its nodes.
  while (snapshots_ >= max_snapshots_ || pool_->available() == 0 || !fits(path)) {
    if (lru_.empty()) return {};
    evict_lru();
  }
  // The slot first: a pool that throws leaves the tree without a node that holds nothing.
  const int32_t slot = pool_->alloc(1)[0];
  Node* n = nullptr;
  try {
    n = insert_path(path);
  } catch (...) {
    pool_->free({&slot, 1});
    throw;
  }
  n->slot = slot;
  is_snapshot_slot_[n->slot] = 1;
  n->state = SnapshotState::Pending;
  ++snapshots_;
  ++pending_;
  touch(n);
  return describe(n, true);
}

// Whether one more snapshot at `path`, and the tokens the tree lacks of it, stay within the budget.
bool RadixCache::fits(std::span<const int32_t> path) const {
  const Node* node = &root_;
  size_t pos = 0;
  while (pos < path.size()) {
    const auto it = node->children.find(path[pos]);
    if (it == node->children.end()) break;
    const size_t k = common_prefix(it->second->key, path.subspan(pos));
    pos += k;
    if (k < it->second->key.size()) break;
    node = it->second;
  }
  const size_t tokens = static_cast<size_t>(total_tokens_) + (path.size() - pos);
  return static_cast<size_t>(snapshots_ + 1) * bytes_per_slot_ + tokens * kv_bytes_ <= budget_bytes_;
}

void RadixCache::commit(NodeId id, std::span<const int32_t> kv_slots) {
  Node* n = get(id, "commit");
  if (n->state != SnapshotState::Pending) {
    throw std::logic_error("RadixCache::commit: node " + str(id) + " is not pending (it is " +
                           name(n->state) + ")");
  }
  if (kv_pool_) {
    if (static_cast<int64_t>(kv_slots.size()) < n->depth)
      throw std::invalid_argument("RadixCache::commit: node " + str(id) + " is " + str(n->depth) +
                                  " tokens deep but " + str(static_cast<int64_t>(kv_slots.size())) +
                                  " KV slots were given");
    std::vector<std::pair<int32_t*, int32_t>> fill;  // (edge entry, slot) of every token still at -1
    for (Node* c = n; c != &root_; c = c->parent) {
      const int64_t start = c->depth - static_cast<int64_t>(c->key.size());
      for (size_t i = 0; i < c->kv.size(); ++i)
        if (c->kv[i] < 0) fill.emplace_back(&c->kv[i], kv_slots[static_cast<size_t>(start) + i]);
    }
    std::vector<int32_t> refs;
    refs.reserve(fill.size());
    for (const auto& f : fill) refs.push_back(f.second);
    kv_pool_->inc_ref(refs);  // every slot allocated and listed once, checked before any reference
    for (const auto& [entry, slot] : fill) *entry = slot;
    kv_refs_ += static_cast<int64_t>(fill.size());
  }
  n->state = SnapshotState::Ready;
  --pending_;
  touch(n);  // joins the LRU set as the newest, unless locked
}

void RadixCache::abort(NodeId id) {
  Node* n = get(id, "abort");
  if (n->state != SnapshotState::Pending) {
    throw std::logic_error("RadixCache::abort: node " + str(id) + " is not pending (it is " + name(n->state) +
                           ")");
  }
  --pending_;
  release(n);  // a locked node (waiters) stays, with no snapshot, until its last dec_lock_ref
}

Snapshot RadixCache::insert(std::span<const int32_t> tokens, int64_t len, int32_t src_slot,
                            std::span<const int32_t> kv_slots) {
  check_len(tokens, len, "RadixCache::insert");
  if (kv_pool_ && static_cast<int64_t>(kv_slots.size()) < len)
    throw std::invalid_argument("RadixCache::insert: " + str(len) + " tokens but " +
                                str(static_cast<int64_t>(kv_slots.size())) + " KV slots");
  if (kv_pool_)
    for (const int32_t k : kv_slots.first(static_cast<size_t>(len)))
      if (!kv_pool_->is_allocated(k))
        throw std::invalid_argument("RadixCache::insert: KV slot " + str(k) + " is not allocated");
  if (!pool_->is_allocated(src_slot)) {
    throw std::invalid_argument("RadixCache::insert: source slot " + str(src_slot) + " is not allocated");
  }
  // A snapshot's own slot could be evicted by the reserve below before the copy reads it.
  if (is_snapshot_slot_[src_slot]) {
    throw std::invalid_argument("RadixCache::insert: source slot " + str(src_slot) +
                                " is a cached snapshot, not a request's slot");
  }
  Snapshot s = reserve(tokens, len);
  if (s.created) {
    pool_->copy_slot(src_slot, s.slot);
    commit(s.node, kv_slots);
    s.state = SnapshotState::Ready;
  }
  return s;
}

void RadixCache::inc_lock_ref(NodeId id) {
  Node* n = get(id, "inc_lock_ref");
  if (n->state == SnapshotState::None) {
    throw std::logic_error("RadixCache::inc_lock_ref: node " + str(id) + " has no snapshot to protect");
  }
  if (evictable(n)) lru_remove(n);
  ++n->lock_ref;
}

void RadixCache::dec_lock_ref(NodeId id) {
  Node* n = get(id, "dec_lock_ref");
  if (n->lock_ref == 0)
    throw std::logic_error("RadixCache::dec_lock_ref: node " + str(id) + " is not locked");
  if (--n->lock_ref > 0) return;
  if (n->state == SnapshotState::Ready) lru_add(n);
  if (n->state == SnapshotState::None) prune(n);  // its pending snapshot was aborted while locked
}

void RadixCache::evict_lru() {
  Node* n = nodes_.at(lru_.begin()->second).get();
  lru_.erase(lru_.begin());
  ++evictions_;
  release(n);
}

void RadixCache::release(Node* n) {
  pool_->free({&n->slot, 1});
  is_snapshot_slot_[n->slot] = 0;
  n->slot = -1;
  n->state = SnapshotState::None;
  --snapshots_;
  prune(n);
}

// Removes nodes that hold nothing (no snapshot, no lock, no child) upwards, then merges a remaining empty
// node that has one child into it, so that the tree only keeps tokens something below still uses.
void RadixCache::prune(Node* n) {
  auto empty = [this](const Node* x) {
    return x != &root_ && x->state == SnapshotState::None && x->lock_ref == 0;
  };
  while (empty(n) && n->children.empty()) {
    Node* parent = n->parent;
    drop_kv(n);
    parent->children.erase(n->key[0]);
    total_tokens_ -= static_cast<int64_t>(n->key.size());
    nodes_.erase(n->id);
    n = parent;
  }
  if (empty(n) && n->children.size() == 1) {
    Node* child = n->children.begin()->second;
    child->key.insert(child->key.begin(), n->key.begin(), n->key.end());
    child->kv.insert(child->kv.begin(), n->kv.begin(), n->kv.end());
    child->parent = n->parent;
    n->parent->children[n->key[0]] = child;
    nodes_.erase(n->id);
  }
}

int64_t RadixCache::evict(int64_t n_snapshots) {
  if (n_snapshots < 0)
    throw std::invalid_argument("RadixCache::evict: n_snapshots must be >= 0, got " + str(n_snapshots));
  int64_t done = 0;
  while (done < n_snapshots && !lru_.empty()) {
    evict_lru();
    ++done;
  }
  return done;
}

size_t RadixCache::evict_bytes(size_t bytes) {
  const auto n = static_cast<int64_t>((bytes + bytes_per_slot_ - 1) / bytes_per_slot_);
  return static_cast<size_t>(evict(n)) * bytes_per_slot_;
}

bool RadixCache::ensure_free_slots(int64_t n) {
  if (n < 0) throw std::invalid_argument("RadixCache::ensure_free_slots: n must be >= 0, got " + str(n));
  if (pool_->available() + evictable_snapshots() < n) return false;
  while (pool_->available() < n) evict_lru();
  return true;
}

void RadixCache::drop_kv(Node* n) {
  std::vector<int32_t> refs;
  for (const int32_t k : n->kv)
    if (k >= 0) refs.push_back(k);
  if (kv_pool_) kv_pool_->free(refs);
  kv_refs_ -= static_cast<int64_t>(refs.size());
  n->kv.assign(n->kv.size(), -1);
}

// Post-order over the tree: visit(node, open) with open = the node's subtree holds a Pending or locked node
// (the only place where an edge token may still wait for its KV slot, and what eviction cannot reach).
void RadixCache::walk_post_order(const std::function<void(const Node*, bool)>& visit) const {
  std::unordered_map<const Node*, bool> open;
  std::vector<std::pair<const Node*, bool>> stack{{&root_, false}};
  while (!stack.empty()) {
    auto [n, expanded] = stack.back();
    stack.pop_back();
    if (!expanded) {
      stack.emplace_back(n, true);
      for (const auto& [first, c] : n->children) stack.emplace_back(c, false);
      continue;
    }
    bool o = n->state == SnapshotState::Pending || n->lock_ref > 0;
    for (const auto& [first, c] : n->children) o = o || open[c];
    open[n] = o;
    visit(n, o);
  }
}

int64_t RadixCache::evictable_kv_tokens() const {
  if (!kv_pool_) return 0;
  // A node goes once everything evictable went iff its subtree holds no Pending or locked node.
  int64_t freed = 0;
  walk_post_order([&](const Node* n, bool open) {
    if (open || n == &root_) return;
    for (const int32_t k : n->kv)
      if (k >= 0 && kv_pool_->ref_count(k) == 1) ++freed;
  });
  return freed;
}

bool RadixCache::ensure_free_kv_tokens(int64_t n) {
  if (n < 0) throw std::invalid_argument("RadixCache::ensure_free_kv_tokens: n must be >= 0, got " + str(n));
  const int64_t free = kv_pool_ ? kv_pool_->available() : 0;
  if (free >= n) return true;
  if (free + evictable_kv_tokens() < n) return false;
  while (kv_pool_->available() < n && !lru_.empty()) evict_lru();
  return kv_pool_->available() >= n;
}

int64_t RadixCache::kv_tokens_held_alone() const {
  if (!kv_pool_) return 0;
  int64_t alone = 0;
  std::vector<const Node*> stack{&root_};
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    for (const auto& [first, c] : n->children) stack.push_back(c);
    for (const int32_t k : n->kv)
      if (k >= 0 && kv_pool_->ref_count(k) == 1) ++alone;
  }
  return alone;
}

SnapshotState RadixCache::state(NodeId id) const { return get(id, "state")->state; }

int64_t RadixCache::lock_ref(NodeId id) const { return get(id, "lock_ref")->lock_ref; }

void RadixCache::check_invariants() const {
  auto fail = [](const std::string& what) { throw std::logic_error("RadixCache invariant: " + what); };
  int64_t nodes = 0, snaps = 0, pending = 0, tokens = 0, evictable_n = 0;
  std::vector<uint8_t> seen(is_snapshot_slot_.size(), 0);
  std::vector<const Node*> stack{&root_};
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    for (const auto& [first, c] : n->children) {
      const std::string id = "node " + str(c->id);
      if (c->parent != n) fail(id + " has a wrong parent");
      if (c->key.empty() || c->key[0] != first)
        fail(id + " is filed under a token its edge does not start with");
      if (c->depth != n->depth + static_cast<int64_t>(c->key.size())) fail(id + " has a wrong depth");
      const auto it = nodes_.find(c->id);
      if (it == nodes_.end() || it->second.get() != c) fail(id + " is not registered");
      if (c->lock_ref < 0) fail(id + " has a negative lock count");
      if (c->state == SnapshotState::None) {
        if (c->slot != -1) fail(id + " holds a slot without a snapshot");
        if (c->lock_ref == 0 && c->children.size() < 2) fail(id + " holds nothing and was not pruned");
      } else {
        if (c->slot < 1 || c->slot >= static_cast<int32_t>(seen.size()) || !pool_->is_allocated(c->slot))
          fail(id + " holds slot " + str(c->slot) + " that the pool has not handed out");
        if (seen[c->slot]++ || !is_snapshot_slot_[c->slot]) fail("slot " + str(c->slot) + " is misaccounted");
        ++snaps;
        if (c->state == SnapshotState::Pending) ++pending;
      }
      const bool in_lru = lru_.count({c->last_access, c->id}) != 0;
      if (in_lru != evictable(c))
        fail(id + (in_lru ? " is in the LRU set but not evictable" : " is missing from the LRU set"));
      evictable_n += evictable(c);
      ++nodes;
      tokens += static_cast<int64_t>(c->key.size());
      stack.push_back(c);
    }
  }
  if (nodes != node_count()) fail("the tree reaches " + str(nodes) + " of " + str(node_count()) + " nodes");
  if (snaps != snapshots_ || pending != pending_) fail("snapshot counters disagree with the tree");
  if (evictable_n != evictable_snapshots()) fail("the LRU set holds stale entries");
  if (tokens != total_tokens_) fail("total_size disagrees with the edges");
  if (snapshots_ > max_snapshots_ || bytes() > budget_bytes_) fail("more held than the budget allows");
  check_kv();
  int64_t marked = 0;
  for (const uint8_t m : is_snapshot_slot_) marked += m;
  if (marked != snapshots_) fail("snapshot slot marks disagree with the tree");
}

void RadixCache::check_kv() const {
  auto fail = [](const std::string& what) { throw std::logic_error("RadixCache invariant: " + what); };
  std::unordered_map<int32_t, int32_t> held;  // slot -> references the tree holds
  int64_t refs = 0;
  walk_post_order([&](const Node* n, bool o) {
    if (n == &root_) return;
    const std::string id = "node " + str(n->id);
    if (!kv_pool_) {
      if (!n->kv.empty()) fail(id + " holds KV slots without a KV pool");
      return;
    }
    if (n->kv.size() != n->key.size())
      fail(id + " has " + str(static_cast<int64_t>(n->kv.size())) + " KV slots for " +
           str(static_cast<int64_t>(n->key.size())) + " tokens");
    for (const int32_t k : n->kv) {
      if (k < 0) {
        if (!o) fail(id + " has a token without KV although no pending or locked node lies below it");
        continue;
      }
      if (!kv_pool_->is_allocated(k)) fail(id + " references KV slot " + str(k) + ", which is free");
      ++held[k];
      ++refs;
    }
  });
  for (const auto& [slot, count] : held)
    if (kv_pool_->ref_count(slot) < count)
      fail("KV slot " + str(slot) + " has " + str(kv_pool_->ref_count(slot)) +
           " references, the tree holds " + str(count));
  if (refs != kv_refs_) fail("the KV reference counter disagrees with the edges");
}

}  // namespace kda::mem_cache
