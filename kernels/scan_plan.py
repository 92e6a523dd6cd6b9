"""The chunk list of a varlen prefill scan, built once on the host for the Triton prefill kernels.

A request's tokens are cut into chunks of at most `chunk_size` that never cross a request
boundary, and are also cut at every position in `return_states_at`, so the state at the end of
a chunk is exactly a state the caller asked for (the chunked forms are exact at any cut). The
kernels loop with scalar bounds (`max_chunks`, `max_len`) and mask the shorter requests, so no
bound is ever loaded from device memory (Triton 3.6's interpreter rejects that).

The plan costs one device-to-host copy (query_start_loc, slot_idx and has_initial_state together)
and one host-to-device copy of the int32 tables; nothing inside the kernels syncs.
"""
from __future__ import annotations

from dataclasses import dataclass

import weakref

import torch

from .varlen import check_positions_arg, request_spans, state_cuts


@dataclass(frozen=True)
class ScanPlan:
    """Chunk and request tables (int32, on the inputs' device) and the checkpoint layout.

    chunk_start [C], chunk_len [C]: packed token rows of each chunk; chunk_ckpt [C]: row of the
    checkpoint buffer that takes the state at the chunk's end, or -1. req_start [R], req_len [R],
    req_first_chunk [R], req_num_chunks [R], req_slot [R], req_init [R] (1: start from the slot),
    req_write [R] (1: the final state goes back to the slot). token_ckpt [T]: checkpoint row of the
    state after each token, or -1. ckpt_rows: per request, the checkpoint rows of its requested
    positions in the order asked (None when no states were asked for).
    """
    chunk_start: torch.Tensor
    chunk_len: torch.Tensor
    chunk_ckpt: torch.Tensor
    req_start: torch.Tensor
    req_len: torch.Tensor
    req_first_chunk: torch.Tensor
    req_num_chunks: torch.Tensor
    req_slot: torch.Tensor
    req_init: torch.Tensor
    req_write: torch.Tensor
    token_ckpt: torch.Tensor
    num_chunks: int
    max_chunks: int
    max_len: int
    num_ckpt: int
    ckpt_rows: list[list[int]] | None


def build_scan_plan(query_start_loc, slot_idx, has_initial_state, num_slots: int,
                    num_tokens: int, chunk_size: int, return_states_at, device) -> ScanPlan:
    """Chunk list for `num_tokens` packed tokens; checks the same things as the references.

    The layers of one step pass the same query_start_loc / slot / flag tensors (models'
    `SlotSplit`), so the last few plans are kept by those tensors' identity and version: one
    device-to-host copy per step and chunk size, not one per layer.
    """
    tensors = (query_start_loc, slot_idx, has_initial_state)
    if any(t is not None and t.is_inference() for t in tensors):  # no version counter to key on
        return _build(query_start_loc, slot_idx, has_initial_state, num_slots, num_tokens,
                      chunk_size, return_states_at, device)
    key = (tuple(None if t is None else (id(t), t._version) for t in tensors), num_slots,
           num_tokens, chunk_size, str(device),
           None if return_states_at is None else tuple(tuple(int(p) for p in ps)
                                                         for ps in return_states_at))
    for i, (k, refs, plan) in enumerate(_RECENT):
        if k == key and all(r is None if t is None else r() is t for r, t in zip(refs, tensors)):
            _RECENT.insert(0, _RECENT.pop(i))
            return plan
    plan = _build(query_start_loc, slot_idx, has_initial_state, num_slots, num_tokens,
                  chunk_size, return_states_at, device)
    refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
    _RECENT.insert(0, (key, refs, plan))
    del _RECENT[_KEEP:]
    return plan


_KEEP = 8  # plans kept: a step's few chunk sizes (SSD, GDN, Mamba1 layers) with room to spare
_RECENT: list = []


def _build(query_start_loc, slot_idx, has_initial_state, num_slots, num_tokens, chunk_size,
           return_states_at, device) -> ScanPlan:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    init = (torch.ones_like(slot_idx, dtype=torch.int32) if has_initial_state is None
            else has_initial_state.to(torch.int32))
    # one transfer for the three small tables (validated on the host like the references do)
    R = slot_idx.shape[0]
    if query_start_loc.shape[0] != R + 1 or init.shape[0] != R:
        request_spans(query_start_loc.cpu(), num_slots, slot_idx.cpu(), init.cpu())  # raises
    host = torch.cat([query_start_loc.to(torch.int64).flatten(), slot_idx.to(torch.int64),
                      init.to(torch.int64)]).cpu()
    spans = request_spans(host[:R + 1], num_slots, host[R + 1:2 * R + 1], host[2 * R + 1:] != 0)
    check_positions_arg(return_states_at, len(spans))
    if spans and spans[-1][1] > num_tokens:
        raise ValueError(f"query_start_loc ends at {spans[-1][1]} but only {num_tokens} tokens "
                         "were given")
    chunk_start, chunk_len, chunk_ckpt = [], [], []
    req = [[], [], [], [], [], [], []]
    token_ckpt = [-1] * num_tokens
    ckpt_rows = None if return_states_at is None else []
    num_ckpt = 0
    for r, (start, end, slot, has) in enumerate(spans):
        wanted = [] if return_states_at is None else [int(p) for p in return_states_at[r]]
        length = end - start
        cuts = set(state_cuts(length, wanted, r)) | set(range(chunk_size, length, chunk_size))
        row_of = {}
        for p in sorted(set(wanted)):
            row_of[p] = num_ckpt
            token_ckpt[start + p - 1] = num_ckpt
            num_ckpt += 1
        if ckpt_rows is not None:
            ckpt_rows.append([row_of[p] for p in wanted])
        first, prev = len(chunk_start), 0
        for cut in sorted(cuts):
            chunk_start.append(start + prev)
            chunk_len.append(cut - prev)
            chunk_ckpt.append(row_of.get(cut, -1))
            prev = cut
        for column, value in zip(req, (start, length, first, len(chunk_start) - first, slot,
                                       int(has), int(length > 0 or not has))):
            column.append(value)
    sizes = [len(chunk_start)] * 3 + [len(spans)] * 7 + [num_tokens]
    flat = _to_device(torch.tensor(chunk_start + chunk_len + chunk_ckpt + sum(req, []) + token_ckpt,
                                   dtype=torch.int32), device)
    parts = list(torch.split(flat, sizes))
    return ScanPlan(*parts, num_chunks=len(chunk_start),
                    max_chunks=max(req[3], default=0), max_len=max(req[1], default=0),
                    num_ckpt=num_ckpt, ckpt_rows=ckpt_rows)


def gather_checkpoints(ckpt: torch.Tensor, plan: ScanPlan) -> list[torch.Tensor]:
    """Per request, the states at its requested positions: ckpt rows in the order asked."""
    out = []
    for rows in plan.ckpt_rows:
        index = _to_device(torch.tensor(rows, dtype=torch.long), ckpt.device)
        out.append(ckpt.index_select(0, index))
    return out


def unit_last_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` itself when its last dim has unit stride (the kernels index channels so), else a
    contiguous copy; None (an absent optional input) stays None."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def check_packed_tokens(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> None:
    """q [T, H, K] and v [T, H, V] packed with the same token count, and a positive chunk size."""
    if q.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} and v {tuple(v.shape)} must be packed [T, H, .] "
                         "with the same token count")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")


def matmul_precision(dtype: torch.dtype) -> str:
    """tl.dot precision: exact fp32 products for fp32 operands; "tf32" is ignored for fp16/bf16."""
    return "ieee" if dtype == torch.float32 else "tf32"


def scan_result(out: torch.Tensor, ckpt: torch.Tensor, plan: ScanPlan, return_states_at):
    """What a chunk scan returns: `out`, or (out, per-request checkpoint states) when asked."""
    if return_states_at is None:
        return out
    return out, gather_checkpoints(ckpt, plan)


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host table onto the device without waiting for the stream (pinned, non-blocking)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
