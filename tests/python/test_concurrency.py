"""kda.ops from several Python threads at once (README, "Thread safety"): the binding releases the GIL
while a kernel runs, so 4 threading.Threads really run their kernels together. Each has its own inputs
and states (or its own slots of one shared pool); the results must equal a serial run's, bit for bit."""

import threading

import numpy as np
import pytest
import torch

import kda
from kda.ops import chunk_kda, fused_recurrent_kda

THREADS = 4
ROUNDS = 2
H, K, V = 4, 64, 64
CU = [0, 70, 71, 200]  # a varlen prefill: full chunks, a 1-token sequence, a short last chunk
N, T, STEPS = len(CU) - 1, CU[-1], 3


def run_concurrently(fn):
    """fn(i) on THREADS threads released together; returns their results, re-raises the first error."""
    barrier = threading.Barrier(THREADS)
    results, errors = [None] * THREADS, [None] * THREADS

    def worker(i):
        barrier.wait()
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001  (handed to the main thread)
            errors[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


def make_problem(seed, dtype):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def inputs(B, Tn):
        q, k, v, f = randn(B, Tn, H, K), randn(B, Tn, H, K), randn(B, Tn, H, V), randn(B, Tn, H, K) - 2
        beta = torch.sigmoid(randn(B, Tn, H))
        return [x.to(dtype) for x in (q, k, v, f, beta)]

    return dict(prefill=inputs(1, T), decode=[inputs(N, 1) for _ in range(STEPS)],
                A_log=0.5 * randn(1, 1, H, 1), dt_bias=0.5 * randn(H * K), h0=0.1 * randn(N, H, K, V))


def run_problem(p, pool, slots):
    """Prefill (chunk_kda from h0, final states into the pool's slots), then STEPS in-place decode steps
    (fused_recurrent_kda on the pool). Returns the outputs and the pool."""
    gate = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=p["A_log"], dt_bias=p["dt_bias"])
    cu = torch.tensor(CU, dtype=torch.int32)
    o, s = chunk_kda(*p["prefill"], initial_state=p["h0"], output_final_state=True, cu_seqlens=cu, **gate)
    pool[slots] = s
    outs = [o]
    idx = torch.tensor(slots, dtype=torch.int32)
    for q, k, v, f, beta in p["decode"]:
        o, _ = fused_recurrent_kda(q, k, v, f, beta, initial_state=pool, ssm_state_indices=idx,
                                   inplace_final_state=True, **gate)
        outs.append(o)
    return outs


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_on_distinct_states_equal_serial(dtype):
    problems = [make_problem(10 + i, dtype) for i in range(THREADS)]
    slots = list(range(1, N + 1))

    def run(i):
        pool = torch.zeros(N + 1, H, K, V)
        outs = run_problem(problems[i], pool, slots)
        return outs, pool

    want = [run(i) for i in range(THREADS)]
    for _ in range(ROUNDS):
        got = run_concurrently(run)
        for (go, gp), (wo, wp) in zip(got, want):
            assert same(go, wo)
            assert torch.equal(gp, wp)


def test_ops_on_disjoint_slots_of_one_pool_equal_serial():
    """One pool tensor shared by every thread, each decoding its own slots in place."""
    problems = [make_problem(40 + i, torch.float32) for i in range(THREADS)]
    slots = [list(range(1 + i * N, 1 + (i + 1) * N)) for i in range(THREADS)]
    pool0 = torch.full((1 + THREADS * N, H, K, V), 0.5)  # slot 0 must stay as it is
    want_pool = pool0.clone()
    want = [run_problem(problems[i], want_pool, slots[i]) for i in range(THREADS)]
    for _ in range(ROUNDS):
        pool = pool0.clone()
        got = run_concurrently(lambda i: run_problem(problems[i], pool, slots[i]))
        for g, w in zip(got, want):
            assert same(g, w)
        assert torch.equal(pool, want_pool)


def test_numpy_inputs_from_threads_equal_serial():
    """NumPy arrays (the buffer protocol path): chunk_kda alone, new output and final state per call."""
    rng = np.random.default_rng(3)
    calls = []
    for _ in range(THREADS):
        q, k, v = (rng.standard_normal((1, T, H, d), dtype=np.float32) for d in (K, K, V))
        g = -np.exp(rng.standard_normal((1, T, H, K), dtype=np.float32) - 2)
        beta = rng.uniform(0.05, 0.95, (1, T, H)).astype(np.float32)
        calls.append((q, k, v, g, beta))

    def run(i):
        return chunk_kda(*calls[i], output_final_state=True, use_qk_l2norm_in_kernel=True,
                         cu_seqlens=np.array(CU, dtype=np.int32))

    want = [run(i) for i in range(THREADS)]
    for _ in range(ROUNDS):
        for got, w in zip(run_concurrently(run), want):
            assert all(np.array_equal(a, b) for a, b in zip(got, w))


def test_set_num_threads_applies_to_every_thread():
    """kda.set_num_threads is process-wide: a call from another Python thread sees it too."""
    prev = kda.get_num_threads()
    try:
        kda.set_num_threads(1)
        seen = run_concurrently(lambda i: kda.get_num_threads())
        assert seen == [1] * THREADS
        kda.set_num_threads(2)
        assert run_concurrently(lambda i: kda.get_num_threads()) == [2] * THREADS
    finally:
        kda.set_num_threads(prev)
