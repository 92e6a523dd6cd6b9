"""Torch reference for the gated delta rule (GDN, Qwen3-Next / Qwen3.5 linear attention) over slots.

Per value head with state S [K, V], log-decay g, write strength beta (already sigmoided):
    S <- exp(g) S ;  S <- S + k (beta (v - S^T k))^T ;  o = S^T q
q and k are L2-normalised (eps 1e-6 inside the rsqrt, as transformers/FLA) when use_qk_l2norm,
q is scaled by `scale` (default K**-0.5), and the H q/k heads serve HV // H consecutive value heads.
All arithmetic in fp32; the pool keeps its own dtype.
"""
from __future__ import annotations

import torch

from .varlen import check_positions_arg, request_spans, scan_requests


def prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm):
    """q, k [..., H, K] -> fp32 [..., HV, K], normalised and (q only) scaled."""
    H, K = q.shape[-2:]
    if num_v_heads % H:
        raise ValueError(f"{num_v_heads} value heads cannot share {H} q/k heads; the value head "
                         "count must be a multiple of the q/k head count")
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (K ** -0.5 if scale is None else scale)
    rep = num_v_heads // H
    return q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)


def gdn_state_update_ref(state, q, k, v, g, beta, slot_idx, scale=None, use_qk_l2norm=True):
    """One decode token per request.

    state [S, HV, K, V] pool (updated in place); q, k [B, H, K]; v [B, HV, V]; g [B, HV] log-decay
    (-exp(A_log) * softplus(a + dt_bias), as Qwen3-Next computes it); beta [B, HV] in (0, 1);
    slot_idx [B]; scale default K**-0.5. Returns o [B, HV, V] in v.dtype.
    """
    slots = slot_idx.long()
    HV = v.shape[1]
    qf, kf = prepare_qk(q, k, HV, scale, use_qk_l2norm)  # [B, HV, K]
    S = state[slots].float() * torch.exp(g.float())[..., None, None]
    delta = (v.float() - torch.einsum("bhkv,bhk->bhv", S, kf)) * beta.float()[..., None]
    S = S + kf[..., :, None] * delta[..., None, :]
    state[slots] = S.to(state.dtype)
    return torch.einsum("bhkv,bhk->bhv", S, qf).to(v.dtype)


def _chunked(S, q, k, v, g, beta, chunk_size):
    """Chunked gated delta rule of one piece, heads first. S [HV, K, V]; q, k [HV, L, K];
    v [HV, L, V]; g, beta [HV, L]. Returns (o [HV, L, V], final S); all fp32.

    Inside a chunk with cumulative log-decay G_i and start state S0, the corrections
    u_i = beta_i (v_i - S'_i^T k_i) solve (I + A) u = beta v - beta e^G K S0 with
    A_ij = beta_i e^(G_i - G_j) k_i.k_j for j < i; then o_i = e^G_i S0^T q_i + sum_{j<=i}
    e^(G_i - G_j) (q_i.k_j) u_j and S_end = e^G_last S0 + sum_j e^(G_last - G_j) k_j u_j^T.
    """
    HV, L, Kd = k.shape
    pad = (-L) % chunk_size
    # zero k, v, beta and g in the padding: u = 0 there and exp(0) = 1, so nothing changes
    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    nc = (L + pad) // chunk_size
    q, k, v = (t.view(HV, nc, chunk_size, -1) for t in (q, k, v))
    G = g.view(HV, nc, chunk_size).cumsum(-1)
    beta = beta.view(HV, nc, chunk_size)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device).tril()
    pair = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")))
    strict = pair.masked_fill(torch.eye(chunk_size, dtype=torch.bool, device=k.device), 0.0)
    system = torch.eye(chunk_size, device=k.device) + beta[..., None] * (k @ k.transpose(-1, -2)) * strict
    rhs_v = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    rhs_k = torch.linalg.solve_triangular(system, (beta * torch.exp(G))[..., None] * k,
                                          upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * pair  # [HV, nc, l, s]
    q_dec = q * torch.exp(G)[..., None]
    k_end = k * torch.exp(G[..., -1:] - G)[..., None]
    out = torch.empty_like(v)
    for c in range(nc):
        u = rhs_v[:, c] - rhs_k[:, c] @ S  # [HV, l, V]
        out[:, c] = q_dec[:, c] @ S + attn[:, c] @ u
        S = torch.exp(G[:, c, -1])[:, None, None] * S + k_end[:, c].transpose(-1, -2) @ u
    return out.reshape(HV, nc * chunk_size, -1)[:, :L], S


def gdn_chunk_scan_ref(state, q, k, v, g, beta, query_start_loc, slot_idx, has_initial_state,
                       scale=None, use_qk_l2norm=True, chunk_size=64, return_states_at=None):
    """Varlen chunked gated delta rule from each slot's state, leaving the final state in the slot.

    state [S, HV, K, V]; q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; query_start_loc [R+1];
    slot_idx [R]; has_initial_state [R] bool; chunk_size > 0. return_states_at: None, or per
    request positions 1..len. Returns o [T, HV, V] in v.dtype, or (o, states): per request
    [n_pos, HV, K, V] in state.dtype.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    spans = request_spans(query_start_loc, state.shape[0], slot_idx, has_initial_state)
    check_positions_arg(return_states_at, len(spans))
    HV = v.shape[1]
    qf, kf = (t.transpose(0, 1) for t in prepare_qk(q, k, HV, scale, use_qk_l2norm))
    vf, gf, bf = v.float().transpose(0, 1), g.float().t(), beta.float().t()
    o = torch.empty(HV, v.shape[0], v.shape[2], dtype=torch.float32, device=v.device)

    def piece(S, a, b):
        o[:, a:b], S = _chunked(S, qf[:, a:b], kf[:, a:b], vf[:, a:b], gf[:, a:b], bf[:, a:b],
                                chunk_size)
        return S

    states = scan_requests(state, spans, return_states_at, piece)
    out = o.transpose(0, 1).to(v.dtype)
    return out if return_states_at is None else (out, states)
