"""What one layer keeps between steps: the unit the memory manager sizes its pools from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class AttentionSpec:
    """An attention layer's KV: per token `kv_parts x num_kv_heads x head_dim` elements of `dtype`.

    latent: the layer keeps ONE vector per token that it expands into every head's key and value
    (multi-head latent attention: `head_dim` = kv_lora_rank + rope dims, `num_kv_heads` 1), so a
    page holds `[1, block_size, 1, head_dim]`; otherwise a key and a value per head, `[2, ...]`.
    """

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: Optional[int] = None
    latent: bool = False

    @property
    def kv_parts(self) -> int:
        """Vectors per token and head in a page: 2 (key and value) or 1 (the latent)."""
        return 1 if self.latent else 2

    def bytes_per_token(self) -> int:
        return self.kv_parts * _nbytes((self.num_kv_heads, self.head_dim), self.dtype)


@dataclass(frozen=True)
class RecurrentSpec:
    """A recurrent layer's whole-object state, one per request.

    conv_shape: per-slot conv window, `[conv_dim, kernel_size - 1]` (the last k-1 inputs), or ()
    state_shape: per-slot SSM/GDN state (Mamba1 `[d_inner, d_state]`, Mamba2 `[heads, head_dim,
    d_state]`, GDN `[v_heads, k_dim, v_dim]`), or () for short-conv layers that keep only a window.
    state_dtype: dtype of the SSM/GDN state when it differs from `dtype` (the conv dtype).
    """

    conv_shape: tuple[int, ...]
    state_shape: tuple[int, ...]
    dtype: torch.dtype
    state_dtype: Optional[torch.dtype] = None

    @property
    def ssm_dtype(self) -> torch.dtype:
        return self.state_dtype or self.dtype

    def conv_bytes(self) -> int:
        return _nbytes(self.conv_shape, self.dtype) if self.conv_shape else 0

    def state_bytes(self) -> int:
        return _nbytes(self.state_shape, self.ssm_dtype) if self.state_shape else 0

    def bytes_per_slot(self) -> int:
        return self.conv_bytes() + self.state_bytes()


LayerSpec = Union[AttentionSpec, RecurrentSpec]
