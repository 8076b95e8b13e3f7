"""kda: Kimi Delta Attention on the CPU.

``kda.ops`` holds fla's ``chunk_kda`` / ``fused_recurrent_kda`` (same signatures); the package root holds
the serving component under the RFC's names, the prefix cache of state snapshots (``RadixCache``, fed by
``ForwardBatch.state_snapshots``) and the weight-only quantized projection (``QuantLinear``).
"""

from . import ops
from ._kda import get_num_threads, set_num_threads
from .component import (
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
    "get_num_threads",
    "ops",
    "set_num_threads",
]
