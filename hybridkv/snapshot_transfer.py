"""A request's memory in and out of a manager: what a snapshot must match, and its parts per kind.

Export gathers each kind's share of `[0, num_computed_tokens)` (the KV, or the window of it, and
the live state). Import is refused, before anything is allocated, when the snapshot was taken on
another model (fingerprint, or the same fingerprint with other layer shapes), its positions are
inconsistent, it could never fit, or a kind finds its part malformed (`check_import`).
"""
from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence

import torch

from hybridkv.errors import SnapshotMismatchError
from hybridkv.request import Request
from hybridkv.snapshot import RequestSnapshot


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


def check_snapshot(snap: RequestSnapshot, kinds: Sequence, fingerprint: str,
                   check_fits: Callable[[int, int], None]) -> None:
    """Raise SnapshotMismatchError (or RequestTooLargeError from check_fits) when `snap` cannot
    continue on a manager of these kinds, whatever is free; changes nothing."""
    if snap.fingerprint != fingerprint:
        raise SnapshotMismatchError(
            f"snapshot fingerprint {snap.fingerprint!r} != this model's {fingerprint!r}: a request "
            f"can only move between engines serving the same model and weights")
    mine = layer_shapes(kinds)
    if snap.layer_shapes != mine:
        raise SnapshotMismatchError(
            f"snapshot layers {snap.layer_shapes} differ from this model's {mine}: same fingerprint, "
            f"different layer specs; check the model config")
    nc, n_tok = snap.num_computed_tokens, len(snap.token_ids)
    if not 1 <= snap.num_prompt_tokens <= n_tok or not 0 <= nc <= n_tok:
        raise SnapshotMismatchError(
            f"snapshot positions are inconsistent: {n_tok} tokens, num_prompt_tokens="
            f"{snap.num_prompt_tokens}, num_computed_tokens={nc} (need 1 <= prompt <= tokens, computed <= tokens)")
    check_fits(snap.num_prompt_tokens, snap.max_tokens)
    part = snapshot_parts(snap)
    for kind in kinds:
        kind.check_import(part, nc)


def request_of(snap: RequestSnapshot, request_id: Optional[Hashable] = None, params=None) -> Request:
    """A new request of the snapshot's tokens, prompt length, max_tokens and cache keys, named
    request_id (None: the snapshot's), to import the snapshot as (`import_snapshot`)."""
    return Request(snap.req_id if request_id is None else request_id, snap.token_ids, params,
                   max_tokens=snap.max_tokens, cache_salt=snap.cache_salt, adapter_id=snap.adapter_id,
                   mm_hashes=tuple(snap.mm_hashes), num_prompt_tokens=snap.num_prompt_tokens)
