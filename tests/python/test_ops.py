"""kda.ops (fla's chunk_kda / fused_recurrent_kda) against the float64 per-token recurrence."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import kda
from kda.ops import chunk_kda, fused_recurrent_kda
from kda_reference import kda_recurrence, rel_l2, spec_excess, to_f64

OPS = {"chunk": chunk_kda, "fused": fused_recurrent_kda}


def make_inputs(B, T, H, K, V, seed=0, gate="g", l2norm=False, spikes=True):
    """fla-shaped fp32 torch inputs. Gates are mild (about -0.15 per step) with, when spikes, some
    steps down to -1e3 (the channel is forgotten); gate='in_kernel' gives the raw f with A_log
    [1, 1, H, 1] and dt_bias [H*K] as the checkpoint stores them."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = randn(B, T, H, K)
    k = randn(B, T, H, K)
    if l2norm:
        q, k = 3 * q, 3 * k  # the kernel normalizes
    else:
        k = k / k.norm(dim=-1, keepdim=True)  # the delta rule needs unit keys to stay bounded
    v = randn(B, T, H, V)
    beta = torch.sigmoid(randn(B, T, H))
    extra = {}
    if gate == "g":
        g = -torch.exp(0.5 * randn(B, T, H, K) - 2)
        if spikes:
            g[torch.rand(B, T, H, K, generator=gen) < 0.01] = -1e3
    else:
        A_log = 0.5 * randn(1, 1, H, 1)
        dt_bias = 0.5 * randn(H * K)
        g = randn(B, T, H, K) - 2
        if spikes:  # softplus(f) ~ f: g ~ -exp(A_log) * 1e3
            g[torch.rand(B, T, H, K, generator=gen) < 0.01] = 1e3
        extra = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    return q, k, v, g, beta, extra


def reference(q, k, v, g, beta, extra, **kw):
    return kda_recurrence(q, k, v, g, beta, A_log=extra.get("A_log"), dt_bias=extra.get("dt_bias"), **kw)


def as_kind(kind, *xs):
    return tuple(x.numpy() if kind == "numpy" and isinstance(x, torch.Tensor) else x for x in xs)


@pytest.mark.parametrize("op", ["chunk", "fused"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("gate,l2norm,kind", [("g", False, "torch"), ("in_kernel", True, "torch"),
                                              ("in_kernel", False, "numpy"), ("g", True, "numpy")])
def test_matches_recurrence(op, T, gate, l2norm, kind):
    B, H, K, V = (2, 2, 16, 8) if T < 1000 else (1, 2, 16, 8)
    q, k, v, g, beta, extra = make_inputs(B, T, H, K, V, seed=T, gate=gate, l2norm=l2norm)
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(1))
    o_ref, s_ref = reference(q, k, v, g, beta, extra, initial_state=h0, use_qk_l2norm=l2norm)
    args = as_kind(kind, q, k, v, g, beta, h0)
    extra = {n: as_kind(kind, x)[0] for n, x in extra.items()}
    o, s = OPS[op](*args[:5], initial_state=args[5], output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                   **extra)
    out_type = np.ndarray if kind == "numpy" else torch.Tensor
    assert isinstance(o, out_type) and isinstance(s, out_type)
    assert tuple(o.shape) == (B, T, H, V) and tuple(s.shape) == (B, H, K, V)
    assert o.dtype == args[2].dtype
    assert spec_excess(o, o_ref) <= 0
    assert spec_excess(s, s_ref) <= 0


@pytest.mark.parametrize("op", ["chunk", "fused"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_varlen_with_empty_and_single_token_segments(op, cu_dtype):
    H, K, V = 3, 32, 16
    cu = torch.tensor([0, 0, 1, 1, 66, 130, 131, 131], dtype=cu_dtype)
    T, N = int(cu[-1]), len(cu) - 1
    q, k, v, g, beta, extra = make_inputs(1, T, H, K, V, seed=7)
    h0 = torch.randn(N, H, K, V)
    o_ref, s_ref = reference(q, k, v, g, beta, extra, initial_state=h0, cu_seqlens=cu)
    o, s = OPS[op](q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert spec_excess(o, o_ref) <= 0 and spec_excess(s, s_ref) <= 0
    # 0-token sequences hand their initial state through unchanged.
    assert torch.equal(s[0], h0[0]) and torch.equal(s[2], h0[2]) and torch.equal(s[6], h0[6])
    # No initial state, no final state: starts from zero.
    o0, s0 = OPS[op](q, k, v, g, beta, cu_seqlens=cu)
    assert s0 is None
    o_ref0, s_ref0 = reference(q, k, v, g, beta, extra, cu_seqlens=cu)
    assert spec_excess(o0, o_ref0) <= 0
    _, s1 = OPS[op](q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    assert spec_excess(s1, s_ref0) <= 0 and torch.equal(s1[0], torch.zeros(H, K, V))  # 0 tokens: zero


def test_full_shape_chunk_and_decode():
    """32 heads x 128, as the checkpoint: prefill 65 tokens with the in-kernel gate, then decode."""
    H, K, V = 32, 128, 128
    q, k, v, g, beta, extra = make_inputs(1, 66, H, K, V, seed=3, gate="in_kernel", l2norm=True)
    o_ref, s_ref = reference(q, k, v, g, beta, extra, use_qk_l2norm=True)
    p = slice(0, 65)
    o, s = chunk_kda(q[:, p], k[:, p], v[:, p], g[:, p], beta[:, p], output_final_state=True,
                     use_qk_l2norm_in_kernel=True, **extra)
    assert spec_excess(o, o_ref[:, p]) <= 0
    d = slice(65, 66)
    o1, s1 = fused_recurrent_kda(q[:, d], k[:, d], v[:, d], g[:, d], beta[:, d], initial_state=s,
                                 output_final_state=True, use_qk_l2norm_in_kernel=True, **extra)
    assert spec_excess(o1, o_ref[:, d]) <= 0 and spec_excess(s1, s_ref) <= 0


@pytest.mark.parametrize("op", ["chunk", "fused"])
def test_bf16(op):
    """bf16 q, k, v, g, beta (torch): o comes back bf16. The reference runs in float64 on the
    bf16-rounded inputs, which are exactly what the kernel reads, so the only differences are fp32
    arithmetic (~1e-6 relative) and the final rounding of o to bf16, at most half a bf16 spacing:
    2^-9 = 1.95e-3 relative per element, hence at most 1.95e-3 relative L2. Bound: 2.5e-3. The final
    state is fp32 and must meet the fp32 tolerance."""
    B, T, H, K, V = 2, 130, 4, 64, 32
    q, k, v, g, beta, extra = make_inputs(B, T, H, K, V, seed=11, gate="in_kernel", l2norm=True)
    q, k, v, g, beta = (x.bfloat16() for x in (q, k, v, g, beta))
    h0 = torch.randn(B, H, K, V)
    o_ref, s_ref = reference(q, k, v, g, beta, extra, initial_state=h0, use_qk_l2norm=True)
    q_before = q.clone()
    o, s = OPS[op](q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                   **extra)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_l2(o, o_ref) <= 2.5e-3
    assert spec_excess(s, s_ref) <= 0
    assert torch.equal(q, q_before)
    # bf16 beta with fp32 q, k, v: widened into a copy, the caller's tensor untouched.
    qf, kf, vf = (x.float() for x in (q, k, v))
    beta_before = beta.clone()
    o2, _ = OPS[op](qf, kf, vf, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True, **extra)
    assert o2.dtype == torch.float32 and spec_excess(o2, o_ref) <= 0
    assert torch.equal(beta, beta_before)


@pytest.mark.parametrize("op", ["chunk", "fused"])
def test_strided_token_rows(op):
    """q, k, v as column slices of one [B, T, 3P] buffer (a fused projection), g of a wider one."""
    B, T, H, K = 2, 70, 2, 16
    P = H * K
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, T, 3 * P, generator=gen)
    q, k, v = (qkv[..., i * P:(i + 1) * P].unflatten(-1, (H, K)) for i in range(3))
    k = k / 4
    g = (-torch.rand(B, T, P + 8, generator=gen))[..., :P].unflatten(-1, (H, K))
    beta = torch.rand(B, T, H + 1, generator=gen)[..., :H]  # strided beta: gathered into a copy
    assert not q.is_contiguous() and not g.is_contiguous() and not beta.is_contiguous()
    o, s = OPS[op](q, k, v, g, beta, output_final_state=True)
    o_ref, s_ref = kda_recurrence(q, k, v, g, beta)
    assert spec_excess(o, o_ref) <= 0 and spec_excess(s, s_ref) <= 0
    with pytest.raises(ValueError, match="dense"):  # inside a token, [H, K] must be dense
        OPS[op](q.transpose(2, 3).contiguous().transpose(2, 3), k, v, g, beta)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("T", [1, 3])
def test_inplace_pool_update(kind, T):
    """vLLM's / sglang's decode: slots ssm_state_indices[i] updated in the caller's pool, every other
    slot bit for bit unchanged, -1 rows zero and nothing read or written."""
    N, H, K, V, slots = 4, 2, 16, 8, 8
    idx = torch.tensor([5, -1, 2, 0], dtype=torch.int32)
    cu = torch.arange(0, N * T + 1, T, dtype=torch.int64)
    q, k, v, g, beta, extra = make_inputs(1, N * T, H, K, V, seed=T, gate="in_kernel")
    pool = torch.randn(slots, H, K, V)
    before = pool.clone()
    o_ref, s_ref = reference(q, k, v, g, beta, extra, initial_state=pool, cu_seqlens=cu, state_indices=idx)
    args = as_kind(kind, q, k, v, g, beta, pool, idx)
    extra = {n: as_kind(kind, x)[0] for n, x in extra.items()}
    pool_arg = args[5]
    o, s = fused_recurrent_kda(*args[:5], initial_state=pool_arg, cu_seqlens=cu, ssm_state_indices=args[6],
                               inplace_final_state=True, **extra)
    assert s is pool_arg  # fla returns the pool itself
    assert spec_excess(o, o_ref) <= 0
    o = to_f64(o)
    assert np.all(o[0, T:2 * T] == 0)  # the padded row
    for i, slot in enumerate(idx.tolist()):
        if slot >= 0:
            assert spec_excess(pool[slot], s_ref[i]) <= 0
    for slot in set(range(slots)) - {5, 2, 0}:
        assert torch.equal(pool[slot], before[slot])
    # Batch rows (no cu_seqlens) at T tokens each work the same way.
    pool2 = before.clone()
    fused_recurrent_kda(q.view(N, T, H, K), k.view(N, T, H, K), v.view(N, T, H, V), g.view(N, T, H, K),
                        beta.view(N, T, H), initial_state=pool2, ssm_state_indices=idx,
                        inplace_final_state=True, **{n: torch.as_tensor(x) for n, x in extra.items()})
    assert torch.equal(pool2, pool)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_speculative_2d_indices_and_num_accepted_tokens(dtype):
    """fla's / vLLM's speculative decoding: sequence i starts from slot ssm_state_indices[i,
    num_accepted_tokens[i] - 1] and the state after its token t goes into slot ssm_state_indices[i, t]
    (negative: not kept); a negative start is a padded row. Against the float64 recurrence of each prefix."""
    H, K, V, slots = 2, 16, 8, 16
    lens = [3, 1, 4, 2]
    cu = torch.tensor([0, 3, 4, 8, 10], dtype=torch.int64)
    idx = torch.tensor([[1, 2, 3, -1], [4, -1, -1, -1], [5, 6, 7, 8], [-1, 9, 10, 11]], dtype=dtype)
    nacc = torch.tensor([2, 1, 3, 1])  # starts: slot 2, slot 4, slot 7, padded
    q, k, v, g, beta, extra = make_inputs(1, 10, H, K, V, seed=41, gate="in_kernel")
    pool = torch.randn(slots, H, K, V)
    before = pool.clone()
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx,
                               num_accepted_tokens=nacc, inplace_final_state=True, **extra)
    assert s is pool
    written = set()
    for i, n in enumerate(lens):
        bos = int(cu[i])
        src = int(idx[i, int(nacc[i]) - 1])
        if src < 0:
            assert torch.all(o[0, bos:bos + n] == 0)
            continue
        for t in range(n):
            sl = lambda x: x[:, bos:bos + t + 1]  # noqa: E731
            o_ref, s_ref = reference(sl(q), sl(k), sl(v), sl(g), sl(beta), extra, initial_state=before[src][None])
            assert spec_excess(o[:, bos + t], o_ref[:, t]) <= 0
            dst = int(idx[i, t])
            if dst >= 0:
                assert spec_excess(pool[dst], s_ref[0]) <= 0
                written.add(dst)
    for slot in set(range(slots)) - written:
        assert torch.equal(pool[slot], before[slot])


def test_state_indices_read_only_and_identity_inplace():
    N, H, K, V = 3, 2, 16, 8
    q, k, v, g, beta, extra = make_inputs(N, 2, H, K, V, seed=9)
    pool = torch.randn(6, H, K, V)
    before = pool.clone()
    idx = torch.tensor([4, 1, -1])
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx)
    assert s is None and torch.equal(pool, before)
    assert spec_excess(o, kda_recurrence(q, k, v, g, beta, initial_state=pool, state_indices=idx)[0]) <= 0
    # inplace_final_state without indices: sequence i <-> slot i of an [N, ...] initial_state.
    h0 = torch.randn(N, H, K, V)
    o_ref, s_ref = kda_recurrence(q, k, v, g, beta, initial_state=h0)
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, inplace_final_state=True)
    assert s is h0 and spec_excess(h0, s_ref) <= 0 and spec_excess(o, o_ref) <= 0


class _FakeCuda:
    """A DLPack producer that says its memory is on a CUDA device (kDLCUDA = 2)."""

    shape = (1, 1, 1, 1)

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        raise AssertionError("must not be asked for its data")


def _bad_cases():
    B, T, H, K, V = 1, 6, 2, 8, 4
    q, k, v, g, beta, _ = make_inputs(B, T, H, K, V, seed=2)
    pool = torch.randn(4, H, K, V)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    base = dict(q=q, k=k, v=v, g=g, beta=beta)
    fused, chunk = "fused", "chunk"
    P = dict(initial_state=pool, cu_seqlens=cu, inplace_final_state=True)
    return [
        (chunk, dict(q=q[0]), ValueError, "'q' must have 4 dimensions"),
        (chunk, dict(k=k[:, :5]), ValueError, "'k' has shape"),
        (chunk, dict(q=q.double()), TypeError, "'q' must be float32 or bfloat16, got an unsupported dtype"),
        (chunk, dict(k=k.bfloat16()), TypeError, "q, k and v must share one dtype"),
        (chunk, dict(q=q.to("meta")), ValueError, "on device 'meta'"),
        (chunk, dict(v=_FakeCuda()), ValueError, "not in CPU memory"),
        (chunk, dict(v=torch.randn(B, T, 2 * H, V)), NotImplementedError, "GVA"),
        (chunk, dict(beta=beta[..., None]), ValueError, "'beta' has shape"),
        (chunk, dict(cu_seqlens=torch.tensor([0, 4, 3, 6], dtype=torch.int32)), ValueError,
         "non-monotonic cu_seqlens at index 2: 4 > 3"),
        (chunk, dict(cu_seqlens=torch.tensor([0, 2, 5])), ValueError, "cu_seqlens[N] != T"),
        (chunk, dict(cu_seqlens=torch.tensor([0, 6.0])), TypeError, "'cu_seqlens' must be int32 or int64"),
        (chunk, dict(initial_state=torch.randn(2, H, K, V)), ValueError, "holds 2 states for N=1"),
        (chunk, dict(initial_state=torch.randn(1, H, K, V + 1)), ValueError, "'initial_state' has shape"),
        (chunk, dict(use_gate_in_kernel=True), ValueError, "requires A_log"),
        (chunk, dict(use_gate_in_kernel=True, A_log=torch.zeros(H + 1)), ValueError, "'A_log' has 3 elements"),
        (chunk, dict(A_log=torch.zeros(H)), ValueError, "use_gate_in_kernel=False"),
        (chunk, dict(scale=0.0), ValueError, "scale must be a positive"),
        (chunk, dict(state_v_first=True), NotImplementedError, "state_v_first=True"),
        (chunk, dict(lower_bound=-5.0), NotImplementedError, "lower_bound=-5.0"),
        (chunk, dict(safe_gate=True), NotImplementedError, "safe_gate"),
        (chunk, dict(use_beta_sigmoid_in_kernel=True), NotImplementedError, "use_beta_sigmoid_in_kernel"),
        (chunk, dict(ssm_state_indices=torch.tensor([0])), TypeError, "unexpected keyword argument"),
        (chunk, dict(bogus=1), TypeError, "unexpected keyword argument 'bogus'"),
        (fused, dict(P, ssm_state_indices=torch.tensor([0, 4], dtype=torch.int32)), ValueError,
         "state index out of range: state_indices[1]=4 not in [0, 4)"),
        (fused, dict(P, ssm_state_indices=torch.tensor([3, 3])), ValueError,
         "duplicate state slot 3 used by sequences 0 and 1"),
        (fused, dict(P, ssm_state_indices=torch.tensor([3, -2])), ValueError, "state index out of range"),
        (fused, dict(P, ssm_state_indices=torch.tensor([1, 2, 3])), ValueError, "3 entries for N=2"),
        (fused, dict(P, ssm_state_indices=torch.tensor([[1], [2]])), ValueError,
         "sequence 0 has 2 tokens but ssm_state_indices only 1"),
        (fused, dict(P, ssm_state_indices=torch.tensor([[1, 2, 3, 0], [2, 1, 0, 3]]), inplace_final_state=False),
         ValueError, "need inplace_final_state=True"),
        (fused, dict(P, ssm_state_indices=torch.tensor([[1, 2, 3, 0], [2, 3, 0, 1]]),
                     num_accepted_tokens=torch.tensor([1, 5])), ValueError, "num_accepted_tokens[1]=5 not in [1, 4]"),
        (fused, dict(P, ssm_state_indices=torch.tensor([[1, 2, 3, 0], [2, 1, 0, 3]])), ValueError,
         "duplicate snapshot slot"),
        (fused, dict(P, ssm_state_indices=torch.tensor([[1, 2, 3, 0], [0, 1, 4, 3]])), ValueError,
         "ssm_state_indices[1, 2]=4 >= 4 slots"),
        (fused, dict(P, ssm_state_indices=torch.tensor([0, 1]), inplace_final_state=False, output_final_state=True),
         NotImplementedError, "per-token"),
        (fused, dict(P, ssm_state_indices=torch.tensor([0, 1]), cu_seqlens=torch.tensor([0, 5, 3])), ValueError,
         "non-monotonic"),
        (fused, dict(P, ssm_state_indices=torch.tensor([0, 1]), initial_state=pool.numpy().copy()), None, None),
        (fused, dict(inplace_final_state=True), ValueError, "needs initial_state"),
        (fused, dict(num_accepted_tokens=torch.tensor([1])), ValueError, "num_accepted_tokens needs 2-D"),
        (fused, dict(return_intermediate_states=True), NotImplementedError, "return_intermediate_states"),
        (chunk, dict(return_intermediate_states=True, cu_seqlens=torch.tensor([0, 4, 3, 6], dtype=torch.int32)),
         ValueError, "non-monotonic cu_seqlens"),
    ], base


def test_bad_inputs_raise_and_change_nothing():
    cases, base = _bad_cases()
    for op, over, exc, msg in cases:
        kwargs = dict(base, **over)
        tensors = {n: x for n, x in kwargs.items() if isinstance(x, (torch.Tensor, np.ndarray)) and
                   (not isinstance(x, torch.Tensor) or x.device.type == "cpu")}
        before = {n: x.copy() if isinstance(x, np.ndarray) else x.clone() for n, x in tensors.items()}
        if exc is None:  # a read-only NumPy pool: refused for in-place use
            pool = kwargs["initial_state"]
            pool.setflags(write=False)
            exc, msg = ValueError, "'initial_state' is read-only"
        with pytest.raises(exc) as err:
            OPS[op](**kwargs)
        assert msg in str(err.value), (op, over.keys(), str(err.value))
        for n, x in tensors.items():
            same = np.array_equal(x, before[n]) if isinstance(x, np.ndarray) else torch.equal(x, before[n])
            assert same, f"{n} changed by a refused call ({msg})"


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("init", [True, False])
def test_intermediate_states(kind, varlen, init):
    """return_intermediate_states=True: h, the state entering each 64-token chunk (fla's definition, fp32
    here), against the float64 recurrence, with and without cu_seqlens; o and the final state are those
    of a call without it, bit for bit (the chunks end at multiples of 64 either way)."""
    H, K, V = 2, 32, 16
    if varlen:
        cu = torch.tensor([0, 1, 1, 65, 194, 330], dtype=torch.int32)  # 1, 0, 64, 129, 136 tokens
        B, T, N = 1, int(cu[-1]), len(cu) - 1
        nt = sum((int(cu[i + 1] - cu[i]) + 63) // 64 for i in range(N))
    else:
        cu, B, T = None, 2, 200
        N, nt = B, (T + 63) // 64
    q, k, v, g, beta, extra = make_inputs(B, T, H, K, V, seed=11 + varlen, gate="in_kernel" if varlen else "g",
                                          l2norm=varlen)
    h0 = torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(5)) if init else None
    o_ref, s_ref, h_ref = reference(q, k, v, g, beta, extra, initial_state=h0, cu_seqlens=cu, use_qk_l2norm=varlen,
                                    chunk_states=True)
    args = as_kind(kind, q, k, v, g, beta)
    kw = dict(initial_state=as_kind(kind, h0)[0], output_final_state=True, use_qk_l2norm_in_kernel=varlen,
              cu_seqlens=cu, **{n: as_kind(kind, x)[0] for n, x in extra.items()})
    o, s, h = chunk_kda(*args, return_intermediate_states=True, **kw)
    assert isinstance(h, np.ndarray if kind == "numpy" else torch.Tensor)
    assert tuple(h.shape) == ((1, nt, H, K, V) if varlen else (B, nt, H, K, V)) == h_ref.shape
    assert str(h.dtype).endswith("float32")
    assert spec_excess(h, h_ref) <= 0
    assert spec_excess(o, o_ref) <= 0 and spec_excess(s, s_ref) <= 0
    first = h[0, 0] if varlen else h[:, 0]
    want = (h0[0] if varlen else h0) if init else torch.zeros_like(torch.as_tensor(np.asarray(first)))
    assert np.array_equal(np.asarray(first), np.asarray(want))  # the initial state (or zero), exactly
    o2, s2 = chunk_kda(*args, **kw)
    assert np.array_equal(np.asarray(o), np.asarray(o2)) and np.array_equal(np.asarray(s), np.asarray(s2))
    # Without a final state, and with bf16 inputs: h is still fp32.
    _, s3, h3 = chunk_kda(*(x.to(torch.bfloat16) for x in (q, k, v, g, beta)), return_intermediate_states=True,
                          cu_seqlens=cu, use_qk_l2norm_in_kernel=varlen, **extra)
    assert s3 is None and h3.dtype == torch.float32 and tuple(h3.shape) == tuple(h.shape)


def test_fla_defaults_accepted():
    q, k, v, g, beta, _ = make_inputs(1, 4, 2, 8, 4)
    ref, _ = chunk_kda(q, k, v, g, beta)
    o, _ = chunk_kda(q, k, v, g, beta, state_v_first=False, safe_gate=False, lower_bound=None,
                     return_intermediate_states=False, use_beta_sigmoid_in_kernel=False, cu_seqlens_cpu=None,
                     disable_recompute=False, transpose_state_layout=False)
    assert torch.equal(o, ref)
    o, _ = fused_recurrent_kda(q, k, v, g, beta, state_v_first=False, num_accepted_tokens=None, out=None)
    assert spec_excess(o, ref) <= 0


def test_autograd_tensors_and_parameters():
    """Tensors that require grad and nn.Parameter (a subclass: the general DLPack path) are read as they
    are; the outputs carry no graph."""
    q, k, v, g, beta, extra = make_inputs(1, 5, 2, 8, 4, gate="in_kernel")
    ref, _ = chunk_kda(q, k, v, g, beta, **extra)
    q.requires_grad_(True)
    extra = {n: torch.nn.Parameter(x) for n, x in extra.items() if n != "use_gate_in_kernel"}
    o, _ = chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, **extra)
    assert torch.equal(o, ref) and not o.requires_grad


def test_big_outputs_from_the_block_cache():
    """Outputs of 8 MiB and more come from blocks that freed outputs gave back: live outputs never
    share memory, a reused block holds exactly the new result, and the tensors behave as torch's own."""
    q, k, v, g, beta, _ = make_inputs(1, 4096, 4, 16, 128, spikes=False)
    o1, _ = fused_recurrent_kda(q, k, v, g, beta)
    o2, _ = fused_recurrent_kda(q, k, v, g, beta)
    assert o1.data_ptr() != o2.data_ptr() and torch.equal(o1, o2)
    ref, ptr = o1.clone(), o1.data_ptr()
    o1.fill_(float("nan"))
    del o1
    o3, _ = fused_recurrent_kda(q, k, v, g, beta)
    assert o3.data_ptr() == ptr and torch.equal(o3, ref)
    o3 += 1
    assert o3.is_contiguous() and o3.dtype == torch.float32 and o3.numpy().shape == (1, 4096, 4, 128)


def test_gil_released_during_kernel():
    """A second Python thread runs while one long kernel call is in flight. The counter thread sleeps
    between increments (so it never holds the GIL for long); a call that kept the GIL would let it
    advance at most at the call's two edges."""
    q, k, v, g, beta, _ = make_inputs(1, 4096, 4, 128, 128, spikes=False)
    prev = kda.get_num_threads()
    kda.set_num_threads(1)  # leave the other core to the counter
    count, stop = [0], threading.Event()

    def counter():
        while not stop.is_set():
            count[0] += 1
            time.sleep(0.0005)

    th = threading.Thread(target=counter)
    th.start()
    try:
        time.sleep(0.01)
        c0 = count[0]
        chunk_kda(q, k, v, g, beta)
        c1 = count[0]
    finally:
        stop.set()
        th.join()
        kda.set_num_threads(prev)
    assert c1 - c0 >= 10, f"the other thread advanced {c1 - c0} times during the call"


def test_import_needs_neither_numpy_nor_torch():
    """`import kda` (and kda.ops) must work where neither is installed: both are blocked here."""
    code = ("import sys; sys.modules['numpy'] = None; sys.modules['torch'] = None; "
            "import kda, kda.ops; assert kda.ops.chunk_kda and kda.get_num_threads() >= 1")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
