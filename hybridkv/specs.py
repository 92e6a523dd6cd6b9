"""What one layer keeps between steps: the unit the memory manager sizes its pools from."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import torch

from hybridkv.cache_dtype import QuantLayout, conv_layout, kv_layout, state_layout


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
    cache_dtype: Optional[str] = None  # "int8" / "fp8_e4m3": pages hold codes and scales (cache_dtype.py)

    @property
    def kv_parts(self) -> int:
        """Vectors per token and head in a page: 2 (key and value) or 1 (the latent)."""
        return 1 if self.latent else 2

    @property
    def layout(self) -> Optional[QuantLayout]:
        """How a quantized page keeps one head's vector of a token; None: `dtype` values."""
        return kv_layout(self.cache_dtype, self.head_dim)

    def stored_vector(self) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of one head's vector of one token in a page: ((head_dim,), dtype), or
        ((layout.nbytes,), uint8) under a quantized cache dtype."""
        return ((self.head_dim,), self.dtype) if self.layout is None else ((self.layout.nbytes,), torch.uint8)

    def bytes_per_token(self) -> int:
        if self.cache_dtype is not None:
            return self.kv_parts * self.num_kv_heads * self.layout.nbytes
        return self.kv_parts * _nbytes((self.num_kv_heads, self.head_dim), self.dtype)


@dataclass(frozen=True)
class RecurrentSpec:
    """A recurrent layer's whole-object state, one per request.

    conv_shape: per-slot conv window, `[conv_dim, kernel_size - 1]` (the last k-1 inputs), or ()
    state_shape: per-slot SSM/GDN state (Mamba1 `[d_inner, d_state]`, Mamba2 `[heads, head_dim,
    d_state]`, GDN `[v_heads, k_dim, v_dim]`), or () for short-conv layers that keep only a window.
    state_dtype: dtype of the SSM/GDN state when it differs from `dtype` (the conv dtype).
    cache_dtype: "int8" / "fp8_e4m3": the slots hold codes and scales of both (cache_dtype.py);
    the layers still compute in `dtype` / `ssm_dtype`.
    """

    conv_shape: tuple[int, ...]
    state_shape: tuple[int, ...]
    dtype: torch.dtype
    state_dtype: Optional[torch.dtype] = None
    cache_dtype: Optional[str] = None

    @property
    def ssm_dtype(self) -> torch.dtype:
        return self.state_dtype or self.dtype

    @property
    def conv_layout(self) -> Optional[QuantLayout]:
        return conv_layout(self.cache_dtype, self.conv_shape)

    @property
    def ssm_layout(self) -> Optional[QuantLayout]:
        return state_layout(self.cache_dtype, self.state_shape)

    def stored_conv(self) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of one slot's conv window as the pool keeps it."""
        return (tuple(self.conv_shape), self.dtype) if self.conv_layout is None else \
            ((self.conv_layout.nbytes,), torch.uint8)

    def stored_ssm(self) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of one slot's state as the pool keeps it."""
        return (tuple(self.state_shape), self.ssm_dtype) if self.ssm_layout is None else \
            ((self.ssm_layout.nbytes,), torch.uint8)

    def conv_bytes(self) -> int:
        if not self.conv_shape:
            return 0
        return self.conv_layout.nbytes if self.cache_dtype else _nbytes(self.conv_shape, self.dtype)

    def state_bytes(self) -> int:
        if not self.state_shape:
            return 0
        return self.ssm_layout.nbytes if self.cache_dtype else _nbytes(self.state_shape, self.ssm_dtype)

    def bytes_per_slot(self) -> int:
        return self.conv_bytes() + self.state_bytes()


LayerSpec = Union[AttentionSpec, RecurrentSpec]


def with_cache_dtypes(specs: dict, kv: Optional[str], state: Optional[str]) -> dict:
    """`specs` with attention layers kept in `kv` and recurrent layers in `state` (None or "auto": as
    they are)."""
    kv, state = (None if d == "auto" else d for d in (kv, state))
    out = {}
    for i, s in specs.items():
        if isinstance(s, AttentionSpec) and kv is not None:
            s = dataclasses.replace(s, cache_dtype=kv)
        elif isinstance(s, RecurrentSpec) and state is not None:
            s = dataclasses.replace(s, cache_dtype=state)
        out[i] = s
    return out
