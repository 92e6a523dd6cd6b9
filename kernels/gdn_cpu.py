"""Fast torch paths for the gated delta rule on CPU, the one-token decode step and the varlen
chunked prefill: same contracts as `gdn_ref.gdn_state_update_ref` / `gdn_chunk_scan_ref` (the spec).

The reference gathers the batch's states, updates a copy out of place and scatters it back. Here,
over each run of consecutive slots (see slot_rows.py), the states are a view of the pool:
decayed in place, read with k as one row-times-matrix product per (request, value head), the
rank-one correction k (beta (v - S^T k))^T added in place, and read out with q the same way.
Slots too scattered gather once and write back once; a half-precision pool is updated in fp32 on a
copy. The prefill is described on `gdn_chunk_scan_cpu`. Checked against the reference in
tests/kernels/test_gdn_cpu.py.
"""
from __future__ import annotations

import torch

from .chunk_layout import ChunkLayout
from .gdn_ref import prepare_qk
from .recurrent_native import gdn_state_update_native
from .slot_rows import update_slot_rows
from .varlen import check_positions_arg, request_spans, state_cuts


def gdn_state_update_cpu(state, q, k, v, g, beta, slot_idx, scale=None, use_qk_l2norm=True):
    """state [S, HV, K, V] pool (updated in place); q, k [B, H, K]; v [B, HV, V]; g [B, HV]
    log-decay; beta [B, HV]; slot_idx [B]; scale default K**-0.5. Returns o [B, HV, V] in v.dtype.
    The C kernel (recurrent_native.py) runs instead where it can: two passes over each state."""
    slots = slot_idx.long()
    nb, HV, Vd = v.shape
    qf, kf = prepare_qk(q, k, HV, scale, use_qk_l2norm)  # [B, HV, K] fp32
    o = gdn_state_update_native(state, qf, kf, v, g, beta, slot_idx)
    if o is not None:
        return o.to(v.dtype)
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


_CUT = -60.0  # exp below this (< 1e-26) is taken as 0: denormal results make exp and matmul ~15x slower


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay), exactly 0 where log_decay < _CUT (never a denormal)."""
    return log_decay.masked_fill(log_decay < _CUT, float("-inf")).exp_()


def gdn_chunk_scan_cpu(state, q, k, v, g, beta, query_start_loc, slot_idx, has_initial_state,
                       scale=None, use_qk_l2norm=True, chunk_size=64, return_states_at=None):
    """Same contract as `gdn_ref.gdn_chunk_scan_ref`: state [S, HV, K, V] (final states written in
    place); q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; return_states_at None or per request
    positions 1..len. Returns o [T, HV, V] in v.dtype, or (o, states per request [n, HV, K, V]).

    The real chunks of all requests are packed (chunk_layout.py) and their intra-chunk systems
    (the triangular solves for the corrections, q.k scores, decays) built in one batch; the
    chunk-to-chunk recurrence steps over chunk index, batched over the requests that have it.
    States at requested positions come from the state entering their chunk plus its corrections
    up to them (no cut in the scan).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    spans = request_spans(query_start_loc, state.shape[0], slot_idx, has_initial_state)
    check_positions_arg(return_states_at, len(spans))
    wanted = [[int(p) for p in ps] for ps in return_states_at] if return_states_at is not None \
        else [[] for _ in spans]
    for r, (s, e, _, _) in enumerate(spans):
        state_cuts(e - s, wanted[r], r)  # positions outside 1..len are refused before any write
    T, HV, Vd = v.shape
    qf, kf = prepare_qk(q, k, HV, scale, use_qk_l2norm)  # [T, HV, K] fp32; refuses bad heads first
    Kd = kf.shape[-1]
    lay = ChunkLayout(spans, chunk_size, v.device)
    h = state.index_select(0, lay.slots).float()  # [R, HV, K, V]
    h = torch.where(lay.init.view(-1, 1, 1, 1), h, torch.zeros((), device=v.device))
    o = torch.zeros((T, HV, Vd), dtype=torch.float32, device=v.device)
    at = {}
    if lay.num_chunks:
        nc, cs = lay.num_chunks, chunk_size
        qc, kc, vc = (lay.pad_heads(t) for t in (qf, kf, v.float()))  # [c, HV, l, .]
        gc, bc = (lay.pad_heads(t.float()[..., None])[..., 0] for t in (g, beta))  # [c, HV, l]
        G = gc.cumsum(-1)
        seg = G[..., :, None] - G[..., None, :]
        pair = seg.masked_fill_(lay.upper | (seg < _CUT), float("-inf")).exp_()  # e^(G_l - G_s), s <= l
        eye = torch.eye(cs, dtype=torch.bool, device=v.device)
        kk = kc @ kc.transpose(-1, -2)
        system = (kk.mul_(pair).masked_fill_(eye, 0.0).mul_(bc[..., None])).add_(eye)
        eG = _decay(G)
        rhs_v = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False, unitriangular=True)
        rhs_k = torch.linalg.solve_triangular(system, (bc * eG)[..., None] * kc, upper=False,
                                              unitriangular=True)
        attn = (qc @ kc.transpose(-1, -2)).mul_(pair)  # [c, HV, l, s]
        q_dec = qc * eG[..., None]
        k_end = kc * _decay(G[..., -1:] - G)[..., None]
        last = eG[..., -1]  # [c, HV]
        out = torch.empty_like(vc)
        keep = {lay.position(r, p)[0] for r, ps in enumerate(wanted) for p in ps}
        starts, us = {}, {}
        for step, cur in enumerate(lay._steps):
            reqs = lay.step_requests[step]
            S = h if reqs is None else h.index_select(0, reqs)
            u = rhs_v[cur] - rhs_k[cur] @ S  # [n, HV, l, V]
            out[cur] = q_dec[cur] @ S + attn[cur] @ u
            for i, c in enumerate(cur.tolist() if keep else ()):
                if c in keep:
                    starts[c], us[c] = S[i].clone(), u[i]
            S = S * last[cur][..., None, None] + k_end[cur].transpose(-1, -2) @ u
            if reqs is None:
                h = S
            else:
                h.index_copy_(0, reqs, S)
        o.index_copy_(0, lay.rows, out[lay.token_chunk, :, lay.token_pos])
        for c in keep:
            at[c] = (starts[c], us[c], G[c], kc[c])
    states = None
    if return_states_at is not None:
        states = []
        for r, ps in enumerate(wanted):
            got = []
            for p in ps:
                c, j = lay.position(r, p)
                S0, u, Gc, kcc = at[c]
                w = _decay(Gc[:, j:j + 1] - Gc[:, :j + 1])  # [HV, j+1]
                got.append(S0 * _decay(Gc[:, j])[:, None, None]
                           + (kcc[:, :j + 1] * w[..., None]).transpose(-1, -2) @ u[:, :j + 1])
            states.append(torch.stack(got).to(state.dtype) if got else state.new_zeros(0, HV, Kd, Vd))
    write = [r for r, (s, e, _, i) in enumerate(spans) if e > s or not i]
    if write:
        w = torch.tensor(write, device=v.device)
        state.index_copy_(0, lay.slots[w], h[w].to(state.dtype))
    out = o.to(v.dtype)
    return out if return_states_at is None else (out, states)
