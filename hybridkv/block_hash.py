"""Chained block hashes: the identity of a prefix, shared by every kind of layer memory.

`h_i = sha256(h_{i-1} | extra key | tokens of block i)`; the extra key folds in the model
fingerprint, adapter id, multimodal hashes and the tenant's cache_salt, so tenants never share
(nor detect) each other's prefixes. A state checkpoint at `p = m x block_size` is keyed by `h_{m-1}`.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence


def extra_key(fingerprint: str, adapter_id=None, mm_hashes: Sequence[str] = (), cache_salt=None) -> bytes:
    """Digest of everything besides token ids that changes KV values, mixed into every block hash."""
    return hashlib.sha256(repr((fingerprint, adapter_id, tuple(mm_hashes), cache_salt)).encode()).digest()


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], num_blocks: int, extra: bytes,
                  block_size: int) -> None:
    """Append chained hashes to `hashes` until it covers `num_blocks` full blocks of `token_ids`."""
    prev = hashes[-1] if hashes else b""
    for i in range(len(hashes), num_blocks):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        prev = hashlib.sha256(prev + extra + block).digest()
        hashes.append(prev)
