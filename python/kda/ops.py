"""fla's KDA entry points on the CPU: ``from kda.ops import chunk_kda, fused_recurrent_kda``.

Same signatures and conventions as ``fla.ops.kda`` (v0.6): q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``,
beta ``[B, T, H]``, states ``[N, H, K, V]`` fp32, ``cu_seqlens`` ``[N+1]`` with B = 1. Inputs are CPU
``torch.Tensor`` (float32 or bfloat16) or ``numpy.ndarray`` (float32), read in place (no copies); the
outputs are of v's kind (torch or NumPy) and o has v's dtype.

fla's keyword arguments that these kernels do not implement raise ``NotImplementedError`` naming them,
unless given at the value that switches them off; unknown keywords raise ``TypeError``. Nothing is
silently ignored. Bad inputs raise ``ValueError`` / ``TypeError`` before anything is written.

This module imports neither torch nor NumPy: the extension takes whatever the caller passes.
"""

from . import _kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]

# fla keywords the kernels do not implement, with the value that means "feature off": accepted at that
# value (so fla call sites that spell out the defaults work unchanged), refused otherwise.
_OFF = {
    "state_v_first": False,  # state layout [V, K]
    "transpose_state_layout": False,  # fla's deprecated name of state_v_first
    "use_beta_sigmoid_in_kernel": False,
    "allow_neg_eigval": False,
    "safe_gate": False,
    "lower_bound": None,
    "return_intermediate_states": False,  # fused_recurrent_kda only; chunk_kda returns h
    "disable_recompute": False,  # training (backward) recompute control
    "cu_seqlens_cpu": None,
    "cp_context": None,  # context parallelism
    "chunk_indices": None,
    "num_accepted_tokens": None,  # speculative decoding
    "out": None,  # caller-provided output buffer
}


def _check_kwargs(fn, kwargs):
    for name, value in kwargs.items():
        if name not in _OFF:
            raise TypeError(f"kda.ops.{fn}() got an unexpected keyword argument '{name}'")
        off = _OFF[name]
        # `value is off`, or a plain falsy bool/int for the boolean flags (fla tests them by truth).
        if value is off or (off is False and (value is None or (type(value) in (bool, int) and not value))):
            continue
        raise NotImplementedError(
            f"kda.ops.{fn}: {name}={value!r} is not supported by kda's CPU kernels (only {name}={off!r})"
        )


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    cu_seqlens=None,
    **kwargs,
):
    """Chunked KDA (prefill). Returns ``(o, final_state)``; final_state is None unless
    ``output_final_state``. ``initial_state`` ``[N, H, K, V]`` is only read.

    With ``return_intermediate_states=True``: ``(o, final_state, h)``, h the state entering each 64-token
    chunk of each sequence (the initial state, or zero, for the first), ``[B, NT, H, K, V]`` with
    ``NT = ceil(T / 64)``, or with cu_seqlens ``[1, NT, H, K, V]`` with NT the chunks of all sequences;
    float32 (fla's is bfloat16), written in the pass that computes o."""
    intermediate = bool(kwargs.pop("return_intermediate_states", False))
    if kwargs:
        _check_kwargs("chunk_kda", kwargs)
    return _kda._kda_op(
        True,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        bool(output_final_state),
        bool(use_qk_l2norm_in_kernel),
        bool(use_gate_in_kernel),
        A_log,
        dt_bias,
        cu_seqlens,
        None,
        False,
        bool(intermediate),
    )


def fused_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    cu_seqlens=None,
    ssm_state_indices=None,
    inplace_final_state=False,
    num_accepted_tokens=None,
    **kwargs,
):
    """Token-by-token KDA (decode; any T). Returns ``(o, final_state)``.

    Speculative decoding (fla's / vLLM's convention): ``ssm_state_indices`` 2-D ``[N, S]`` with
    ``inplace_final_state=True`` and ``num_accepted_tokens`` ``[N]`` (None: all 1). Sequence i starts
    from slot ``ssm_state_indices[i, num_accepted_tokens[i] - 1]`` (negative: a padded row) and the state
    after its token t is written into slot ``ssm_state_indices[i, t]`` (negative: not kept); the pool is
    returned as final_state.

    With ``inplace_final_state=True`` (vLLM's / sglang's decode convention) ``initial_state`` is a
    pool ``[num_slots, H, K, V]``: sequence i reads and writes slot ``ssm_state_indices[i]`` (or slot i
    without indices) in place and the pool itself is returned as final_state; index -1 marks a padded
    row (zero output, no slot read or written). Without it, ``ssm_state_indices`` picks the slots read
    and nothing is written (fla's per-token final states are not supported).
    """
    if kwargs:
        _check_kwargs("fused_recurrent_kda", kwargs)
    return _kda._kda_op(
        False,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        bool(output_final_state),
        bool(use_qk_l2norm_in_kernel),
        bool(use_gate_in_kernel),
        A_log,
        dt_bias,
        cu_seqlens,
        ssm_state_indices,
        bool(inplace_final_state),
        False,
        num_accepted_tokens,
    )
