"""The serving component under the RFC's names (sgl-jax style), implemented in the ``_kda`` extension.

NumPy and torch are imported only when a method needs them: ``import kda`` works without either.
"""

from ._kda import (
    Checkpoint,
    ForwardBatch,
    ForwardMode,
    HybridReqToTokenPool,
    KDAAttnBackend,
    KDAAttnBackendMetadata,
    KimiDeltaAttention,
    KimiLinearConfig,
    KimiLinearForCausalLM,
    LinearRecurrentAttnBackendMetadata,
    MatchResult,
    MemoryPools,
    QuantLinear,
    RadixCache,
    RecurrentStatePool,
    RecurrentStatePoolConfig,
    Snapshot,
    SnapshotState,
    StateSnapshot,
)


def _recurrent_state_tensor(self, layer_id):
    """Layer ``layer_id``'s recurrent buffer [N+1, H, K, V] as a torch.float32 tensor sharing the pool's memory."""
    import torch

    return torch.from_numpy(self.recurrent_state(layer_id))


def _conv_state_tensor(self, layer_id):
    """Layer ``layer_id``'s conv buffer [N+1, W-1, C] as a torch tensor sharing the pool's memory
    (torch.float32, or torch.bfloat16 when the pool's conv dtype is bf16)."""
    import torch

    a = self.conv_state(layer_id)
    if a.dtype.kind == "u":  # bf16 bits (NumPy has no bfloat16; torch takes int16, not uint16)
        return torch.from_numpy(a.view("int16")).view(torch.bfloat16)
    return torch.from_numpy(a)


RecurrentStatePool.recurrent_state_tensor = _recurrent_state_tensor
RecurrentStatePool.conv_state_tensor = _conv_state_tensor

__all__ = [
    "Checkpoint",
    "ForwardBatch",
    "ForwardMode",
    "HybridReqToTokenPool",
    "KDAAttnBackend",
    "KDAAttnBackendMetadata",
    "KimiDeltaAttention",
    "KimiLinearConfig",
    "KimiLinearForCausalLM",
    "LinearRecurrentAttnBackendMetadata",
    "MatchResult",
    "MemoryPools",
    "QuantLinear",
    "RadixCache",
    "RecurrentStatePool",
    "RecurrentStatePoolConfig",
    "Snapshot",
    "SnapshotState",
    "StateSnapshot",
]
