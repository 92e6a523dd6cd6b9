"""Jamba's Mamba1 mixer over state slots: conv window + selective-scan state per request.

Prefill chunks run through the varlen kernels (`causal_conv1d`, `mamba1_scan`), decodes through
the one-token kernels (`conv1d_update`, `mamba1_state_update`); both read and write the pools in
place through the requests' slot indices.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import RecurrentSpec

from .forward_batch import ForwardBatch
from .norms import RMSNorm
from .row_parallel import RowParallel
from .slot_split import SlotSplit, split_decode_prefill


class Mamba1Mixer(RowParallel, nn.Module):
    """Mamba1 block with Jamba's RMSNorms on dt, B and C (weight names follow transformers' Jamba).

    hidden_size: model width; d_inner = expand * hidden_size; d_state: N; d_conv: conv kernel k;
    dt_rank: rank of the dt projection; eps: the dt/B/C norms' epsilon.
    """

    def __init__(self, hidden_size: int, d_state: int, d_conv: int, expand: int, dt_rank: int,
                 eps: float, conv_bias: bool = True, proj_bias: bool = False,
                 activation: str = "silu"):
        super().__init__()
        if activation != "silu":
            raise ValueError(f"Mamba1 mixer activation {activation!r}; only 'silu' is supported")
        self.d_inner = expand * hidden_size
        self.d_state, self.d_conv, self.dt_rank = d_state, d_conv, dt_rank
        self.in_proj = nn.Linear(hidden_size, 2 * self.d_inner, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner,
                                bias=conv_bias, padding=d_conv - 1)
        self.x_proj = nn.Linear(self.d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.d_inner, d_state))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, hidden_size, bias=proj_bias)
        self.dt_layernorm = RMSNorm(dt_rank, eps=eps)
        self.b_layernorm = RMSNorm(d_state, eps=eps)
        self.c_layernorm = RMSNorm(d_state, eps=eps)

    def cache_spec(self, dtype: torch.dtype, state_dtype: torch.dtype | None = None) -> RecurrentSpec:
        """Per slot: conv window `[d_inner, d_conv - 1]`, SSM state `[d_inner, d_state]`."""
        return RecurrentSpec(conv_shape=(self.d_inner, self.d_conv - 1),
                             state_shape=(self.d_inner, self.d_state), dtype=dtype,
                             state_dtype=state_dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                ssm_state: torch.Tensor, split: SlotSplit | None = None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size].

        conv_state [S, d_inner, d_conv-1] and ssm_state [S, d_inner, d_state] are this layer's pool
        tensors, updated in place at `batch.state_slots`. `split` may be shared across layers.
        """
        split = split or split_decode_prefill(batch)
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        weight = self.conv1d.weight.squeeze(1)
        bias = self.conv1d.bias

        xc = split.run(
            x,
            decode=lambda xd, s: ops.conv1d_update(xd, conv_state, weight, bias, s.decode_slots),
            prefill=lambda xp, s: ops.causal_conv1d(xp, conv_state, weight, bias, s.prefill_qsl,
                                                    s.prefill_slots, s.prefill_has_init),
            states=(conv_state,),
        )
        # x_proj is row-parallel too: dt | B | C are summed before their norms (a norm of a part is not a part)
        dt, B, C = torch.split(self.rank_sum(self.x_proj(xc)), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(self.dt_layernorm(dt), self.dt_proj.weight)  # bias goes in as dt_bias
        B, C = self.b_layernorm(B), self.c_layernorm(C)
        A = -torch.exp(self.A_log.float())
        D, dt_bias = self.D.float(), self.dt_proj.bias.float()

        packed = torch.cat([xc, dt, z, B, C], dim=-1)
        sizes = [self.d_inner, self.d_inner, self.d_inner, self.d_state, self.d_state]

        def decode(p, s):
            xs, dts, zs, Bs, Cs = torch.split(p, sizes, dim=-1)
            return ops.mamba1_state_update(ssm_state, xs, dts, A, Bs, Cs, D, zs, dt_bias,
                                           s.decode_slots, dt_softplus=True)

        def prefill(p, s):
            xs, dts, zs, Bs, Cs = torch.split(p, sizes, dim=-1)
            return ops.mamba1_scan(ssm_state, xs, dts, A, Bs, Cs, D, zs, dt_bias, s.prefill_qsl,
                                   s.prefill_slots, s.prefill_has_init, dt_softplus=True)

        y = split.run(packed, decode=decode, prefill=prefill, out_dim=self.d_inner, states=(ssm_state,))
        return self.rank_sum(self.out_proj(y.to(hidden.dtype)))
