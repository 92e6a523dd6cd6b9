"""Fast torch path for the Mamba1 one-token decode step on CPU: same contract as
`mamba1_ref.mamba1_state_update_ref` (the spec).

The reference gathers the batch's states, builds the new ones out of place and scatters them
back. Here, over each run of consecutive slots (see slot_rows.py), the state rows are a view of
the pool: decayed in place (`mul_`), the input added by one broadcast `addcmul_`, and read out
with C as one row-times-matrix product per request. Slots too scattered gather once and write
back once; a half-precision pool is updated in fp32 on a copy. Checked against the reference in
tests/kernels/test_mamba1_cpu.py.
"""
from __future__ import annotations

import torch

from .mamba1_ref import discretize_dt, gate_output
from .recurrent_native import mamba1_state_update_native
from .slot_rows import update_slot_rows


def mamba1_state_update_cpu(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus=True):
    """ssm_state [S, d_inner, N] pool (updated in place); x, dt [B, d_inner]; A [d_inner, N];
    B, C [B, N]; D [d_inner] or None; z [B, d_inner] or None; dt_bias [d_inner] or None;
    slot_idx [B]. Returns y [B, d_inner] in x.dtype. The C kernel (recurrent_native.py) runs
    instead where it can: one pass over each state."""
    y = mamba1_state_update_native(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus)
    if y is not None:
        return y.to(x.dtype)
    slots = slot_idx.long()
    nb, d = x.shape
    N = A.shape[-1]
    dt = discretize_dt(dt, dt_bias, dt_softplus)  # [B, d] fp32
    dA = torch.exp(dt[..., None] * A.float())  # [B, d, N]
    xdt = dt * x.float()

    def update(h, dA, xdt, Bf, Cf):
        n = h.shape[0]
        h.mul_(dA).addcmul_(xdt[..., None], Bf.view(n, 1, N))
        return torch.bmm(Cf.reshape(n, 1, N), h.transpose(1, 2)).view(n, d)  # C as a row times h^T

    y = update_slot_rows(ssm_state, slots, (dA, xdt, B.float(), C.float()), update)
    return gate_output(y, x, D, z).to(x.dtype)
