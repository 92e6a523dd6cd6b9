"""Zamba (v1)'s multi-head Mamba1 mixer over state slots.

Like Mamba1, but the d_inner channels are cut into `n_mamba_heads` heads, each with its own
x_proj (-> dt, B, C) and dt_proj, so each head scans with its own B and C. in_proj's output
interleaves x and the gate channel by channel (transformers views it as [d_inner, 2]).
Per request: the conv window `[d_inner, d_conv - 1]` and the SSM state `[heads, head_dim, d_state]`;
each head runs the Mamba1 kernels on its slice of the state pool.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import RecurrentSpec

from .forward_batch import ForwardBatch
from .slot_split import SlotSplit, split_decode_prefill


class ZambaMambaMixer(nn.Module):
    """hidden_size: model width; d_inner = expand x hidden_size, cut into `num_heads` heads;
    d_state: N; d_conv: conv taps; dt_rank: rank of each head's dt projection.
    Parameter names follow transformers' ZambaMambaMixer."""

    def __init__(self, hidden_size: int, expand: int, num_heads: int, d_state: int, d_conv: int,
                 dt_rank: int, conv_bias: bool = True, proj_bias: bool = False):
        super().__init__()
        d_inner = expand * hidden_size
        if d_inner % num_heads:
            raise ValueError(f"mamba_expand x hidden_size = {d_inner} is not a multiple of "
                             f"n_mamba_heads={num_heads}")
        self.d_inner, self.num_heads, self.head_dim = d_inner, num_heads, d_inner // num_heads
        self.d_state, self.d_conv, self.dt_rank = d_state, d_conv, dt_rank
        hd = self.head_dim
        self.in_proj = nn.Linear(hidden_size, 2 * d_inner, bias=proj_bias)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, bias=conv_bias,
                                padding=d_conv - 1)
        self.x_proj_weight = nn.Parameter(torch.empty(num_heads, dt_rank + 2 * d_state, hd))
        self.dt_proj_weight = nn.Parameter(torch.empty(num_heads, hd, dt_rank))
        self.dt_proj_bias = nn.Parameter(torch.empty(num_heads, hd))
        self.A_log = nn.Parameter(torch.empty(num_heads, hd, d_state))
        self.D = nn.Parameter(torch.empty(num_heads, hd))
        self.out_proj = nn.Linear(d_inner, hidden_size, bias=proj_bias)

    def cache_spec(self, dtype: torch.dtype) -> RecurrentSpec:
        """Per slot: conv window `[d_inner, d_conv - 1]`, SSM state `[heads, head_dim, d_state]`."""
        return RecurrentSpec(conv_shape=(self.d_inner, self.d_conv - 1),
                             state_shape=(self.num_heads, self.head_dim, self.d_state), dtype=dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                ssm_state: torch.Tensor, split: SlotSplit | None = None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size].

        conv_state [S, d_inner, d_conv-1] and ssm_state [S, heads, head_dim, d_state] are this
        layer's pools, updated in place at `batch.state_slots`.
        """
        split = split or split_decode_prefill(batch)
        T, H, hd, N, R = hidden.shape[0], self.num_heads, self.head_dim, self.d_state, self.dt_rank
        x, z = self.in_proj(hidden).view(T, self.d_inner, 2).unbind(-1)  # interleaved x | gate
        weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias
        x = split.run(
            x.contiguous(),
            decode=lambda xd, s: ops.conv1d_update(xd, conv_state, weight, bias, s.decode_slots),
            prefill=lambda xp, s: ops.causal_conv1d(xp.contiguous(), conv_state, weight, bias,
                                                    s.prefill_qsl, s.prefill_slots, s.prefill_has_init),
            states=(conv_state,),
        )
        xh = x.view(T, H, hd)
        params = torch.einsum("hrd,thd->thr", self.x_proj_weight, xh)  # [T, H, R + 2N]
        dt_low, B, C = params.split([R, N, N], dim=-1)
        dt = torch.einsum("hdr,thr->thd", self.dt_proj_weight, dt_low)  # [T, H, hd]
        A = -torch.exp(self.A_log.float())
        zh = z.reshape(T, H, hd)
        outs = []
        for h in range(H):  # each head scans with its own B, C on its slice of the state pool
            pool = ssm_state[:, h]
            packed = torch.cat([xh[:, h], dt[:, h], zh[:, h], B[:, h], C[:, h]], dim=-1)
            sizes = [hd, hd, hd, N, N]

            def decode(p, s, pool=pool, h=h):
                xs, dts, zs, Bs, Cs = torch.split(p, sizes, dim=-1)
                return ops.mamba1_state_update(pool, xs, dts, A[h], Bs, Cs, self.D[h], zs,
                                               self.dt_proj_bias[h], s.decode_slots, dt_softplus=True)

            def prefill(p, s, pool=pool, h=h):
                xs, dts, zs, Bs, Cs = torch.split(p, sizes, dim=-1)
                return ops.mamba1_scan(pool, xs, dts, A[h], Bs, Cs, self.D[h], zs, self.dt_proj_bias[h],
                                       s.prefill_qsl, s.prefill_slots, s.prefill_has_init, dt_softplus=True)

            outs.append(split.run(packed, decode=decode, prefill=prefill, out_dim=hd, states=(pool,)))
        return self.out_proj(torch.cat(outs, dim=-1).to(hidden.dtype))
