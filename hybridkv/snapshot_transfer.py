"""A request's memory in and out of a manager: what a snapshot must match, and its parts per kind.

Export gathers each kind's share of `[0, num_computed_tokens)` (the KV, or the window of it, and
the live state). Import is refused with SnapshotMismatchError, before anything is allocated, when
a field is malformed (`snapshot.check_fields`), the snapshot was taken on another model
(fingerprint, or the same fingerprint with other layer shapes), it carries tensors for layers this
model's kinds do not keep, it could never fit, a kind finds its part malformed (shape, dtype,
finite values, where a window starts: `check_import`), or the request to import it as has other tokens.
Then `place_snapshot` puts each kind's part in place; the manager registers the request.
"""
from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence

import torch

from hybridkv.errors import SnapshotMismatchError
from hybridkv.request import Request, RequestStatus
from hybridkv.snapshot import RequestSnapshot, check_fields


def layer_shapes(kinds: Sequence) -> dict[int, tuple]:
    """{layer: per-token KV shape or (conv shape, state shape)} with dtypes, to refuse mismatched imports."""
    out: dict[int, tuple] = {}
    for kind in kinds:
        out.update(kind.layer_shapes())
    return dict(sorted(out.items()))


def export_snapshot(r: Request, kinds: Sequence, fingerprint: str, block_size: int,
                    device: torch.device | str, sampling_state=None) -> RequestSnapshot:
    """Copy running request `r`'s memory of [0, num_computed_tokens) from every kind to `device`."""
    parts: dict = {"kv": {}, "kv_start": {}, "conv": {}, "ssm": {}}
    for kind in kinds:
        for field_name, value in kind.export(r.request_id, r.num_computed_tokens, device).items():
            parts[field_name].update(value)
    return RequestSnapshot(r.request_id, list(r.token_ids), r.num_prompt_tokens, r.num_computed_tokens,
                           r.max_tokens, parts["kv"], parts["conv"], parts["ssm"], fingerprint,
                           block_size, r.cache_salt, r.adapter_id, r.mm_hashes, sampling_state,
                           layer_shapes(kinds), kv_start=parts["kv_start"])


def snapshot_parts(snap: RequestSnapshot) -> dict:
    """The snapshot's tensors by part, as each kind's check_import / can_import / import_ reads them."""
    return {"kv": snap.kv, "kv_start": snap.kv_start, "conv": snap.conv, "ssm": snap.ssm}


def layers_by_part(shapes: dict[int, tuple]) -> dict[str, set[int]]:
    """{part: the layers whose tensors a snapshot of these layer shapes carries}: kv and kv_start
    for attention layers, conv / ssm for recurrent layers that keep one (`layer_shapes`)."""
    attn = {i for i, v in shapes.items() if v[0] == "attn"}
    rec = {i: v for i, v in shapes.items() if v[0] == "rec"}
    return {"kv": attn, "kv_start": attn, "conv": {i for i, v in rec.items() if v[1]},
            "ssm": {i for i, v in rec.items() if v[2]}}


def _cache_dtypes(shapes: dict) -> dict[str, str]:
    """{"attn" / "rec": the cache dtype its layers keep} from `layer_shapes` ("auto": the model's)."""
    out: dict[str, str] = {}
    for shape in shapes.values():
        if isinstance(shape, tuple) and shape:
            quant = shape[shape.index("cache") + 1] if "cache" in shape[:-1] else "auto"
            out[str(shape[0])] = quant
    return out


def check_snapshot(snap: RequestSnapshot, request: Request, kinds: Sequence, fingerprint: str,
                   check_fits: Callable[[int, int], None]) -> None:
    """Raise SnapshotMismatchError (or RequestTooLargeError from check_fits) when `snap` cannot
    continue as `request` on a manager of these kinds, whatever is free; changes nothing."""
    check_fields(snap)
    if snap.fingerprint != fingerprint:
        raise SnapshotMismatchError(
            f"snapshot fingerprint {snap.fingerprint!r} != this model's {fingerprint!r}: a request "
            f"can only move between engines serving the same model and weights")
    mine = layer_shapes(kinds)
    theirs_dtypes, my_dtypes = _cache_dtypes(snap.layer_shapes), _cache_dtypes(mine)
    if any(theirs_dtypes[k] != my_dtypes[k] for k in set(theirs_dtypes) & set(my_dtypes)):
        raise SnapshotMismatchError(
            f"snapshot was taken with cache dtypes {theirs_dtypes} and this engine keeps {my_dtypes} "
            f"(kv_cache_dtype / state_cache_dtype): a request moves only between engines with the same ones")
    if snap.layer_shapes != mine:
        raise SnapshotMismatchError(
            f"snapshot layers {snap.layer_shapes} differ from this model's {mine}: same fingerprint, "
            f"different layer specs; check the model config")
    part = snapshot_parts(snap)
    for name, layers in layers_by_part(mine).items():
        extra = sorted(set(part[name]) - layers)
        if extra:
            raise SnapshotMismatchError(
                f"snapshot field {name} has layers {extra} that this model does not keep there "
                f"(it keeps {sorted(layers)}): tensors renamed or added on the way")
    check_fits(snap.num_prompt_tokens, snap.max_tokens)
    for kind in kinds:
        kind.check_import(part, snap.num_computed_tokens)
    if request.token_ids != list(snap.token_ids):
        raise SnapshotMismatchError(f"request {request.request_id!r} to import has other tokens than its snapshot")


def place_snapshot(snap: RequestSnapshot, r: Request, kinds: Sequence, prefix_cache,
                   num_new_tokens: Optional[int] = None) -> bool:
    """Place a checked snapshot's memory (`check_snapshot`) in every kind for `r`, which becomes
    RUNNING at snap.num_computed_tokens, with room up to num_new_tokens more (None: its whole
    token list). False when a kind cannot take its part now (nothing changed). A transaction: when
    a kind fails while placing its part, every kind lets go of what it took for r (nothing of it
    is cached), r is left WAITING at 0 tokens, and the error is raised.
    prefix_cache: the manager's (prefix_cache.py), which keys and hashes r's blocks."""
    nc, part = snap.num_computed_tokens, snapshot_parts(snap)
    end = len(snap.token_ids) if num_new_tokens is None else nc + num_new_tokens
    if not all(k.can_import(part, nc, end) for k in kinds):
        return False
    rid = prefix_cache.keyed(r).request_id
    r.num_computed_tokens = r.resumed_from = nc
    r.num_hashed_blocks = 0
    hashes: list[bytes] = []
    if prefix_cache.enabled:
        hashes = prefix_cache.hashes(r)
        r.num_hashed_blocks = nc // prefix_cache.block_size
    r.status = RequestStatus.RUNNING
    try:
        for kind in kinds:
            kind.import_(rid, part, hashes, nc)
    except BaseException:
        for kind in kinds:  # as the manager's finish(discard=True): no state kept, no new block findable
            kind.release(rid)
        for kind in kinds:
            kind.forget(rid)
        r.status, r.num_computed_tokens, r.num_hashed_blocks = RequestStatus.WAITING, 0, 0
        raise
    return True


def request_of(snap: RequestSnapshot, request_id: Optional[Hashable] = None, params=None) -> Request:
    """A new request of the snapshot's tokens, prompt length, max_tokens and cache keys, named
    request_id (None: the snapshot's), to import the snapshot as (`import_snapshot`)."""
    return Request(snap.req_id if request_id is None else request_id, snap.token_ids, params,
                   max_tokens=snap.max_tokens, cache_salt=snap.cache_salt, adapter_id=snap.adapter_id,
                   mm_hashes=tuple(snap.mm_hashes), num_prompt_tokens=snap.num_prompt_tokens)
