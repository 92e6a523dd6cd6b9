"""Which requests of a step run the one-token decode kernels and which the varlen prefill kernels.

A request decodes when it brings one token on top of a state (`seq_len > 1`); everything else
(prompt starts, prefill chunks, a one-token prompt) goes through the varlen path, which also
handles a zero initial state. Recurrent mixers share one split per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .forward_batch import ForwardBatch


@dataclass
class SlotSplit:
    """Rows of the packed batch routed to each path.

    decode_rows:   [Bd] long token rows of decoding requests, or None when there are none (or all decode)
    decode_slots:  [Bd] int32 their state slots
    prefill_rows:  [Tp] long token rows of prefilling requests; None when there are none
    prefill_qsl:   [Rp+1] int32 query_start_loc re-based to the gathered prefill rows
    prefill_slots: [Rp] int32; prefill_has_init: [Rp] bool
    all_prefill / all_decode: the gather is the identity (skip copying)
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

    def run(self, x: torch.Tensor, decode: Callable, prefill: Callable,
            out_dim: Optional[int] = None) -> torch.Tensor:
        """Apply `decode(x_rows, self)` / `prefill(x_rows, self)` to their rows of x [T, ...].

        Returns [T, out_dim] (out_dim defaults to x's last dim; trailing dims of the outputs are
        kept as the callables return them). Rows of zero-length requests stay zero.
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
        trailing = parts[0][1].shape[1:] if parts else ((out_dim or x.shape[-1]),)
        out = x.new_zeros((self.num_tokens, *trailing), dtype=parts[0][1].dtype if parts else x.dtype)
        for rows, y in parts:
            out[rows] = y
        return out


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
    start = 0
    for r, (q, s) in enumerate(zip(qlens, slens)):
        if q == 1 and s > 1:
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
                     prefill_has_init, all_prefill=all_prefill, all_decode=all_decode)
