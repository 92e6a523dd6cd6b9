"""A RequestSnapshot as bytes (safetensors + a JSON header + a SHA-256 trailer), and over torch.distributed.

Bytes let a snapshot cross processes or hosts by any transport; `send_snapshot` /
`recv_snapshot` use point-to-point torch.distributed (gloo on CPU, NCCL on GPU).
"""
from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from hybridkv.errors import SnapshotMismatchError
from hybridkv.snapshot import RequestSnapshot, check_fields, check_keys

_KINDS = ("kv", "conv", "ssm")
_DIGEST = 32  # SHA-256 of the safetensors payload, appended to it
_META = {"req_id", "token_ids", "num_prompt_tokens", "num_computed_tokens", "max_tokens", "fingerprint",
         "block_size", "cache_salt", "adapter_id", "mm_hashes", "sampling_state", "layer_shapes", "kv_start"}


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def snapshot_to_bytes(snap: RequestSnapshot) -> bytes:
    tensors = {f"{k}.{layer}": t.contiguous().cpu() for k in _KINDS for layer, t in getattr(snap, k).items()}
    meta = {"req_id": snap.req_id, "token_ids": snap.token_ids, "num_prompt_tokens": snap.num_prompt_tokens,
            "num_computed_tokens": snap.num_computed_tokens, "max_tokens": snap.max_tokens,
            "fingerprint": snap.fingerprint, "block_size": snap.block_size, "cache_salt": snap.cache_salt,
            "adapter_id": snap.adapter_id, "mm_hashes": list(snap.mm_hashes),
            "sampling_state": snap.sampling_state,
            "layer_shapes": {str(k): list(v) for k, v in snap.layer_shapes.items()},
            "kv_start": {str(k): v for k, v in snap.kv_start.items()}}
    payload = st_save(tensors, metadata={"snapshot": json.dumps(meta)})
    return payload + hashlib.sha256(payload).digest()  # a flipped byte in transit is caught on load


def snapshot_from_bytes(data: bytes) -> RequestSnapshot:
    """Inverse of snapshot_to_bytes. Raises SnapshotMismatchError, naming what is wrong, if the
    bytes were changed on the way (the SHA-256 trailer) or, checksum valid, their content is not a
    snapshot: the safetensors payload, the metadata (exactly the fields of snapshot_to_bytes, each
    of its type and range: `snapshot.check_fields`), tensor names other than `kv|conv|ssm.<layer>`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SnapshotMismatchError(f"snapshot bytes must be bytes, got {type(data).__name__}")
    data, digest = bytes(data[:-_DIGEST]), bytes(data[-_DIGEST:])
    if len(data) < 8 or hashlib.sha256(data).digest() != digest:
        raise SnapshotMismatchError(
            f"snapshot bytes are corrupt: their SHA-256 does not match the one sent with them "
            f"({len(data) + _DIGEST} bytes received); send the snapshot again")
    try:  # a buggy or hostile sender can make the parsers raise many types: one here
        snap = _parse(data)
    except SnapshotMismatchError:
        raise
    except Exception as e:
        raise SnapshotMismatchError(f"snapshot bytes are not a snapshot: {type(e).__name__}: {e}"[:400]) from None
    check_fields(snap)
    return snap


def _layer(name: str) -> int:
    """A layer index written as a canonical decimal string (so no two names mean one layer)."""
    if not (name.isascii() and name.isdigit() and str(int(name)) == name):
        raise SnapshotMismatchError(f"snapshot layer index {name!r:.80} is not a decimal integer")
    return int(name)


def _parse(data: bytes) -> RequestSnapshot:
    tensors = st_load(data)
    header_len = int.from_bytes(data[:8], "little")
    meta = json.loads(json.loads(data[8:8 + header_len])["__metadata__"]["snapshot"])
    check_keys("metadata", meta, _META)
    parts = {k: {} for k in _KINDS}
    for name, t in tensors.items():
        kind, _, layer = name.partition(".")
        if kind not in parts:
            raise SnapshotMismatchError(f"snapshot tensor {name!r:.80} is not named kv|conv|ssm.<layer index>")
        parts[kind][_layer(layer)] = t
    for key in ("layer_shapes", "kv_start"):
        if not isinstance(meta[key], dict):
            raise SnapshotMismatchError(f"snapshot metadata {key} must be a dict, got {meta[key]!r:.200}")
    if not isinstance(meta["mm_hashes"], list):
        raise SnapshotMismatchError(f"snapshot metadata mm_hashes must be a list, got {meta['mm_hashes']!r:.80}")
    return RequestSnapshot(
        meta["req_id"], meta["token_ids"], meta["num_prompt_tokens"], meta["num_computed_tokens"],
        meta["max_tokens"], parts["kv"], parts["conv"], parts["ssm"], meta["fingerprint"], meta["block_size"],
        meta["cache_salt"], meta["adapter_id"], tuple(meta["mm_hashes"]), meta["sampling_state"],
        {_layer(k): _tuples(v) for k, v in meta["layer_shapes"].items()},
        {_layer(k): v for k, v in meta["kv_start"].items()})


def send_snapshot(snap: RequestSnapshot, dst: int, device: torch.device | str = "cpu") -> None:
    """Send to rank `dst` of the default process group (a length, then the bytes)."""
    import torch.distributed as dist

    payload = torch.frombuffer(bytearray(snapshot_to_bytes(snap)), dtype=torch.uint8).to(device)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), dst)
    dist.send(payload, dst)


def recv_snapshot(src: int, device: torch.device | str = "cpu") -> RequestSnapshot:
    """Receive a snapshot sent by rank `src` with send_snapshot."""
    import torch.distributed as dist

    n = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(n, src)
    payload = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, src)
    return snapshot_from_bytes(payload.cpu().numpy().tobytes())
