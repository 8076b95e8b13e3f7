"""Binding overhead of kda.ops over the same C++ kernel call (a benchmark, not a test).

    PYTHONPATH=build/python /usr/bin/python3 bench/python_ops_overhead.py [--threads N] [--reps R]

chunk_kda: 1 x 4096 tokens, 32 heads x 128 (fp32 torch): the kda.ops call vs _kda._time_kda_op, which
prepares the same arguments once and times the C++ dispatcher call alone on the same buffers.
fused_recurrent_kda, batch 1 (one token, 32 x 128, the in-place pool decode of vLLM / sglang): the
overhead in microseconds per call. Both sides are timed as the median of several rounds, alternating,
so that a load change on a shared machine hits both.
"""

import argparse
import statistics
import time

import torch

import kda
from kda import _kda
from kda.ops import chunk_kda, fused_recurrent_kda


# CPU time of this process rather than wall time: on a machine shared with other work, wall time counts
# the slices other processes get; with more than one kernel thread it sums the threads (both sides alike).
clock = time.process_time


def python_time(fn, n):
    t0 = clock()
    for _ in range(n):
        fn()
    return (clock() - t0) / n


def cxx_time(n, *args):
    """_kda._time_kda_op's n calls plus its warm-up call, timed with the same clock; its one prepare is
    counted too, which leaves the comparison conservative."""
    t0 = clock()
    _kda._time_kda_op(n, *args)
    return (clock() - t0) / (n + 1)


def inputs(B, T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.exp(torch.randn(B, T, H, K, generator=gen) - 2)
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0, help="kda.set_num_threads (0: OpenMP's default)")
    ap.add_argument("--reps", type=int, default=5, help="rounds per measurement")
    args = ap.parse_args()
    if args.threads:
        kda.set_num_threads(args.threads)
    print(f"threads: {kda.get_num_threads()}")

    H, K, V = 32, 128, 128
    q, k, v, g, beta = inputs(1, 4096, H, K, V)
    h0 = torch.zeros(1, H, K, V)
    py, cc = [], []
    chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)  # warm-up
    for _ in range(args.reps):
        py.append(python_time(lambda: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True), 1))
        cc.append(cxx_time(1, True, q, k, v, g, beta, None, h0, True, False, False, None, None, None, None,
                                    False))
    p, c = statistics.median(py), statistics.median(cc)
    print(f"chunk_kda 1x4096 32x128 fp32: python {p * 1e3:.2f} ms, C++ {c * 1e3:.2f} ms, "
          f"overhead {(p - c) * 1e6:.0f} us = {100 * (p - c) / c:.2f} %")

    q, k, v, g, beta = inputs(1, 1, H, K, V, seed=1)
    pool = torch.zeros(4, H, K, V)
    idx = torch.tensor([2], dtype=torch.int32)
    A_log, dt_bias = torch.zeros(1, 1, H, 1), torch.zeros(H * K)

    def decode():
        fused_recurrent_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, ssm_state_indices=idx,
                            inplace_final_state=True)

    n = 2000
    decode()
    py, cc = [], []
    for _ in range(args.reps):
        py.append(python_time(decode, n))
        cc.append(cxx_time(n, False, q, k, v, g, beta, None, pool, False, True, True, A_log, dt_bias,
                                    None, idx, True))
    p, c = statistics.median(py), statistics.median(cc)
    print(f"fused_recurrent_kda batch 1 (in-place pool, 32x128): python {p * 1e6:.1f} us, "
          f"C++ {c * 1e6:.1f} us, overhead {(p - c) * 1e6:.1f} us per call")

    # The binding's fixed cost alone: one head, whose state stays in the L1/L2 cache in both loops (at
    # 32 heads the 2 MiB state fills a 2 MiB L2, and the interpreter's work between Python calls evicts
    # part of it, which the back-to-back C++ loop never sees).
    q1, k1, v1, g1, beta1 = (x[:, :, :1].contiguous() for x in (q, k, v, g, beta))
    pool1 = torch.zeros(4, 1, K, V)
    A_log1, dt_bias1 = A_log[:, :, :1].contiguous(), dt_bias[:K].contiguous()

    def decode1():
        fused_recurrent_kda(q1, k1, v1, g1, beta1, A_log=A_log1, dt_bias=dt_bias1, initial_state=pool1,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, ssm_state_indices=idx,
                            inplace_final_state=True)

    decode1()
    py, cc = [], []
    for _ in range(args.reps):
        py.append(python_time(decode1, n))
        cc.append(cxx_time(n, False, q1, k1, v1, g1, beta1, None, pool1, False, True, True, A_log1, dt_bias1, None,
                           idx, True))
    p, c = statistics.median(py), statistics.median(cc)
    print(f"fused_recurrent_kda batch 1 (in-place pool, 1x128): python {p * 1e6:.1f} us, "
          f"C++ {c * 1e6:.1f} us, overhead {(p - c) * 1e6:.1f} us per call")

    # The fla (not in-place) decode: a new final state, seeded from initial_state by one 2 MiB copy.
    h0 = torch.zeros(1, H, K, V)

    def decode_copy():
        fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    decode_copy()
    py, cc = [], []
    for _ in range(args.reps):
        py.append(python_time(decode_copy, n // 4))
        cc.append(cxx_time(n // 4, False, q, k, v, g, beta, None, h0, True, False, False, None, None,
                                    None, None, False))
    p, c = statistics.median(py), statistics.median(cc)
    print(f"fused_recurrent_kda batch 1 (new final state, fla's default): python {p * 1e6:.1f} us, "
          f"C++ kernel {c * 1e6:.1f} us, overhead {(p - c) * 1e6:.1f} us per call (allocation + state copy)")


if __name__ == "__main__":
    main()
