"""Torch reference for Kimi delta attention (KDA: the gated delta rule with per-channel gates) over
state slots.

Per head with state S [K, V], a log-decay per KEY CHANNEL g [K] (GDN has one per head) and a write
strength beta (already sigmoided):
    S <- diag(exp(g)) S ;  S <- S + k (beta (v - S^T k))^T ;  o = S^T q
q and k are L2-normalised (x / sqrt(|x|^2 + 1e-6), as transformers/FLA) when use_qk_l2norm, and q
is scaled by `scale` (default K**-0.5). All arithmetic in fp32; the pool keeps its own dtype.
"""
from __future__ import annotations

import torch

from .varlen import check_positions_arg, request_spans, scan_requests


def check_kda_shapes(state, q, k, v, g, beta):
    heads, k_dim, v_dim = state.shape[1:]
    if (q.shape[-2:] != (heads, k_dim) or k.shape != q.shape or g.shape != q.shape
            or v.shape[-2:] != (heads, v_dim) or beta.shape != q.shape[:-1]):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g "
                         f"{tuple(g.shape)}, beta {tuple(beta.shape)} do not fit the state pool "
                         f"{tuple(state.shape)}: expected q, k, g [.., {heads}, {k_dim}], v "
                         f"[.., {heads}, {v_dim}], beta [.., {heads}]")


def prepare_qk(q, k, scale, use_qk_l2norm):
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def kda_state_update_ref(state, q, k, v, g, beta, slot_idx, scale=None, use_qk_l2norm=True):
    """One decode token per request.

    state [S, H, K, V] pool (updated in place at `slot_idx [B]`); q, k [B, H, K]; v [B, H, V];
    g [B, H, K] per-channel log-decay (<= 0); beta [B, H] in (0, 1). Returns o [B, H, V] in v.dtype.
    """
    check_kda_shapes(state, q, k, v, g, beta)
    slots = slot_idx.long()
    qf, kf = prepare_qk(q, k, scale, use_qk_l2norm)
    S = state[slots].float() * torch.exp(g.float())[..., None]
    delta = (v.float() - torch.einsum("bhkv,bhk->bhv", S, kf)) * beta.float()[..., None]
    S = S + kf[..., :, None] * delta[..., None, :]
    state[slots] = S.to(state.dtype)
    return torch.einsum("bhkv,bhk->bhv", S, qf).to(v.dtype)


def _chunked(S, q, k, v, g, beta, chunk_size):
    """Chunked KDA of one piece, heads first. S [H, K, V]; q, k, g [H, L, K]; v [H, L, V];
    beta [H, L]. Returns (o [H, L, V], final S); all fp32.

    Inside a chunk with per-channel cumulative log-decay G_i [K] and start state S0, the corrections
    u_i = beta_i (v_i - S'_i^T k_i) solve (I + beta A) u = beta v - beta (e^G * k) S0 with
    A_ij = sum_c k_ic k_jc e^(G_ic - G_jc) for j < i; then o_i = (e^G_i * q_i) S0 + sum_{j<=i}
    (sum_c q_ic k_jc e^(G_ic - G_jc)) u_j and S_end = e^G_last * S0 + sum_j (e^(G_last - G_j) * k_j) u_j^T.
    Every exponent is <= 0, so nothing overflows however strong the decay.
    """
    H, L, _ = k.shape
    out = torch.empty(H, L, v.shape[-1], dtype=torch.float32, device=v.device)
    for a in range(0, L, chunk_size):
        c = min(chunk_size, L - a)
        qc, kc, vc, bc = q[:, a:a + c], k[:, a:a + c], v[:, a:a + c], beta[:, a:a + c]
        G = g[:, a:a + c].cumsum(1)  # [H, c, K]
        lower = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
        diff = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~lower[None, :, :, None], float("-inf"))
        pair = torch.exp(diff)  # [H, i, j, K], zero above the diagonal
        A = torch.einsum("hic,hjc,hijc->hij", kc, kc, pair).tril(-1)
        QK = torch.einsum("hic,hjc,hijc->hij", qc, kc, pair)
        system = torch.eye(c, device=v.device) + bc[..., None] * A
        rhs_v = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False,
                                              unitriangular=True)
        rhs_k = torch.linalg.solve_triangular(system, bc[..., None] * torch.exp(G) * kc,
                                              upper=False, unitriangular=True)
        u = rhs_v - rhs_k @ S
        out[:, a:a + c] = (torch.exp(G) * qc) @ S + QK @ u
        S = torch.exp(G[:, -1])[..., None] * S + (torch.exp(G[:, -1:] - G) * kc).transpose(-1, -2) @ u
    return out, S


def kda_chunk_scan_ref(state, q, k, v, g, beta, query_start_loc, slot_idx, has_initial_state,
                       scale=None, use_qk_l2norm=True, chunk_size=16, return_states_at=None):
    """Varlen chunked KDA from each slot's state, leaving the final state in the slot.

    state [S, H, K, V]; q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; query_start_loc [R+1];
    slot_idx [R]; has_initial_state [R] bool (False: start from zeros); chunk_size > 0 (the pair
    decays take [H, chunk, chunk, K] floats). return_states_at: None, or per request positions
    1..len. Returns o [T, H, V] in v.dtype, or (o, states): per request [n_pos, H, K, V] in
    state.dtype.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    check_kda_shapes(state, q, k, v, g, beta)
    spans = request_spans(query_start_loc, state.shape[0], slot_idx, has_initial_state)
    check_positions_arg(return_states_at, len(spans))
    qf, kf = (t.transpose(0, 1) for t in prepare_qk(q, k, scale, use_qk_l2norm))
    vf, gf, bf = v.float().transpose(0, 1), g.float().transpose(0, 1), beta.float().t()
    o = torch.empty(v.shape[1], v.shape[0], v.shape[2], dtype=torch.float32, device=v.device)

    def piece(S, a, b):
        o[:, a:b], S = _chunked(S, qf[:, a:b], kf[:, a:b], vf[:, a:b], gf[:, a:b], bf[:, a:b],
                                chunk_size)
        return S

    states = scan_requests(state, spans, return_states_at, piece)
    out = o.transpose(0, 1).to(v.dtype)
    return out if return_states_at is None else (out, states)
