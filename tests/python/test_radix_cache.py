"""Prefix caching from Python: ForwardBatch.state_snapshots takes a state in the middle of an EXTEND, a
RadixCache holds it, a later request that shares the prefix matches it and resumes from a copy in its own
slot -- the same continuation as the request run without the cache; the cache's bookkeeping (insert,
locks, eviction) and its bad inputs, which change nothing."""

import gc

import kda_paths  # noqa: F401  (puts the built package on sys.path)
import numpy as np
import pytest

import kda
from test_component import LAYER, make_pools

VOCAB = 1000


@pytest.fixture(scope="module")
def embed(config):
    """Token id -> hidden state: a fixed random table, so that equal prefixes are equal inputs."""
    return np.random.default_rng(7).standard_normal((VOCAB, config.hidden_size), dtype=np.float32)


def run(layer, backend, pools, fb, embed, tokens):
    backend.init_forward_metadata(fb, pools)
    return layer(np.ascontiguousarray(embed[tokens]), fb, pools)


def states(pools, req):
    slot = pools.req_to_token_pool.slot_of(req)
    return pools.recurrent_state_pool.read_linear_recurrent_layer_cache(LAYER, [slot])


def snapshot_states(pools, slot):
    return pools.recurrent_state_pool.read_linear_recurrent_layer_cache(LAYER, [slot])


def cold_continuation(layer, config, embed, prompt, split):
    """Request B without a cache: its prefix, then the rest from the state it left. The output of the rest
    and the states after."""
    pools = make_pools(config, 2, layer.precision)
    backend = kda.KDAAttnBackend()
    [req] = pools.req_to_token_pool.alloc(1)
    run(layer, backend, pools, kda.ForwardBatch.extend([req], [split]), embed, prompt[:split])
    fb = kda.ForwardBatch.extend([req], [len(prompt) - split], [split])
    y = run(layer, backend, pools, fb, embed, prompt[split:])
    return y, states(pools, req)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("split", [100, 128])  # inside a chunk, at a chunk boundary
def test_snapshot_matched_and_restored_continues_as_cold_run(config, layers, embed, precision, split):
    layer = layers[precision]
    rng = np.random.default_rng(split)
    shared = rng.integers(0, VOCAB, split, dtype=np.int32)
    prompt_a = np.concatenate([shared, rng.integers(0, VOCAB, 30, dtype=np.int32)])
    prompt_b = np.concatenate([shared, rng.integers(0, VOCAB, 37, dtype=np.int32)])
    assert prompt_a[split] != prompt_b[split]  # the prompts branch right after the shared prefix

    pools = make_pools(config, 4, precision)
    pool = pools.recurrent_state_pool
    cache = kda.RadixCache(pools, 2 * pool.bytes_per_slot)  # room for two snapshots
    assert cache.enabled and cache.max_snapshots == 2 and cache.bytes_per_slot == pool.bytes_per_slot
    backend = kda.KDAAttnBackend()

    # Request A: one EXTEND of its whole prompt, keeping the state after the shared prefix.
    [req_a] = pools.req_to_token_pool.alloc(1)
    snap = cache.reserve(prompt_a, split)
    assert snap and snap.created and snap.state == kda.SnapshotState.PENDING and snap.len == split
    assert not pool.is_allocated(0) and pool.is_allocated(snap.slot)
    fb = kda.ForwardBatch.extend([req_a], [len(prompt_a)], state_snapshots=[kda.StateSnapshot(0, split, snap.slot)])
    assert fb.state_snapshots == [kda.StateSnapshot(row=0, pos=split, slot=snap.slot)]
    assert fb.state_snapshots[0] != (0, split, snap.slot)  # a StateSnapshot equals only a StateSnapshot
    run(layer, backend, pools, fb, embed, prompt_a)
    # Written by the forward, committed by the scheduler.
    assert cache.match_prefix(prompt_b[:-1]).pending.node == snap.node
    cache.commit(snap.node)
    assert cache.state(snap.node) == kda.SnapshotState.READY

    # Request B matches the shared prefix (its prompt as a NumPy int32 array: read in place) ...
    m = cache.match_prefix(prompt_b[:-1])
    assert m.hit.node == snap.node and m.hit.len == split and m.matched_len == split and not m.pending
    # ... resumes from a copy in its own slot, and prefills the rest.
    [req_b] = pools.req_to_token_pool.alloc(1)
    cache.inc_lock_ref(m.hit.node)
    assert cache.lock_ref(m.hit.node) == 1 and cache.evictable_snapshots == 0
    pool.copy_slot(m.hit.slot, pools.req_to_token_pool.slot_of(req_b))
    cache.dec_lock_ref(m.hit.node)
    fb = kda.ForwardBatch.extend([req_b], [len(prompt_b) - m.hit.len], [m.hit.len])
    y = run(layer, backend, pools, fb, embed, prompt_b[m.hit.len :])
    rec, conv = states(pools, req_b)

    # The same continuation as B run without the cache, bit for bit: the snapshot is the state of the
    # prefix, in both precisions.
    y_cold, (rec_cold, conv_cold) = cold_continuation(layer, config, embed, prompt_b, split)
    assert np.array_equal(y, y_cold)
    assert np.array_equal(rec, rec_cold) and np.array_equal(conv, conv_cold)
    # And the snapshot was the prefix's state, not B's zero state: from nothing the output differs.
    fresh = make_pools(config, 1, precision)
    [r] = fresh.req_to_token_pool.alloc(1)
    y_nothing = run(layer, kda.KDAAttnBackend(), fresh, kda.ForwardBatch.extend([r], [len(y)]), embed, prompt_b[split:])
    assert not np.allclose(y, y_nothing, rtol=1e-2, atol=1e-3)
    cache.check_invariants()


def test_one_extend_cold_run_within_fp32_rounding(config, layers, embed):
    """Against B prefilled in one EXTEND from nothing: the same values up to fp32 rounding (a chunk grid and
    GEMM row count of its own)."""
    layer = layers["fp32"]
    split = 100
    prompt = np.random.default_rng(3).integers(0, VOCAB, split + 40, dtype=np.int32)
    pools = make_pools(config, 3, "fp32")
    cache = kda.RadixCache(pools.recurrent_state_pool, pools.recurrent_state_pool.bytes_per_slot)
    backend = kda.KDAAttnBackend()
    [a] = pools.req_to_token_pool.alloc(1)
    s = cache.reserve(prompt[:split].tolist(), split)  # a list of ints: converted
    fb = kda.ForwardBatch.extend([a], [split + 10], state_snapshots=[(0, split, s.slot)])  # a triple
    run(layer, backend, pools, fb, embed, prompt[: split + 10])
    cache.commit(s.node)
    m = cache.match_prefix(prompt[:-1])
    [b] = pools.req_to_token_pool.alloc(1)
    pools.recurrent_state_pool.copy_slot(m.hit.slot, pools.req_to_token_pool.slot_of(b))
    y = run(layer, backend, pools, kda.ForwardBatch.extend([b], [40], [split]), embed, prompt[split:])
    one = make_pools(config, 1, "fp32")
    [c] = one.req_to_token_pool.alloc(1)
    y_one = run(layer, backend, one, kda.ForwardBatch.extend([c], [split + 40]), embed, prompt)[split:]
    rel = np.linalg.norm(y - y_one) / np.linalg.norm(y_one)
    print(f"restored vs one EXTEND: rel L2 {rel:.2e}")
    assert rel <= 1e-5


def test_insert_locks_and_eviction(config, layers, embed):
    """A finished request's state goes in with insert; locked snapshots stay, the least recently used
    unlocked one goes first, and ensure_free_slots evicts for an admission only when it can succeed."""
    layer = layers["fp32"]
    pools = make_pools(config, 4, "fp32")
    pool = pools.recurrent_state_pool
    cache = kda.RadixCache(pools, 2 * pool.bytes_per_slot)
    backend = kda.KDAAttnBackend()
    prompts = [np.arange(i * 100, i * 100 + 20, dtype=np.int32) for i in range(3)]
    reqs = pools.req_to_token_pool.alloc(2)
    for req, p in zip(reqs, prompts[:2]):
        run(layer, backend, pools, kda.ForwardBatch.extend([req], [len(p)]), embed, p)
        s = cache.insert(p, len(p), pools.req_to_token_pool.slot_of(req))
        assert s.created and s.state == kda.SnapshotState.READY
        assert np.array_equal(snapshot_states(pools, s.slot)[0], states(pools, req)[0])
    assert cache.snapshots == 2 and cache.total_size == 40 and pool.available == 0
    first = cache.match_prefix(prompts[0]).hit
    again = cache.insert(prompts[0], 20, pools.req_to_token_pool.slot_of(reqs[0]))
    assert again.node == first.node and not again.created  # the same tokens: the same state, no new slot

    cache.inc_lock_ref(first.node)
    assert not cache.ensure_free_slots(3)  # one evictable: cannot reach 3, so nothing goes
    assert cache.snapshots == 2 and cache.evictions == 0
    s3 = cache.reserve(prompts[2], 20)  # the full budget: the unlocked one is evicted for it
    assert s3 and cache.evictions == 1 and cache.snapshots == 2
    assert cache.contains(first.node) and not cache.match_prefix(prompts[1]).hit
    cache.abort(s3.node)
    assert cache.snapshots == 1 and pool.available == 1
    cache.dec_lock_ref(first.node)
    assert cache.evict(5) == 1 and cache.snapshots == 0 and pool.available == 2
    assert cache.node_count == 0
    cache.check_invariants()


def test_cache_keeps_its_pool_alive_and_returns_slots(config):
    pools = make_pools(config, 2, "fp32")
    pool = pools.recurrent_state_pool
    cache = kda.RadixCache(pool, pool.bytes_per_slot)
    del pools, pool
    gc.collect()
    s = cache.reserve([1, 2, 3], 3)
    assert s and cache.snapshots == 1  # the pool is still there
    cache.commit(s.node)
    pools = make_pools(config, 2, "fp32")
    cache = kda.RadixCache(pools, pools.recurrent_state_pool.bytes_per_slot)
    cache.insert([4, 5], 2, pools.recurrent_state_pool.alloc(1)[0])
    assert pools.recurrent_state_pool.available == 0
    del cache
    gc.collect()
    assert pools.recurrent_state_pool.available == 1  # the snapshot's slot went back


def test_disabled_cache_stores_nothing(config):
    pools = make_pools(config, 2, "fp32")
    cache = kda.RadixCache(pools, 0)
    assert not cache.enabled and not cache.reserve([1, 2], 2) and not cache.match_prefix([1]).hit
    assert pools.recurrent_state_pool.available == 2


def cache_view(cache, pool):
    return (cache.snapshots, cache.pending_snapshots, cache.node_count, cache.total_size, cache.evictions,
            cache.evictable_snapshots, pool.available)


def test_cache_bad_inputs_change_nothing(config):
    torch = pytest.importorskip("torch")
    pools = make_pools(config, 4, "fp32")
    pool = pools.recurrent_state_pool
    with pytest.raises(ValueError, match="budget"):
        kda.RadixCache(pools, 1)  # non-zero but under one slot
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        kda.RadixCache(pools, -1)
    with pytest.raises(TypeError, match="'pools'"):
        kda.RadixCache(config, 10**9)
    cache = kda.RadixCache(pools, 2 * pool.bytes_per_slot)
    ready = cache.insert(torch.arange(10, dtype=torch.int32), 10, pool.alloc(1)[0])  # torch: read in place
    pending = cache.reserve(np.arange(20, dtype=np.int64), 15)
    before = cache_view(cache, pool)
    bad = [
        (ValueError, "len 0 is outside", lambda: cache.reserve([1, 2, 3], 0)),
        (ValueError, "len 4 is outside", lambda: cache.reserve([1, 2, 3], 4)),
        (ValueError, "len 4 is outside", lambda: cache.insert([1, 2, 3], 4, 1)),
        (ValueError, "source slot 4 is not allocated", lambda: cache.insert([7, 8], 2, 4)),
        (ValueError, "is a cached snapshot", lambda: cache.insert([7, 8], 2, ready.slot)),
        (ValueError, "is not pending", lambda: cache.commit(ready.node)),
        (ValueError, "is not pending", lambda: cache.abort(ready.node)),
        (ValueError, "node 99", lambda: cache.commit(99)),
        (ValueError, "node 99", lambda: cache.inc_lock_ref(99)),
        (ValueError, "node 99", lambda: cache.state(99)),
        (ValueError, "is not locked", lambda: cache.dec_lock_ref(ready.node)),
        (ValueError, "n_snapshots must be >= 0", lambda: cache.evict(-1)),
        (ValueError, "must be >= 0", lambda: cache.ensure_free_slots(-2)),
        (ValueError, "must be >= 0", lambda: cache.evict_bytes(-2)),
        (ValueError, "dimensions", lambda: cache.match_prefix(np.zeros((2, 2), np.int32))),
        (TypeError, "must hold ints", lambda: cache.match_prefix(["a", "b"])),
        (TypeError, "'tokens' is None", lambda: cache.reserve(None, 1)),
        (ValueError, "outside int32", lambda: cache.match_prefix([2**40])),
    ]
    for exc, msg, call in bad:
        with pytest.raises(exc, match=msg):
            call()
        assert cache_view(cache, pool) == before, msg
        cache.check_invariants()
    assert cache.state(pending.node) == kda.SnapshotState.PENDING
    assert cache.match_prefix(list(range(10))).hit.node == ready.node
    # A stale handle: the node left the tree.
    cache.abort(pending.node)
    with pytest.raises(ValueError, match=f"node {pending.node}"):
        cache.commit(pending.node)
    cache.reset()
    assert not cache.contains(ready.node) and cache.snapshots == 0


def test_bad_state_snapshots_change_nothing(config, layers, embed):
    layer = layers["fp32"]
    pools = make_pools(config, 4, "fp32")
    pool = pools.recurrent_state_pool
    backend = kda.KDAAttnBackend()
    reqs = pools.req_to_token_pool.alloc(2)
    tokens = np.arange(12, dtype=np.int32)
    run(layer, backend, pools, kda.ForwardBatch.extend(reqs, [6, 6]), embed, tokens)
    [snap] = pool.alloc(1)
    [freed] = pool.alloc(1)
    pool.free([freed])
    own = pools.req_to_token_pool.slot_of(reqs[1])
    rec, conv = pool.recurrent_state(LAYER), pool.conv_state(LAYER)
    before = (rec.copy(), conv.copy())

    fb = kda.ForwardBatch.extend(reqs, [3, 4], [6, 6], state_snapshots=[(0, 1, snap)])
    for value, exc, msg in [
        ([(2, 1, snap)], ValueError, "row 2"),
        ([(0, 0, snap)], ValueError, "pos 0"),
        ([(1, 5, snap)], ValueError, "pos 5"),
        ([(0, 1, snap), (1, 2, snap)], ValueError, "two state snapshots"),
        ([(0, 1)], ValueError, r"not \(row, pos, slot\)"),
        ([(0, 1, "x")], TypeError, "must hold ints"),
        (5, TypeError, "state_snapshots"),
    ]:
        with pytest.raises(exc, match=msg):
            fb.state_snapshots = value
        assert fb.state_snapshots == [kda.StateSnapshot(0, 1, snap)], msg  # the batch as it was
    with pytest.raises(ValueError, match="EXTEND"):
        kda.ForwardBatch.decode(reqs).state_snapshots = [(0, 1, snap)]
    with pytest.raises(AttributeError):
        fb.state_snapshots[0].slot = own  # a copy: editing it would change nothing, so it cannot be edited
    assert f"state_snapshots=[StateSnapshot(row=0, pos=1, slot={snap})]" in repr(fb)

    x = np.ascontiguousarray(embed[np.arange(7)])
    for value, msg in [
        ([(0, 1, own)], "the slot of request 1"),
        ([(0, 1, freed)], "not an allocated slot"),
        ([(0, 1, 99)], "not an allocated slot"),
    ]:
        bad = kda.ForwardBatch.extend(reqs, [3, 4], [6, 6], state_snapshots=value)
        with pytest.raises(ValueError, match=msg):
            backend.init_forward_metadata(bad, pools)
            layer(x, bad, pools)
        assert np.array_equal(rec, before[0]) and np.array_equal(conv, before[1]), msg

    # Snapshots changed after init_forward_metadata would not be taken: an error, nothing written.
    backend.init_forward_metadata(fb, pools)
    fb.state_snapshots = []
    with pytest.raises(ValueError, match="forward metadata is not this batch's"):
        layer(x, fb, pools)
    assert np.array_equal(rec, before[0]) and np.array_equal(conv, before[1])
    fb.state_snapshots = [(0, 1, snap)]
    layer(x, fb, pools)  # as initialised: runs, and writes the snapshot
    assert rec[snap].any() and not np.array_equal(rec[own], before[0][own])
