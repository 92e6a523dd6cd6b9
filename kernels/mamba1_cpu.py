"""Fast torch path for the Mamba1 one-token decode step on CPU: same contract as
`mamba1_ref.mamba1_state_update_ref` (the spec).

The reference gathers the batch's states, builds the new ones out of place and scatters them
back. Here, when the batch's slots are one range (see slot_rows.py), the state rows are a view of
the pool: decayed in place (`mul_`), the input added by one broadcast `addcmul_`, and read out
with C as one row-times-matrix product per request. Scattered slots gather once and write back
once; a half-precision pool is updated in fp32 on a copy. Checked against the reference in
tests/kernels/test_mamba1_cpu.py.
"""
from __future__ import annotations

import torch

from .mamba1_ref import _discretize_dt, _gate
from .slot_rows import slot_range


def mamba1_state_update_cpu(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus=True):
    """ssm_state [S, d_inner, N] pool (updated in place); x, dt [B, d_inner]; A [d_inner, N];
    B, C [B, N]; D [d_inner] or None; z [B, d_inner] or None; dt_bias [d_inner] or None;
    slot_idx [B]. Returns y [B, d_inner] in x.dtype."""
    slots = slot_idx.long()
    nb, d = x.shape
    n = A.shape[-1]
    dt = _discretize_dt(dt, dt_bias, dt_softplus)  # [B, d] fp32
    dA = torch.exp(dt[..., None] * A.float())  # [B, d, N]
    xdt = dt * x.float()
    Bf, Cf = B.float(), C.float()
    h, order = slot_range(ssm_state, slots) if ssm_state.dtype == torch.float32 else (None, None)
    in_place = h is not None
    if not in_place:
        h = ssm_state.index_select(0, slots).float()
    elif order is not None:  # requests permuted into slot order, results permuted back below
        dA, xdt, Bf, Cf = dA[order], xdt[order], Bf[order], Cf[order]
    h.mul_(dA).addcmul_(xdt[..., None], Bf.view(nb, 1, n))
    y = torch.bmm(Cf.reshape(nb, 1, n), h.transpose(1, 2)).view(nb, d)  # C as a row times h^T
    if not in_place:
        ssm_state.index_copy_(0, slots, h.to(ssm_state.dtype))
    elif order is not None:
        y = torch.empty_like(y).index_copy_(0, order, y)
    return _gate(y, x, D, z).to(x.dtype)
