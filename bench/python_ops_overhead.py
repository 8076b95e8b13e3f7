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


def python_time(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


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
        cc.append(_kda._time_kda_op(1, True, q, k, v, g, beta, None, h0, True, False, False, None, None, None, None,
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
        cc.append(_kda._time_kda_op(n, False, q, k, v, g, beta, None, pool, False, True, True, A_log, dt_bias,
                                    None, idx, True))
    p, c = statistics.median(py), statistics.median(cc)
    print(f"fused_recurrent_kda batch 1 (in-place pool, 32x128): python {p * 1e6:.1f} us, "
          f"C++ {c * 1e6:.1f} us, overhead {(p - c) * 1e6:.1f} us per call")

    # The fla (not in-place) decode: a new final state, seeded from initial_state by one 2 MiB copy.
    h0 = torch.zeros(1, H, K, V)

    def decode_copy():
        fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    decode_copy()
    py, cc = [], []
    for _ in range(args.reps):
        py.append(python_time(decode_copy, n // 4))
        cc.append(_kda._time_kda_op(n // 4, False, q, k, v, g, beta, None, h0, True, False, False, None, None,
                                    None, None, False))
    p, c = statistics.median(py), statistics.median(cc)
    print(f"fused_recurrent_kda batch 1 (new final state, fla's default): python {p * 1e6:.1f} us, "
          f"C++ kernel {c * 1e6:.1f} us, overhead {(p - c) * 1e6:.1f} us per call (allocation + state copy)")


if __name__ == "__main__":
    main()
