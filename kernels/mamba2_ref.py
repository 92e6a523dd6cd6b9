"""Torch reference for the Mamba2 SSD layer over state slots (Bamba, GraniteMoeHybrid, NemotronH...).

Per head h (group g = h // (H // G)), with dt' = clamp(softplus(dt + dt_bias), *dt_limit):
    state <- exp(dt' A_h) * state + dt' x B_g^T ;  y = state C_g + D_h x ;  y <- y * silu(z)
Prefill uses the chunked SSD form (quadratic inside a chunk, recurrent across chunks).
All arithmetic in fp32; the pool keeps its own dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .varlen import check_positions_arg, request_spans, scan_requests


def discretize_dt(dt, dt_bias, dt_softplus, dt_limit):
    """dt [.., H] -> fp32; bias, then softplus, then the clamp (the order of Bamba/Mamba2)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit is not None:
        dt = dt.clamp(min=float(dt_limit[0]), max=float(dt_limit[1]))
    return dt


def _heads(t, num_heads):
    """[..., G, N] -> [..., H, N]: each group serves H // G consecutive heads."""
    groups = t.shape[-2]
    if num_heads % groups:
        raise ValueError(f"{num_heads} heads cannot be split into {groups} B/C groups; "
                         "heads must be a multiple of groups")
    return t.float().repeat_interleave(num_heads // groups, dim=-2)


def gate_output(y, x, D, z):
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y


def mamba2_state_update_ref(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus=True,
                            dt_limit=None):
    """One decode token per request.

    ssm_state [S, H, P, N] pool (updated in place); x [B, H, P]; dt [B, H]; A [H] (negative,
    -exp(A_log)); B, C [B, G, N]; D [H] or None; z [B, H, P] or None; dt_bias [H] or None;
    slot_idx [B]; dt_limit (min, max) or None. Returns y [B, H, P] in x.dtype.
    transformers' own decode step (mamba2_selective_state_update) applies no clamp; pass
    dt_limit only where a non-default limit must hold in decode too.
    """
    slots = slot_idx.long()
    H = x.shape[1]
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # [B, H]
    Bh, Ch = _heads(B, H), _heads(C, H)  # [B, H, N]
    h = ssm_state[slots].float()
    dA = torch.exp(dt * A.float())[..., None, None]
    h = dA * h + (dt[..., None] * x.float())[..., None] * Bh[:, :, None, :]
    ssm_state[slots] = h.to(ssm_state.dtype)
    y = (h * Ch[:, :, None, :]).sum(-1)
    return gate_output(y, x, D, z).to(x.dtype)


def _ssd(h, x, dt, A, B, C, chunk_size):
    """Chunked SSD of one piece. h [H, P, N]; x [L, H, P]; dt [L, H]; A [H]; B, C [L, H, N].

    Returns (y [L, H, P] without the D/z terms, final state [H, P, N]); all fp32.
    """
    L, H, P = x.shape
    pad = (-L) % chunk_size
    # zero dt in the padding: no decay (exp(0) = 1) and no input, so the final state is unchanged
    x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, B, C))
    nc = (L + pad) // chunk_size
    xdt = (x * dt[..., None]).view(nc, chunk_size, H, P)
    a = (dt * A).view(nc, chunk_size, H)
    B, C = B.view(nc, chunk_size, H, -1), C.view(nc, chunk_size, H, -1)
    acum = a.cumsum(1)  # [nc, l, H] log-decay from the chunk start to position l (inclusive)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    seg = acum[:, :, None, :] - acum[:, None, :, :]  # [nc, l, s, H]: decay from s to l
    decay = torch.exp(seg.masked_fill(~causal[None, :, :, None], float("-inf")))
    scores = torch.einsum("clhn,cshn->clsh", C, B) * decay
    y = torch.einsum("clsh,cshp->clhp", scores, xdt)
    # contribution of each chunk's own inputs to the state at its end
    to_end = torch.exp(acum[:, -1:, :] - acum)  # [nc, l, H]
    chunk_states = torch.einsum("clhn,clh,clhp->chpn", B, to_end, xdt)
    chunk_decay = torch.exp(acum[:, -1, :])  # [nc, H]
    starts = []
    for c in range(nc):
        starts.append(h)
        h = chunk_decay[c][:, None, None] * h + chunk_states[c]
    starts = torch.stack(starts)  # [nc, H, P, N]: state entering each chunk
    y = y + torch.einsum("clhn,chpn->clhp", C, starts) * torch.exp(acum)[..., None]
    return y.reshape(nc * chunk_size, H, P)[:L], h


def mamba2_chunk_scan_ref(ssm_state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slot_idx,
                          has_initial_state, chunk_size=256, dt_softplus=True,
                          return_states_at=None, dt_limit=None):
    """Varlen chunked SSD from each slot's state, leaving the final state in the slot.

    ssm_state [S, H, P, N]; x [T, H, P]; dt [T, H]; A [H]; B, C [T, G, N]; D [H] or None;
    z [T, H, P] or None; dt_bias [H] or None; query_start_loc [R+1]; slot_idx [R];
    has_initial_state [R] bool; chunk_size > 0; dt_limit (min, max) or None (Bamba passes
    config.time_step_limit). return_states_at: None, or per request positions 1..len.
    Returns y [T, H, P] in x.dtype, or (y, states): per request [n_pos, H, P, N] in ssm_state.dtype.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    spans = request_spans(query_start_loc, ssm_state.shape[0], slot_idx, has_initial_state)
    check_positions_arg(return_states_at, len(spans))
    H = x.shape[1]
    dtf = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    xf, Af, Bh, Ch = x.float(), A.float(), _heads(B, H), _heads(C, H)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)

    def piece(h, a, b):
        y[a:b], h = _ssd(h, xf[a:b], dtf[a:b], Af, Bh[a:b], Ch[a:b], chunk_size)
        return h

    states = scan_requests(ssm_state, spans, return_states_at, piece)
    out = gate_output(y, x, D, z).to(x.dtype)
    return out if return_states_at is None else (out, states)
