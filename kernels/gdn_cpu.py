"""Fast torch path for the gated-delta-rule one-token decode step on CPU: same contract as
`gdn_ref.gdn_state_update_ref` (the spec).

The reference gathers the batch's states, updates a copy out of place and scatters it back. Here,
over each run of consecutive slots (see slot_rows.py), the states are a view of the pool:
decayed in place, read with k as one row-times-matrix product per (request, value head), the
rank-one correction k (beta (v - S^T k))^T added in place, and read out with q the same way.
Slots too scattered gather once and write back once; a half-precision pool is updated in fp32 on a
copy. Checked against the reference in tests/kernels/test_gdn_cpu.py.
"""
from __future__ import annotations

import torch

from .gdn_ref import _prepare_qk
from .slot_rows import update_slot_rows


def gdn_state_update_cpu(state, q, k, v, g, beta, slot_idx, scale=None, use_qk_l2norm=True):
    """state [S, HV, K, V] pool (updated in place); q, k [B, H, K]; v [B, HV, V]; g [B, HV]
    log-decay; beta [B, HV]; slot_idx [B]; scale default K**-0.5. Returns o [B, HV, V] in v.dtype."""
    slots = slot_idx.long()
    nb, HV, Vd = v.shape
    qf, kf = _prepare_qk(q, k, HV, scale, use_qk_l2norm)  # [B, HV, K] fp32
    Kd = kf.shape[-1]
    decay, vf, bf = torch.exp(g.float()), v.float(), beta.float()
    def update(S, qf, kf, decay, vf, bf):
        n = S.shape[0]
        S.mul_(decay[..., None, None])
        flat = S.view(n * HV, Kd, Vd)
        old = torch.bmm(kf.reshape(n * HV, 1, Kd), flat).view(n, HV, Vd)  # S^T k
        delta = (vf - old).mul_(bf[..., None])
        S.addcmul_(kf[..., :, None], delta[..., None, :])
        return torch.bmm(qf.reshape(n * HV, 1, Kd), flat).view(n, HV, Vd)

    o = update_slot_rows(state, slots, (qf, kf, decay, vf, bf), update)
    return o.to(v.dtype)
