"""Fast torch path for the gated-delta-rule one-token decode step on CPU: same contract as
`gdn_ref.gdn_state_update_ref` (the spec).

The reference gathers the batch's states, updates a copy out of place and scatters it back. Here,
when the batch's slots are one range (see slot_rows.py), the states are a view of the pool:
decayed in place, read with k as one row-times-matrix product per (request, value head), the
rank-one correction k (beta (v - S^T k))^T added in place, and read out with q the same way.
Scattered slots gather once and write back once; a half-precision pool is updated in fp32 on a
copy. Checked against the reference in tests/kernels/test_gdn_cpu.py.
"""
from __future__ import annotations

import torch

from .gdn_ref import _prepare_qk
from .slot_rows import slot_range


def gdn_state_update_cpu(state, q, k, v, g, beta, slot_idx, scale=None, use_qk_l2norm=True):
    """state [S, HV, K, V] pool (updated in place); q, k [B, H, K]; v [B, HV, V]; g [B, HV]
    log-decay; beta [B, HV]; slot_idx [B]; scale default K**-0.5. Returns o [B, HV, V] in v.dtype."""
    slots = slot_idx.long()
    nb, HV, Vd = v.shape
    qf, kf = _prepare_qk(q, k, HV, scale, use_qk_l2norm)  # [B, HV, K] fp32
    Kd = kf.shape[-1]
    decay, vf, bf = torch.exp(g.float()), v.float(), beta.float()
    S, order = slot_range(state, slots) if state.dtype == torch.float32 else (None, None)
    in_place = S is not None
    if not in_place:
        S = state.index_select(0, slots).float()
    elif order is not None:  # requests permuted into slot order, results permuted back below
        qf, kf, decay, vf, bf = qf[order], kf[order], decay[order], vf[order], bf[order]
    S.mul_(decay[..., None, None])
    flat = S.view(nb * HV, Kd, Vd)
    old = torch.bmm(kf.reshape(nb * HV, 1, Kd), flat).view(nb, HV, Vd)  # S^T k
    delta = (vf - old).mul_(bf[..., None])
    S.addcmul_(kf[..., :, None], delta[..., None, :])
    o = torch.bmm(qf.reshape(nb * HV, 1, Kd), flat).view(nb, HV, Vd)
    if not in_place:
        state.index_copy_(0, slots, S.to(state.dtype))
    elif order is not None:
        o = torch.empty_like(o).index_copy_(0, order, o)
    return o.to(v.dtype)
