"""Fast torch paths for Mamba2 on CPU, the varlen chunked scan and the one-token decode step:
same contracts as `mamba2_ref.mamba2_chunk_scan_ref` / `mamba2_state_update_ref` (the spec).

The reference runs each request's chunks in its own small einsums. Here all requests of a call
are padded to whole chunks (zero dt in the padding: no decay, no input, so states are unchanged)
and every chunk of every request goes through one set of einsums; only the chunk-to-chunk state
recurrence loops, over the longest request's chunk count, batched over requests. B and C stay
per group (the reference expands them to heads), so C.B is computed once per group.
The decode step updates the slots' states where they live (see slot_rows.py).
Checked against the reference in tests/kernels/test_mamba2_cpu.py.
"""
from __future__ import annotations

import torch

from .mamba2_ref import _discretize_dt, _gate, mamba2_chunk_scan_ref
from .slot_rows import update_slot_rows
from .varlen import check_positions_arg, request_spans


def mamba2_chunk_scan_cpu(ssm_state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slot_idx,
                          has_initial_state, chunk_size=256, dt_softplus=True,
                          return_states_at=None, dt_limit=None):
    """Inputs and outputs as `mamba2_chunk_scan_ref`: ssm_state [S, H, P, N] (final states written
    in place); x [T, H, P]; dt [T, H]; A [H]; B, C [T, G, N]; returns y [T, H, P] in x.dtype.

    Calls asking for intermediate states (`return_states_at`) go to the reference.
    """
    if return_states_at is not None:
        return mamba2_chunk_scan_ref(ssm_state, x, dt, A, B, C, D, z, dt_bias, query_start_loc,
                                     slot_idx, has_initial_state, chunk_size, dt_softplus,
                                     return_states_at, dt_limit=dt_limit)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    spans = request_spans(query_start_loc, ssm_state.shape[0], slot_idx, has_initial_state)
    check_positions_arg(return_states_at, len(spans))
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if H % G:
        raise ValueError(f"{H} heads cannot be split into {G} B/C groups; heads must be a multiple of groups")
    if not spans:
        return torch.empty_like(x)
    R, cs, hpg = len(spans), chunk_size, H // G
    nc = max(max(-(-(e - s) // cs) for s, e, _, _ in spans), 1)
    # token row of each padded position; row T is an appended zero row
    idx = torch.full((R, nc * cs), T, dtype=torch.long)
    for r, (s, e, _, _) in enumerate(spans):
        idx[r, :e - s] = torch.arange(s, e)
    idx = idx.to(x.device)

    def padded(t):
        t = torch.cat([t.float(), t.new_zeros((1, *t.shape[1:]), dtype=torch.float32)])
        return t[idx].view(R * nc, cs, *t.shape[1:])  # [c, l, ...], c = request-major chunks

    dtf = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    xdt = padded(x.float() * dtf[..., None])  # [c, l, H, P]
    dtp, Bp, Cp = padded(dtf), padded(B), padded(C)  # [c, l, H], [c, l, G, N]
    acum = (dtp * A.float()).cumsum(1)  # [c, l, H] log-decay from chunk start to l (inclusive)
    causal = torch.ones(cs, cs, dtype=torch.bool, device=x.device).tril()
    seg = acum[:, :, None, :] - acum[:, None, :, :]  # [c, l, s, H]
    decay = torch.exp(seg.masked_fill(~causal[None, :, :, None], float("-inf")))
    cb = torch.einsum("clgn,csgn->clsg", Cp, Bp).repeat_interleave(hpg, dim=-1)  # [c, l, s, H]
    y = torch.einsum("clsh,cshp->clhp", cb * decay, xdt)
    to_end = torch.exp(acum[:, -1:, :] - acum)  # [c, l, H]
    xg = (xdt * to_end[..., None]).view(R * nc, cs, G, hpg, P)
    chunk_states = torch.einsum("clgn,clgkp->cgkpn", Bp, xg).reshape(R, nc, H, P, N)
    chunk_decay = torch.exp(acum[:, -1, :]).view(R, nc, H, 1, 1)
    init = torch.tensor([i for _, _, _, i in spans], device=x.device)
    slots = torch.tensor([s for _, _, s, _ in spans], device=x.device)
    h = ssm_state[slots].float()
    h = torch.where(init.view(R, 1, 1, 1), h, torch.zeros_like(h))  # old slot contents ignored
    starts = []
    for k in range(nc):
        starts.append(h)
        h = chunk_decay[:, k] * h + chunk_states[:, k]
    starts = torch.stack(starts, 1).view(R * nc, G, hpg, P, N)  # state entering each chunk
    y_in = torch.einsum("clgn,cgkpn->clgkp", Cp, starts).reshape(R * nc, cs, H, P)
    y = (y + y_in * torch.exp(acum)[..., None]).reshape(R, nc * cs, H, P)
    out = torch.empty((T, H, P), dtype=torch.float32, device=x.device)
    keep = idx < T
    out[idx[keep]] = y[keep]
    write = [r for r, (s, e, _, i) in enumerate(spans) if e > s or not i]
    if write:
        w = torch.tensor(write, device=x.device)
        ssm_state[slots[w]] = h[w].to(ssm_state.dtype)
    return _gate(out, x, D, z).to(x.dtype)


def mamba2_state_update_cpu(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus=True,
                            dt_limit=None):
    """Same contract as `mamba2_ref.mamba2_state_update_ref`, updating the slots where they live.

    Over each run of consecutive slots (see slot_rows.py) the state rows are a view of the pool:
    decayed in place, the outer product x B^T added by one broadcast multiply-add, and read out
    with the D skip by one `baddbmm` per run (C as a row times h^T: torch's one-column matmul is
    ~9x slower than this row form on CPU): three passes over the state, no copy. Heads of one
    group share B and C rows (broadcast, never repeated).
    """
    slots = slot_idx.long()
    nb, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    hpg = H // G
    dt = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # [nb, H] fp32
    dA = torch.exp(dt * A.float())
    xf = x.float()
    xdt = xf * dt[..., None]  # [nb, H, P]
    skip = xf * D.float()[:, None] if D is not None else torch.zeros_like(xf)

    def update(h, dA, xdt, Bf, Cf, skip):
        n = h.shape[0]
        h.mul_(dA[..., None, None])
        h.view(n, G, hpg, P, N).addcmul_(xdt.view(n, G, hpg, P, 1), Bf.reshape(n, G, 1, 1, N))
        return torch.baddbmm(skip.reshape(n * G, 1, hpg * P), Cf.reshape(n * G, 1, N),
                             h.view(n * G, hpg * P, N).transpose(1, 2)).view(n, H, P)

    y = update_slot_rows(ssm_state, slots, (dA, xdt, B.float(), C.float(), skip), update)
    return _gate(y, x, None, z).to(x.dtype)
