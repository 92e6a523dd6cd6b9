"""Fast torch paths for Mamba2 on CPU, the varlen chunked scan and the one-token decode step:
same contracts as `mamba2_ref.mamba2_chunk_scan_ref` / `mamba2_state_update_ref` (the spec).

Prefill: the real chunks of every request of the call are packed together (chunk_layout.py: only
each request's last chunk is padded, with zero dt: no decay, no input) and go through one set of
batched matmuls in layouts that need no permute copies (heads of a group share one C.B and one
B / C operand: broadcast, never repeated); only the chunk-to-chunk recurrence steps over chunk
index. States at requested positions are read from the state entering their chunk plus the
chunk's inputs up to them (no cut in the scan). For fp32 the steps between the matmuls (inputs
to the chunk layout, the masked decays times C.B, the recurrence, the read-out with the D skip) run
in C, one pass each (mamba2_prefill_native.py); the torch code below is the fallback.
The decode step updates the slots' states where they live (see slot_rows.py).
Checked against the reference in tests/kernels/test_mamba2_cpu.py.
"""
from __future__ import annotations

import torch

from . import mamba2_prefill_native as prefill_native
from .chunk_layout import ChunkLayout
from .mamba2_ref import discretize_dt, gate_output
from .mamba2_native import mamba2_state_update_native
from .slot_rows import update_slot_rows
from .varlen import check_positions_arg, request_spans, state_cuts


_CUT = -60.0  # exp below this (< 1e-26) is taken as 0: denormal results make exp and matmul ~15x slower
# The scan's result does not depend on where chunks are cut. Per token, the intra-chunk matmul costs
# O(chunk x head_dim), the state passes O(head_dim x d_state), and each request pads its last chunk:
# chunks of 32 ran the engine's prefill calls (prompts of 32-256 tokens and their tails) 12-22%
# faster than 64, one 2048-token prompt as fast (d_state 64); a checkpoint's chunk_size of 256 made
# the whole layer 1.85-2.5x slower (BENCHMARKS.md, "CPU prefill"). A call of short pieces only
# (the tails after prompt-end checkpoints) takes the power of two >= its longest, at least 16.
CPU_CHUNK, MIN_CHUNK = 32, 16


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay) in a new tensor, exactly 0 where log_decay < _CUT (never a denormal)."""
    return log_decay.masked_fill(log_decay < _CUT, float("-inf")).exp_()


def mamba2_chunk_scan_cpu(ssm_state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slot_idx,
                          has_initial_state, chunk_size=256, dt_softplus=True,
                          return_states_at=None, dt_limit=None):
    """Inputs and outputs as `mamba2_chunk_scan_ref`: ssm_state [S, H, P, N] (final states written
    in place); x [T, H, P]; dt [T, H]; A [H]; B, C [T, G, N]; D [H] or None; z [T, H, P] or None;
    return_states_at: None or per request positions 1..len. Returns y [T, H, P] in x.dtype, or
    (y, states) with states per request [n_pos, H, P, N] in ssm_state.dtype. Chunks are cut at
    most at CPU_CHUNK tokens, fewer for a call of short requests (the same result, see CPU_CHUNK).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    spans = request_spans(query_start_loc, ssm_state.shape[0], slot_idx, has_initial_state)
    check_positions_arg(return_states_at, len(spans))
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if H % G:
        raise ValueError(f"{H} heads cannot be split into {G} B/C groups; heads must be a multiple of groups")
    wanted = [[int(p) for p in ps] for ps in return_states_at] if return_states_at is not None \
        else [[] for _ in spans]
    for r, (s, e, _, _) in enumerate(spans):
        state_cuts(e - s, wanted[r], r)  # positions outside 1..len are refused before any write
    longest = max((e - s for s, e, _, _ in spans), default=1)
    chunk_size = min(chunk_size, CPU_CHUNK, max(MIN_CHUNK, 1 << (longest - 1).bit_length()))
    lay = ChunkLayout.of(spans, chunk_size, x.device)
    if lay.num_chunks == 0:  # no tokens: requests without a state are zeroed, as the reference does
        fresh = lay.slots[~lay.init]
        ssm_state.index_fill_(0, fresh, 0)
        out = torch.zeros_like(x)
        return out if return_states_at is None else (out, [ssm_state.new_zeros(0, H, P, N)] * len(spans))
    nc, cs, hpg = lay.num_chunks, chunk_size, H // G
    dtf = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    fast = prefill_native.usable(x, dtf, A, B, C, D)  # the elementwise steps in C, one pass each
    Bp = lay.pad(B.reshape(T, G * N)).view(nc, cs, G, N)
    Cp = lay.pad(C.reshape(T, G * N)).view(nc, cs, G, N)
    if fast:
        acum, xdt_h, xs = prefill_native.ssd_inputs(x, dtf, A.float(), lay, _CUT)
        xdt = xdt_h.transpose(1, 2)  # [c, l, H, P] view
    else:
        xdt = lay.pad((x.float() * dtf[..., None]).reshape(T, H * P)).view(nc, cs, H, P)
        # acum [c, l, H]: log-decay from the chunk start to l (inclusive)
        acum = (lay.pad(dtf).view(nc, cs, H) * A.float()).cumsum(1)
        xs = xdt * _decay(acum[:, -1:, :] - acum)[..., None]  # each input carried to its chunk's end
    # inside a chunk: y_l = sum_{s<=l} exp(acum_l - acum_s) (C_l . B_s) xdt_s
    cb = torch.matmul(Cp.transpose(1, 2), Bp.permute(0, 2, 3, 1))  # [c, G, l, s]: once per group
    if fast:
        scores = prefill_native.ssd_scores(acum, cb, H, _CUT)
    else:
        acum_h = acum.transpose(1, 2).contiguous()  # [c, H, l]
        seg = acum_h[..., :, None] - acum_h[..., None, :]  # [c, H, l, s]
        decay = seg.masked_fill_(lay.upper | (seg < _CUT), float("-inf")).exp_()  # as _decay, in place
        scores = decay.view(nc, G, hpg, cs, cs).mul_(cb[:, :, None])
    # [c, H, l, P]; the C path's xdt is heads first, so this operand needs no copy
    y = torch.matmul(scores.view(nc, H, cs, cs), xdt.transpose(1, 2))
    # each chunk's own inputs at its end, per group: (xdt e^(end - l))^T B -> [c, H, P, N]
    xs = xs.view(nc, cs, G, hpg * P)
    ends = torch.matmul(xs.permute(0, 2, 3, 1), Bp.transpose(1, 2)).view(nc, H, P, N)
    h0 = ssm_state.index_select(0, lay.slots).float() if any(lay.init_list) else None
    if fast:
        finals = prefill_native.ssd_chain(ends, acum, h0, lay, _CUT)
        starts = ends  # now the state entering each chunk
    else:
        h0 = torch.zeros(len(spans), H, P, N) if h0 is None else \
            torch.where(lay.init.view(-1, 1, 1, 1), h0, torch.zeros((), device=x.device))
        starts, finals = lay.chain(ends, _decay(acum[:, -1, :]), h0)  # state entering each chunk
    # the entering state read with C, decayed to l: [c, G, l, hpg, P], plus the intra-chunk part
    y_in = torch.matmul(Cp.transpose(1, 2), starts.view(nc, G, hpg * P, N).transpose(-1, -2))
    if fast:
        out = prefill_native.ssd_output(y_in, y, acum, x, D, lay, _CUT)
    else:
        y_in = y_in.view(nc, G, cs, hpg, P).mul_(_decay(acum).view(nc, cs, G, hpg, 1).transpose(1, 2))
        y_in.add_(y.view(nc, G, hpg, cs, P).transpose(2, 3))
        y = y_in.permute(0, 2, 1, 3, 4)[lay.token_chunk, lay.token_pos].reshape(-1, H, P)
        if not (lay.identity and T == lay.num_tokens):
            y = torch.zeros((T, H, P), device=x.device).index_copy_(0, lay.rows, y)
        out = gate_output(y, x, D, None)
    states = None
    if return_states_at is not None:
        states = _states_at(lay, wanted, starts, acum, xdt, Bp, hpg, ssm_state.dtype)
    write = [r for r, (s, e, _, i) in enumerate(spans) if e > s or not i]
    if write:
        w = torch.tensor(write, device=x.device)
        ssm_state.index_copy_(0, lay.slots[w], finals[w].to(ssm_state.dtype))
    out = gate_output(out, x, None, z).to(x.dtype)
    return out if return_states_at is None else (out, states)


def _states_at(lay, wanted, starts, acum, xdt, Bp, hpg, dtype):
    """The state after each requested position: the state entering its chunk, decayed to it, plus
    the chunk's inputs up to it. Returns per request [n_pos, H, P, N] in `dtype`."""
    where = [lay.position(r, p) for r, ps in enumerate(wanted) for p in ps]
    _, H, P, N = starts.shape
    if not where:
        return [starts.new_zeros(0, H, P, N, dtype=dtype) for _ in wanted]
    c = torch.tensor([w[0] for w in where], device=starts.device)
    j = torch.tensor([w[1] for w in where], device=starts.device)
    G, cs = Bp.shape[2], lay.chunk
    at = acum[c, j]  # [Q, H]
    seg = (at[:, None, :] - acum[c]).masked_fill_(  # [Q, l, H]: decay from l to the position
        torch.arange(cs, device=c.device)[None, :, None] > j[:, None, None], float("-inf"))
    seg = _decay(seg)
    xs = (xdt[c] * seg[..., None]).reshape(-1, cs, G, hpg * P)
    h = torch.matmul(xs.permute(0, 2, 3, 1), Bp[c].transpose(1, 2)).view(-1, H, P, N)
    h.add_(starts[c] * _decay(at)[..., None, None])
    out, q = [], 0
    for ps in wanted:
        out.append(h[q:q + len(ps)].to(dtype))
        q += len(ps)
    return out


def mamba2_state_update_cpu(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus=True,
                            dt_limit=None):
    """Same contract as `mamba2_ref.mamba2_state_update_ref`, updating the slots where they live.

    Over each run of consecutive slots (see slot_rows.py) the state rows are a view of the pool:
    decayed in place, the outer product x B^T added by one broadcast multiply-add, and read out
    with the D skip by one `baddbmm` per run (C as a row times h^T: torch's one-column matmul is
    ~9x slower than this row form on CPU): three passes over the state, no copy. Heads of one
    group share B and C rows (broadcast, never repeated). The C kernel (mamba2_native.py) runs
    instead where it can: one pass over each state.
    """
    y = mamba2_state_update_native(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx,
                                   dt_softplus, dt_limit)
    if y is not None:
        return y.to(x.dtype)
    slots = slot_idx.long()
    nb, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    hpg = H // G
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # [nb, H] fp32
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
    return gate_output(y, x, None, z).to(x.dtype)
