"""Torch reference for lightning attention (MiniMax's linear attention) over state slots.

Per head h with matrix state S [K, V] and a fixed decay rate slope_h > 0 (no gate, no delta):
    S <- exp(-slope_h) S + k v^T ;  o = S^T q
q, k and v arrive already activated (MiniMax applies silu to its qkv projection); q is not
scaled. All arithmetic in fp32; the pool keeps its own dtype.
"""
from __future__ import annotations

import torch

from .varlen import check_positions_arg, request_spans, scan_requests


def check_lightning_shapes(state, q, k, v, slope):
    heads, k_dim, v_dim = state.shape[1:]
    if q.shape[-2:] != (heads, k_dim) or k.shape != q.shape or v.shape[-2:] != (heads, v_dim):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the "
                         f"state pool {tuple(state.shape)}: expected q, k [.., {heads}, {k_dim}] and "
                         f"v [.., {heads}, {v_dim}]")
    if slope.shape != (heads,):
        raise ValueError(f"slope has shape {tuple(slope.shape)}; expected one decay rate per head "
                         f"({heads},)")


def lightning_state_update_ref(state, q, k, v, slope, slot_idx):
    """One decode token per request.

    state [S, H, K, V] pool (updated in place at `slot_idx [B]`); q, k [B, H, K]; v [B, H, V];
    slope [H] decay rates (the state is multiplied by exp(-slope) per token). Returns o [B, H, V]
    in v.dtype.
    """
    check_lightning_shapes(state, q, k, v, slope)
    slots = slot_idx.long()
    S = state[slots].float() * torch.exp(-slope.float())[None, :, None, None]
    S = S + k.float()[..., :, None] * v.float()[..., None, :]
    state[slots] = S.to(state.dtype)
    return torch.einsum("bhkv,bhk->bhv", S, q.float()).to(v.dtype)


def _chunked(S, q, k, v, slope, chunk_size):
    """Chunked lightning attention of one piece, heads first. S [H, K, V]; q, k [H, L, K];
    v [H, L, V]; slope [H]. Returns (o [H, L, V], final S); all fp32.

    Inside a chunk of C tokens with start state S0 and lam = exp(-slope):
    o_i = lam^(i+1) q_i S0 + sum_{j<=i} lam^(i-j) (q_i.k_j) v_j, S_end = lam^C S0 + sum_j
    lam^(C-1-j) k_j v_j^T. The last chunk may be shorter (no padding).
    """
    H, L, _ = k.shape
    out = torch.empty(H, L, v.shape[-1], dtype=torch.float32, device=v.device)
    s = slope[:, None, None]
    idx = torch.arange(chunk_size, device=v.device, dtype=torch.float32)
    diff = idx[:, None] - idx[None, :]
    intra = torch.exp(-s * diff.clamp(min=0)) * (diff >= 0)  # [H, C, C], lam^(i-j) for j <= i
    for a in range(0, L, chunk_size):
        c = min(chunk_size, L - a)
        qc, kc, vc = q[:, a:a + c], k[:, a:a + c], v[:, a:a + c]
        q_dec = qc * torch.exp(-s * (idx[:c] + 1)[:, None])  # lam^(i+1) q_i
        k_dec = kc * torch.exp(-s * (c - 1 - idx[:c])[:, None])  # lam^(c-1-j) k_j
        out[:, a:a + c] = q_dec @ S + ((qc @ kc.transpose(-1, -2)) * intra[:, :c, :c]) @ vc
        S = torch.exp(-slope * c)[:, None, None] * S + k_dec.transpose(-1, -2) @ vc
    return out, S


def lightning_chunk_scan_ref(state, q, k, v, slope, query_start_loc, slot_idx, has_initial_state,
                             chunk_size=64, return_states_at=None):
    """Varlen chunked lightning attention from each slot's state, leaving the final state there.

    state [S, H, K, V]; q, k [T, H, K]; v [T, H, V]; slope [H]; query_start_loc [R+1]; slot_idx [R];
    has_initial_state [R] bool (False: start from zeros); chunk_size > 0. return_states_at: None,
    or per request a list of positions 1..len. Returns o [T, H, V] in v.dtype, or (o, states) with
    per request [n_pos, H, K, V] in state.dtype (the state after that many of its tokens).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    check_lightning_shapes(state, q, k, v, slope)
    spans = request_spans(query_start_loc, state.shape[0], slot_idx, has_initial_state)
    check_positions_arg(return_states_at, len(spans))
    qf, kf, vf = (t.float().transpose(0, 1) for t in (q, k, v))
    sf = slope.float()
    o = torch.empty(v.shape[1], v.shape[0], v.shape[2], dtype=torch.float32, device=v.device)

    def piece(S, a, b):
        o[:, a:b], S = _chunked(S, qf[:, a:b], kf[:, a:b], vf[:, a:b], sf, chunk_size)
        return S

    states = scan_requests(state, spans, return_states_at, piece)
    out = o.transpose(0, 1).to(v.dtype)
    return out if return_states_at is None else (out, states)
