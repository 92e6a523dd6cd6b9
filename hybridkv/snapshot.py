"""A request frozen for migration: everything another engine needs to continue it bit-exactly,
and the schema every field must meet before anything is allocated for it (`check_fields`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

import torch

from hybridkv.errors import SnapshotMismatchError

MAX_TOKEN_ID = 2**63 - 1  # block hashes pack token ids as int64 (block_hash.py)


@dataclass
class RequestSnapshot:
    """One running request, exported by `HybridCacheManager.export_snapshot`.

    token_ids: prompt + generated tokens; num_computed_tokens: tokens whose KV/state are included.
    kv[layer]: `[parts, num_computed_tokens - kv_start[layer], kv_heads, head_dim]` per attention layer
        (token-major, so it imports into a manager with any block size); a sliding-window layer
        exports only the blocks it still holds, from token kv_start[layer] (absent: 0).
    conv[layer] / ssm[layer]: the live slot's tensors per recurrent layer (`conv_shape`, `state_shape`).
    fingerprint: model fingerprint; import refuses a mismatch. block_size: of the exporting manager.
    sampling_state: opaque here, filled by the engine (scheduler/migration.py: prompt, params,
        priority, logprobs so far, cached tokens; checked by scheduler/request_validation.py).
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


def is_int(x) -> bool:
    """An int and not a bool (JSON and Python both make True an int)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _refuse(name: str, value, rule: str):
    raise SnapshotMismatchError(f"snapshot field {name} = {value!r:.120} is malformed: {rule}")


def _int_in(name: str, value, lo: int, hi: int) -> None:
    if not is_int(value) or not lo <= value <= hi:
        _refuse(name, value, f"must be an integer >= {lo}" if hi == MAX_TOKEN_ID else f"must be an integer in [{lo}, {hi}]")


def check_keys(name: str, value, keys) -> None:
    """Raise SnapshotMismatchError unless `value` is a dict of exactly `keys` (string keys; a
    sender's typo is an error, not a default), naming the missing and the unknown ones."""
    if not isinstance(value, dict):
        _refuse(name, type(value).__name__, f"must be a dict of {sorted(keys)}")
    missing = sorted(set(keys) - set(value))
    unknown = sorted(map(repr, set(value) - set(keys)))
    if missing or unknown:
        why = "; ".join(f"{w} {ks}" for w, ks in (("missing", missing), ("unknown", unknown)) if ks)
        raise SnapshotMismatchError(f"snapshot {name} is malformed: {why} (it holds exactly {sorted(keys)})"[:400])


def _plain(v) -> bool:
    """A tuple of strings, ints and such tuples (what `layer_shapes` holds; compared with ==)."""
    return isinstance(v, tuple) and all(isinstance(x, (str, int)) or _plain(x) for x in v)


def _tensors(name: str, value) -> None:
    if not isinstance(value, dict):
        _refuse(name, value, "must be a dict {layer index: tensor}")
    for layer, t in value.items():
        if not is_int(layer) or layer < 0:
            _refuse(f"{name} key", layer, "a layer index must be an integer >= 0")
        if not isinstance(t, torch.Tensor) or t.layout is not torch.strided or t.is_meta or t.is_quantized:
            _refuse(f"{name}[{layer}]", type(t).__name__ if not isinstance(t, torch.Tensor) else t,
                    "must be a dense torch.Tensor with data")


def check_fields(snap: RequestSnapshot) -> None:
    """Raise SnapshotMismatchError naming the field, the value and the rule unless every field of
    `snap` has its type and range and the positions agree: 1 <= num_prompt_tokens <= len(token_ids),
    0 <= num_computed_tokens <= len(token_ids). What depends on the model (layers, shapes, dtypes,
    the vocabulary) and on the engine (the sampling state) is checked by them. Changes nothing."""
    if not isinstance(snap, RequestSnapshot):
        _refuse("(the snapshot)", type(snap).__name__, "must be a RequestSnapshot")
    try:
        hash(snap.req_id)
    except TypeError:
        _refuse("req_id", snap.req_id, "must be hashable (the engine's are strings)")
    tokens = snap.token_ids
    if not isinstance(tokens, (list, tuple)) or not tokens:
        _refuse("token_ids", tokens, "must be a non-empty list of token ids")
    bad = next((t for t in tokens if not is_int(t) or not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        _refuse("token_ids", bad, f"a token id must be an integer in [0, {MAX_TOKEN_ID}]")
    n, prompt, computed = len(tokens), snap.num_prompt_tokens, snap.num_computed_tokens
    _int_in("num_prompt_tokens", prompt, 1, MAX_TOKEN_ID)
    _int_in("num_computed_tokens", computed, 0, MAX_TOKEN_ID)
    if prompt > n or computed > n:
        raise SnapshotMismatchError(
            f"snapshot positions are inconsistent: {n} tokens, num_prompt_tokens={prompt}, "
            f"num_computed_tokens={computed} (need 1 <= prompt <= tokens, computed <= tokens)")
    _int_in("max_tokens", snap.max_tokens, 0, MAX_TOKEN_ID)
    _int_in("block_size", snap.block_size, 1, MAX_TOKEN_ID)
    for name in ("kv", "conv", "ssm"):
        _tensors(name, getattr(snap, name))
    if not isinstance(snap.kv_start, dict):
        _refuse("kv_start", snap.kv_start, "must be a dict {layer index: first token of its KV}")
    for layer, start in snap.kv_start.items():
        _int_in("kv_start key", layer, 0, MAX_TOKEN_ID)
        _int_in(f"kv_start[{layer}]", start, 0, MAX_TOKEN_ID)  # its kind checks the window
    if not isinstance(snap.fingerprint, str):
        _refuse("fingerprint", snap.fingerprint, "must be a string")
    if not isinstance(snap.layer_shapes, dict) or not all(is_int(k) and _plain(v) for k, v in snap.layer_shapes.items()):
        _refuse("layer_shapes", snap.layer_shapes, "must be a dict {layer index: a tuple of names and sizes}")
    if snap.cache_salt is not None and not isinstance(snap.cache_salt, str):
        _refuse("cache_salt", snap.cache_salt, "must be None or a string")
    if snap.adapter_id is not None and not isinstance(snap.adapter_id, str) and not is_int(snap.adapter_id):
        _refuse("adapter_id", snap.adapter_id, "must be None, a string or an integer")
    if not isinstance(snap.mm_hashes, (list, tuple)) or not all(isinstance(h, str) for h in snap.mm_hashes):
        _refuse("mm_hashes", snap.mm_hashes, "must be a list of strings")
