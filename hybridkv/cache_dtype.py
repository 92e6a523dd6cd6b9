"""Quantized cache dtypes: how a KV page or a state slot is kept in one byte per value plus scales.

`kv_cache_dtype` / `state_cache_dtype` (LLM, `hybridkv serve --kv-cache-dtype / --state-cache-dtype`):
"auto" keeps the model's dtype; "int8" and "fp8_e4m3" keep one byte per value with a float32
scale per row: value = code x scale, scale = the row's absolute maximum / the code's maximum (127
for int8, 448 for float8 e4m3), so a row's largest value is kept exactly and the others to the
code's precision. Which values share a scale (a row):
- a KV page: each token's key (or value, or latent) vector of one head, `head_dim` values; written
  once with its token, so a scale never changes under values already written (measured against a
  scale per block and head in BENCHMARKS.md, "Quantized caches");
- a recurrent state `[..., n]`: each row of the last dimension (Mamba2 / GDN: head x head_dim rows of
  d_state / v_dim; Mamba1: channel rows of d_state);
- a conv window (`[channels, k - 1]` and such): the values of one time step across the channels
  (the largest dimension), as KV is per token.

A row is stored as its codes followed by its scale, in one uint8 tensor per layer (`QuantLayout`):
every byte-level move of the pools (slot and block copies, swap, snapshots, the host tier and its
checksums) carries codes and scales together, unchanged. int8 writes may round stochastically
(`stochastic=True`: round up with probability equal to the fraction, from a seeded generator);
fp8 rounds to nearest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import torch

CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
_CODE = {"int8": (torch.int8, 127.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}


def check_cache_dtype(name: str, value) -> Optional[str]:
    """`value` of option `name` -> None for "auto" (the model's dtype), else the quantized dtype's name.
    ValueError naming the accepted values otherwise."""
    if value not in CACHE_DTYPES:
        raise ValueError(f"{name}={value!r} is not a cache dtype; choose one of {list(CACHE_DTYPES)}")
    return None if value == "auto" else value


@dataclass(frozen=True)
class QuantLayout:
    """Items of logical shape `shape` kept as `nbytes` bytes each: the codes (one byte per value,
    padded to 4 bytes), then a float32 scale per row; a row spans dimension `row_dim` of `shape`.
    A tensor of items is `[*lead, nbytes]` uint8 (`empty`); `decode` / `encode` map it to and from
    `[*lead, *shape]` values. Its sizes are computed once (cached_property: a frozen dataclass's
    instance dict, not a field: equality and hashing see the three fields only)."""

    dtype: str
    shape: tuple[int, ...]
    row_dim: int

    def __post_init__(self):
        if self.dtype not in _CODE:
            raise ValueError(f"quantized cache dtype {self.dtype!r}; choose one of {list(_CODE)}")
        if not self.shape or not 0 <= self.row_dim < len(self.shape):
            raise ValueError(f"a quantized item needs a shape and a row dimension in it, got {self.shape}, {self.row_dim}")

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def scale_shape(self) -> tuple[int, ...]:
        return tuple(1 if d == self.row_dim else n for d, n in enumerate(self.shape))

    @cached_property
    def code_bytes(self) -> int:
        return -(-self.numel // 4) * 4

    @cached_property
    def nbytes(self) -> int:
        return self.code_bytes + 4 * math.prod(self.scale_shape)

    def empty(self, lead: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
        """Zeros: every item decodes to zeros."""
        return torch.zeros(*lead, self.nbytes, dtype=torch.uint8, device=device)

    def decode(self, raw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """raw [*lead, nbytes] uint8 -> values [*lead, *shape] of `dtype` (a new tensor)."""
        lead = raw.shape[:-1]
        codes = raw[..., :self.numel].view(_CODE[self.dtype][0]).reshape(*lead, *self.shape)
        scale = raw[..., self.code_bytes:].contiguous().view(torch.float32).reshape(*lead, *self.scale_shape)
        return (codes.to(torch.float32) * scale).to(dtype)

    def encode(self, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """values [*lead, *shape] -> raw [*lead, nbytes] uint8. `generator`: round int8 codes
        stochastically from it (None: to nearest). A row with a NaN or inf decodes to NaN."""
        code_dtype, top = _CODE[self.dtype]
        lead = x.shape[:x.dim() - len(self.shape)]
        x = x.to(torch.float32)
        axis = len(lead) + self.row_dim
        scale = x.abs().amax(dim=axis, keepdim=True) / top
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))  # an all-zero row: codes 0
        scaled = x * inv
        if self.dtype == "int8":
            if generator is not None:
                noise = torch.rand(scaled.shape, generator=generator, device=scaled.device)
                scaled = torch.floor(scaled + noise)
            codes = scaled.round().clamp_(-top, top).to(code_dtype)
        else:
            codes = scaled.clamp(-top, top).to(code_dtype)
        scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))
        raw = torch.zeros(*lead, self.nbytes, dtype=torch.uint8, device=x.device)
        raw[..., :self.numel] = codes.reshape(*lead, self.numel).view(torch.uint8)
        raw[..., self.code_bytes:] = scale.reshape(*lead, -1).contiguous().view(torch.uint8)
        return raw


def kv_layout(dtype: Optional[str], head_dim: int) -> Optional[QuantLayout]:
    """A KV page's item: one token's vector of one head (None when not quantized)."""
    return None if dtype is None else QuantLayout(dtype, (head_dim,), 0)


def conv_layout(dtype: Optional[str], conv_shape: tuple[int, ...]) -> Optional[QuantLayout]:
    """A conv window: rows across its largest dimension (the channels)."""
    if dtype is None or not conv_shape:
        return None
    return QuantLayout(dtype, tuple(conv_shape), max(range(len(conv_shape)), key=lambda d: (conv_shape[d], d)))


def state_layout(dtype: Optional[str], state_shape: tuple[int, ...]) -> Optional[QuantLayout]:
    """A recurrent state: rows along its last dimension."""
    if dtype is None or not state_shape:
        return None
    return QuantLayout(dtype, tuple(state_shape), len(state_shape) - 1)
