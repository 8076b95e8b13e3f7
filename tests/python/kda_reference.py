"""Float64 references and tolerance checks shared by the Python tests (NumPy only).

kda_recurrence is the plain per-token recurrence of /work/shared/spec/kda-numerics.md (step 6), in
float64, with fla's conventions: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], states
[N, H, K, V]; cu_seqlens splits the single batch row into N sequences.
"""

import numpy as np


def to_f64(x):
    """A torch tensor (any dtype) or array-like as a float64 NumPy array."""
    if hasattr(x, "detach"):
        x = x.detach().float().numpy()
    return np.asarray(x, dtype=np.float64)


def softplus(z):
    # fla's / the spec's softplus: z for z > 20, else log1p(exp(z)).
    return np.where(z > 20, z, np.log1p(np.exp(np.minimum(z, 20))))


def kda_gate(f, A_log, dt_bias=None):
    """g = -exp(A_log[h]) * softplus(f + dt_bias[h*K + d]) for f [..., H, K]."""
    f = to_f64(f)
    H, K = f.shape[-2:]
    z = f + (0 if dt_bias is None else to_f64(dt_bias).reshape(H, K))
    return -np.exp(to_f64(A_log).reshape(H, 1)) * softplus(z)


def kda_recurrence(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False,
                   A_log=None, dt_bias=None, state_indices=None, chunk_states=False):
    """Returns (o [B, T, H, V], final states [N, H, K, V]) in float64.

    g is the log-space gate, or the raw gate f when A_log is given (use_gate_in_kernel). With
    state_indices, initial_state is a pool and sequence i starts from slot state_indices[i] (-1: a
    padded row, zero output, final state left zero). With chunk_states, also fla's h: the state entering
    each 64-token chunk of each sequence, [B, ceil(T / 64), H, K, V], or with cu_seqlens
    [1, the sequences' chunks in all, H, K, V]."""
    q, k, v, g, beta = (to_f64(x) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    V = v.shape[-1]
    if A_log is not None:
        g = kda_gate(g, A_log, dt_bias)
    if use_qk_l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q = q * (K ** -0.5 if scale is None else scale)
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(x) for x in np.asarray(to_f64(cu_seqlens))]
        bounds = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    o = np.zeros((B, T, H, V))
    final = np.zeros((len(bounds), H, K, V))
    h0 = None if initial_state is None else to_f64(initial_state)
    h = []  # per sequence, the states entering its chunks
    for i, (b, t0, t1) in enumerate(bounds):
        slot = i if state_indices is None else int(state_indices[i])
        h.append([])
        if slot < 0:
            continue
        S = np.zeros((H, K, V)) if h0 is None else h0[slot].copy()
        for t in range(t0, t1):
            if (t - t0) % 64 == 0:
                h[-1].append(S.copy())
            S *= np.exp(g[b, t])[:, :, None]
            u = v[b, t] - np.einsum("hkv,hk->hv", S, k[b, t])
            S += beta[b, t][:, None, None] * k[b, t][:, :, None] * u[:, None, :]
            o[b, t] = np.einsum("hkv,hk->hv", S, q[b, t])
        final[i] = S
    if not chunk_states:
        return o, final
    if cu_seqlens is None:
        hs = np.array(h).reshape(B, (T + 63) // 64, H, K, V)
    else:
        hs = np.array([x for seq in h for x in seq]).reshape(1, -1, H, K, V)
    return o, final, hs


def spec_excess(a, ref, atol=1e-5, rtol=1e-5):
    """max(|a - ref| - (atol + rtol |ref|)): <= 0 means within the spec's fp32 tolerance."""
    a, ref = to_f64(a), to_f64(ref)
    if a.size == 0:
        return -1.0
    return float(np.max(np.abs(a - ref) - (atol + rtol * np.abs(ref))))


def rel_l2(a, ref):
    a, ref = to_f64(a), to_f64(ref)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-300))


def bf16_round(x):
    """float32 -> the nearest bfloat16 value (ties to even), as float32 (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


# The weight-only schemes of kernels/gemm/quant_gemm.h: symmetric, round to nearest (ties to even) with
# the scale max|w| / qmax computed in float64 and stored as float32; int8 per output channel, int4 per
# group of 32 inputs. The kernels' W is q * scale in float32.
QUANT_RUN = {"int8": None, "int4": 32}  # None: the whole row
QUANT_QMAX = {"int8": 127, "int4": 7}


def quantized_weights(w, weights):
    """W [out, in] as the quantized projection sees it: float32 q * scale."""
    out, n = w.shape
    run = QUANT_RUN[weights] or n
    qmax = QUANT_QMAX[weights]
    g = np.asarray(w, np.float64).reshape(out, n // run, run)
    s = np.abs(g).max(-1, keepdims=True) / qmax
    q = np.clip(np.rint(g / np.where(s > 0, s, 1.0)), -qmax, qmax) * (s > 0)
    return (q.astype(np.float32) * s.astype(np.float32)).reshape(out, n)


def int8_activation_qmax(n):
    """The int16 activation range of int8 weights: 32767, less where an int32 lane could overflow."""
    return int(min(32767, (2147483647 // 127) // max(2 * ((n + 31) // 32), 1)))


def quantized_activations(x, weights):
    """x [M, in] as the decode kernels quantize it to int16 (float32 arithmetic, one scale per row for
    int8 weights, per group of 32 for int4), dequantized in float64."""
    m, n = x.shape
    run = QUANT_RUN[weights] or n
    qmax = np.float32(int8_activation_qmax(n) if weights == "int8" else 32767)
    g = np.asarray(x, np.float32).reshape(m, n // run, run)
    s = (np.abs(g).max(-1, keepdims=True) / qmax).astype(np.float32)
    q = np.clip(np.rint(g / np.where(s > 0, s, np.float32(1))), -qmax, qmax) * (s > 0)
    return (q.astype(np.float64) * s.astype(np.float64)).reshape(m, n)
