"""A request frozen for migration: everything another engine needs to continue it bit-exactly."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

import torch


@dataclass
class RequestSnapshot:
    """One running request, exported by `HybridCacheManager.export_snapshot`.

    token_ids: prompt + generated tokens; num_computed_tokens: tokens whose KV/state are included.
    kv[layer]: `[parts, num_computed_tokens - kv_start[layer], kv_heads, head_dim]` per attention layer
        (token-major, so it imports into a manager with any block size); a sliding-window layer
        exports only the blocks it still holds, from token kv_start[layer] (absent: 0).
    conv[layer] / ssm[layer]: the live slot's tensors per recurrent layer (`conv_shape`, `state_shape`).
    fingerprint: model fingerprint; import refuses a mismatch. block_size: of the exporting manager.
    sampling_state: opaque, filled by the engine (sampling params, generator state).
    """

    req_id: Hashable
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    max_tokens: int
    kv: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]
    fingerprint: str
    block_size: int
    cache_salt: Optional[str] = None
    adapter_id: Any = None
    mm_hashes: tuple = ()
    sampling_state: Any = None
    layer_shapes: dict[int, tuple] = field(default_factory=dict)  # what the exporter's layers hold
    kv_start: dict[int, int] = field(default_factory=dict)  # layer -> first token in kv (sliding window; else 0)
