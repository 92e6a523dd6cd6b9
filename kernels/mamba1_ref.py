"""Torch reference for the Mamba1 selective scan over state slots (Jamba / Mamba1 layers).

Recurrence per channel d and state n, with dt' = softplus(dt + dt_bias):
    h <- exp(dt' A) * h + dt' B x ;  y = C.h + D x ;  y <- y * silu(z)
All arithmetic in fp32; the pool keeps its own dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .varlen import check_positions_arg, request_spans, scan_requests


def discretize_dt(dt, dt_bias, dt_softplus):
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt) if dt_softplus else dt


def gate_output(y, x, D, z):
    if D is not None:
        y = y + x.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y


def mamba1_state_update_ref(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus=True):
    """One decode token per request.

    ssm_state [S, d_inner, N] pool (updated in place); x, dt [B, d_inner]; A [d_inner, N] (the
    negative real matrix -exp(A_log)); B, C [B, N]; D [d_inner] or None; z [B, d_inner] or None;
    dt_bias [d_inner] or None; slot_idx [B]. Returns y [B, d_inner] in x.dtype.
    """
    slots = slot_idx.long()
    dt = discretize_dt(dt, dt_bias, dt_softplus)  # [B, d]
    h = ssm_state[slots].float()
    h = torch.exp(dt[..., None] * A.float()) * h + (dt * x.float())[..., None] * B.float()[:, None, :]
    ssm_state[slots] = h.to(ssm_state.dtype)
    y = (h * C.float()[:, None, :]).sum(-1)
    return gate_output(y, x, D, z).to(x.dtype)


def _scan(h, x, dt, A, B, C):
    """Sequential scan of one piece. h [d, N] fp32; x, dt [L, d]; B, C [L, N] -> (y [L, d], h)."""
    dA = torch.exp(dt[..., None] * A)  # [L, d, N]
    dBx = (dt * x)[..., None] * B[:, None, :]
    ys = []
    for t in range(x.shape[0]):
        h = dA[t] * h + dBx[t]
        ys.append(h @ C[t])
    y = torch.stack(ys) if ys else x.new_zeros(0, x.shape[1])
    return y, h


def mamba1_scan_ref(ssm_state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slot_idx,
                    has_initial_state, dt_softplus=True, return_states_at=None):
    """Varlen selective scan from each slot's state, leaving the final state in the slot.

    ssm_state [S, d_inner, N]; x, dt [T, d_inner]; A [d_inner, N]; B, C [T, N]; D [d_inner] or None;
    z [T, d_inner] or None; dt_bias [d_inner] or None; query_start_loc [R+1]; slot_idx [R];
    has_initial_state [R] bool (False: start from zeros).
    return_states_at: None, or per request a list of positions 1..len (token counts from the
    request's start in this call). Returns y [T, d_inner] in x.dtype, or (y, states) with states a
    list per request of [n_pos, d_inner, N] tensors in ssm_state.dtype.
    """
    spans = request_spans(query_start_loc, ssm_state.shape[0], slot_idx, has_initial_state)
    check_positions_arg(return_states_at, len(spans))
    dtf = discretize_dt(dt, dt_bias, dt_softplus)
    Af, xf, Bf, Cf = A.float(), x.float(), B.float(), C.float()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)

    def piece(h, a, b):
        y[a:b], h = _scan(h, xf[a:b], dtf[a:b], Af, Bf[a:b], Cf[a:b])
        return h

    states = scan_requests(ssm_state, spans, return_states_at, piece)
    out = gate_output(y, x, D, z).to(x.dtype)
    return out if return_states_at is None else (out, states)
