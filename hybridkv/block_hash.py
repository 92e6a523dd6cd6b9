"""Chained block hashes: the identity of a prefix, shared by every kind of layer memory.

`h_i = sha256(h_{i-1} | extra key | tokens of block i)`; the extra key folds in the model
fingerprint, adapter id, multimodal hashes and the tenant's cache_salt, so tenants never share
(nor detect) each other's prefixes. A state checkpoint at `p = m x block_size` is keyed by `h_{m-1}`.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from typing import Sequence


def extra_key(fingerprint: str, adapter_id=None, mm_hashes: Sequence[str] = (), cache_salt=None) -> bytes:
    """Digest of everything besides token ids that changes KV values, mixed into every block hash."""
    return hashlib.sha256(repr((fingerprint, adapter_id, tuple(mm_hashes), cache_salt)).encode()).digest()


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], num_blocks: int, extra: bytes,
                  block_size: int) -> None:
    """Append chained hashes to `hashes` until it covers `num_blocks` full blocks of `token_ids`."""
    prev = hashes[-1] if hashes else b""
    pack, sha256 = _block_bytes(block_size).pack, hashlib.sha256
    for i in range(len(hashes), num_blocks):
        prev = sha256(prev + extra + pack(*token_ids[i * block_size:(i + 1) * block_size])).digest()
        hashes.append(prev)


@functools.lru_cache(maxsize=None)
def _block_bytes(block_size: int) -> struct.Struct:
    """A block's token ids as native int64s (array("q")'s bytes, without its per-call setup)."""
    return struct.Struct(f"{block_size}q")
