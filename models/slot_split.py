"""Which requests of a step run the one-token decode kernels and which the varlen prefill kernels.

A request decodes when it brings one token on top of a state (`seq_len > 1`); everything else
(prompt starts, prefill chunks, a one-token prompt) goes through the varlen path, which also
handles a zero initial state. Recurrent mixers share one split per step.

A request that verifies a draft (`ForwardBatch.verify_slots`: speculative decoding) brings k + 1
tokens and must leave the state after EACH of them, so that accepting j drafts makes the state
after token j the live one by a slot move, never a replay. Its tokens run the one-token decode
kernels position by position, each on a state slot of its own: before position j's decode, the
states this call writes (`run(..., states=...)`) are copied from the slot of position j - 1 (the
live slot for j = 0) into the slot of position j. The live slot itself is never written, so a
rejected draft leaves nothing to undo. The arithmetic per token is the plain decode's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .forward_batch import ForwardBatch

_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)


@dataclass
class SlotSplit:
    """Rows of the packed batch routed to each path.

    decode_rows:   [Bd] long token rows of decoding requests, or None when there are none (or all decode)
    decode_slots:  [Bd] int32 their state slots
    prefill_rows:  [Tp] long token rows of prefilling requests; None when there are none
    prefill_qsl:   [Rp+1] int32 query_start_loc re-based to the gathered prefill rows
    prefill_slots: [Rp] int32; prefill_has_init: [Rp] bool
    all_prefill / all_decode: the gather is the identity (skip copying)
    verify:        the steps of the requests that verify drafts, one per position (see the module doc)
    """

    num_tokens: int
    decode_rows: Optional[torch.Tensor]
    decode_slots: Optional[torch.Tensor]
    prefill_rows: Optional[torch.Tensor]
    prefill_qsl: Optional[torch.Tensor]
    prefill_slots: Optional[torch.Tensor]
    prefill_has_init: Optional[torch.Tensor]
    all_prefill: bool
    all_decode: bool
    verify: Sequence["VerifyStep"] = ()
    requantize: Optional[Callable] = None  # ForwardBatch.requantize

    @property
    def has_plain_rows(self) -> bool:
        """Whether some rows decode or prefill (not only verify drafts)."""
        return self.all_decode or self.all_prefill or self.decode_rows is not None or self.prefill_rows is not None

    def run(self, x: torch.Tensor, decode: Callable, prefill: Callable,
            out_dim: Optional[int] = None, states: Sequence[torch.Tensor] = (),
            skip_verify: bool = False) -> torch.Tensor:
        """Apply `decode(x_rows, self)` / `prefill(x_rows, self)` to their rows of x [T, ...].

        Returns [T, out_dim] (out_dim defaults to x's last dim; trailing dims of the outputs are
        kept as the callables return them). Rows of zero-length requests stay zero.
        states: the pool tensors [S, ...] that `decode` writes at its slots; needed (and only
        read) when some requests verify drafts, whose rows run `decode` position by position.
        skip_verify: leave the verifying rows zero (the caller ran them: `verify_each`).
        """
        if self.all_decode:
            return decode(x, self)
        if self.all_prefill:
            return prefill(x, self)
        parts = []
        if self.decode_rows is not None:
            parts.append((self.decode_rows, decode(x[self.decode_rows], self)))
        if self.prefill_rows is not None:
            parts.append((self.prefill_rows, prefill(x[self.prefill_rows], self)))
        if not skip_verify:
            parts += self.verify_each(x, lambda rows, step: decode(rows, step.split), states)
        trailing = parts[0][1].shape[1:] if parts else ((out_dim or x.shape[-1]),)
        out = x.new_zeros((self.num_tokens, *trailing), dtype=parts[0][1].dtype if parts else x.dtype)
        for rows, y in parts:
            out[rows] = y
        return out

    def verify_each(self, x: torch.Tensor, step_fn: Callable, states: Sequence[torch.Tensor]) -> list:
        """The verifying rows of x position by position: before each VerifyStep, `states` (the
        pool tensors step_fn writes) are copied from the slots of the position before into the
        step's; then step_fn(x[rows], step) runs the one-token decode at step.dst. Returns [(rows,
        output)]; [] when step_fn returns None at the first step (it cannot run here: nothing of
        it stays, the caller runs the rows another way)."""
        if self.verify and not states:
            raise ValueError("this layer's split.run names no state tensors (states=...), so its decode "
                             "cannot verify drafts position by position")
        parts = []
        host = [t.numpy() for t in states] if self.requantize is None and all(
            t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES for t in states) else None
        for j, step in enumerate(self.verify):
            if host is not None:  # the state before this position: the previous position's
                for a in host:  # (numpy on the CPU: ~1 us a copy, against ~15 through torch's indexing)
                    a[step.dst_list] = a[step.src_list]
            elif self.requantize is not None and j > 0:  # as the pool would have kept it
                for t in states:
                    t[step.dst] = self.requantize(t, step.src)
            else:
                for t in states:
                    t[step.dst] = t[step.src]
            y = step_fn(x[step.rows], step)
            if y is None:
                return []
            parts.append((step.rows, y))
        return parts


@dataclass
class VerifyStep:
    """Position j of every verifying request that has one: its token rows [n] (long), the slots
    holding the state before it (src) and the slots its state goes to (dst, int32 [n]); `split`
    routes the rows to `decode` with decode_slots = dst."""

    rows: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    split: SlotSplit
    src_list: list[int]
    dst_list: list[int]


def _verify_steps(verify: list[tuple[int, int, list[int]]], dev) -> list[VerifyStep]:
    """verify: (first token row, query length q, slot chain [live, slot of token 0, ..., of token
    q - 1]) per verifying request -> one VerifyStep per position."""
    steps = []
    for j in range(max(q for _, q, _ in verify)):
        at = [(row + j, chain[j], chain[j + 1]) for row, q, chain in verify if q > j]
        rows, src, dst = zip(*at)
        dst_t = torch.tensor(dst, dtype=torch.int32, device=dev)
        view = SlotSplit(len(rows), None, dst_t, None, None, None, None, all_prefill=False, all_decode=True)
        steps.append(VerifyStep(torch.tensor(rows, device=dev), torch.tensor(src, device=dev).long(),
                                dst_t.long(), view, list(src), list(dst)))
    return steps


def split_decode_prefill(batch: ForwardBatch) -> SlotSplit:
    """Split `batch`'s requests by query length (host lists; no device sync when they are set)."""
    qsl = batch.query_start_loc
    qlens = batch.query_lens_cpu or (qsl[1:] - qsl[:-1]).tolist()
    slens = batch.seq_lens_cpu or batch.seq_lens.tolist()
    if len(qlens) != batch.num_reqs or len(slens) != batch.num_reqs:
        raise ValueError(f"batch has {batch.num_reqs} requests but query_lens_cpu has {len(qlens)} "
                         f"and seq_lens_cpu {len(slens)} entries; fill both or leave them empty")
    dev = batch.input_ids.device
    dec_req, dec_row, pre_req, pre_rows, pre_qsl = [], [], [], [], [0]
    verify_slots, verify = batch.verify_slots, []
    start = 0
    for r, (q, s) in enumerate(zip(qlens, slens)):
        if verify_slots and r in verify_slots:
            chain = verify_slots[r]
            if len(chain) != q + 1:
                raise ValueError(f"request {r} verifies {q} tokens but has {len(chain)} slots; expected the live "
                                 f"slot and one per token")
            verify.append((start, q, chain))
        elif q == 1 and s > 1:
            dec_req.append(r)
            dec_row.append(start)
        elif q > 0:
            pre_req.append(r)
            pre_rows.append(torch.arange(start, start + q))
            pre_qsl.append(pre_qsl[-1] + q)
        start += q
    all_decode = len(dec_req) == batch.num_reqs
    all_prefill = len(pre_req) == batch.num_reqs
    slots = batch.state_slots
    decode_rows = decode_slots = None
    if all_decode:  # rows and slots as they are: no index tensor from the host (graph-capturable)
        decode_slots = slots
    elif dec_req:
        idx = torch.tensor(dec_req, device=dev)
        decode_rows = torch.tensor(dec_row, device=dev)
        decode_slots = slots[idx]
    prefill_rows = prefill_qsl = prefill_slots = prefill_has_init = None
    if pre_req:
        idx = torch.tensor(pre_req, device=dev)
        prefill_rows = torch.cat(pre_rows).to(dev)
        prefill_qsl = torch.tensor(pre_qsl, dtype=torch.int32, device=dev)
        prefill_slots = slots[idx]
        prefill_has_init = batch.has_initial_state[idx]
    return SlotSplit(start, decode_rows, decode_slots, prefill_rows, prefill_qsl, prefill_slots,
                     prefill_has_init, all_prefill=all_prefill, all_decode=all_decode,
                     verify=_verify_steps(verify, dev) if verify else (), requantize=batch.requantize)
