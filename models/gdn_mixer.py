"""Qwen3-Next's gated delta net (linear attention) over state slots.

Projections are split exactly as transformers' Qwen3NextGatedDeltaNet does: `in_proj_qkvz` is laid
out per key head as [q, k, v-group, z-group], `in_proj_ba` per key head as [b-group, a-group].
Under a quantized state cache a step of one-token decodes on the CPU may update the slots' codes in
place (`forward_codes`, ops.gdn_decode_q; subclasses change only the projections, so theirs too):
Qwen3-Next, Qwen3.5 and Qwen3.5-MoE layers reach it through HybridDecoderLayer.mix_recurrent;
OLMo-Hybrid's own layer calls `forward`, on staged slots.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import RecurrentSpec

from .forward_batch import ForwardBatch, QuantizedState
from .norms import GatedRMSNorm
from .row_parallel import RowParallel
from .slot_split import SlotSplit, split_decode_prefill


class GatedDeltaNetMixer(RowParallel, nn.Module):
    """GDN token mixer. num_k_heads x head_k_dim for q and k, num_v_heads x head_v_dim for v and z;
    num_v_heads must be a multiple of num_k_heads (each key head serves a group of value heads)."""

    beta_scale = 1.0  # OLMo-Hybrid's allow_neg_eigval sets 2: beta in (0, 2)

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel: int, eps: float, activation: str = "silu"):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} must be a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        if activation != "silu":
            raise ValueError(f"GDN conv activation {activation!r}; only 'silu' is supported")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_kernel = conv_kernel
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                bias=False, padding=conv_kernel - 1)
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps=eps, norm_before_gate=True)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def cache_spec(self, dtype: torch.dtype, state_dtype: torch.dtype | None = None) -> RecurrentSpec:
        """Per slot: conv window `[2*key_dim + value_dim, k-1]`, state `[v_heads, k_dim, v_dim]`."""
        return RecurrentSpec(conv_shape=(self.conv_dim, self.conv_kernel - 1),
                             state_shape=(self.num_v_heads, self.head_k_dim, self.head_v_dim),
                             dtype=dtype, state_dtype=state_dtype)

    def _split_projections(self, hidden: torch.Tensor):
        """hidden [T, H] -> mixed_qkv [T, conv_dim], z [T, HV, dv], b [T, HV], a [T, HV]."""
        T = hidden.shape[0]
        r = self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(hidden).view(T, self.num_k_heads, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(hidden).view(T, self.num_k_heads, 2 * r), [r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return (mixed, z.reshape(T, self.num_v_heads, dv), b.reshape(T, self.num_v_heads),
                a.reshape(T, self.num_v_heads))

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                ssm_state: torch.Tensor, split: SlotSplit | None = None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size].

        conv_state [S, conv_dim, k-1] and ssm_state [S, HV, dk, dv] are this layer's pool tensors,
        updated in place at `batch.state_slots`. `split` may be shared across layers.
        """
        split = split or split_decode_prefill(batch)
        mixed, z, b, a = self._split_projections(hidden)
        weight = self.conv1d.weight.squeeze(1)
        mixed = split.run(
            mixed,
            decode=lambda xd, s: ops.conv1d_update(xd, conv_state, weight, None, s.decode_slots),
            prefill=lambda xp, s: ops.causal_conv1d(xp, conv_state, weight, None, s.prefill_qsl,
                                                    s.prefill_slots, s.prefill_has_init),
            states=(conv_state,),
        )
        g, beta = self._gates(a, b)

        # One packed row per token so the split gathers every per-token input at once.
        packed = torch.cat([mixed.float(), g, beta.float()], dim=-1)
        sizes = [self.key_dim, self.key_dim, self.value_dim, self.num_v_heads, self.num_v_heads]

        def unpack(p):
            q, k, v, gs, bs = torch.split(p, sizes, dim=-1)
            n = p.shape[0]
            return (q.reshape(n, self.num_k_heads, self.head_k_dim),
                    k.reshape(n, self.num_k_heads, self.head_k_dim),
                    v.reshape(n, self.num_v_heads, self.head_v_dim), gs, bs)

        def decode(p, s):
            q, k, v, gs, bs = unpack(p)
            return ops.gdn_state_update(ssm_state, q, k, v, gs, bs, s.decode_slots, use_qk_l2norm=True)

        def prefill(p, s):
            q, k, v, gs, bs = unpack(p)
            return ops.gdn_chunk_scan(ssm_state, q, k, v, gs, bs, s.prefill_qsl, s.prefill_slots,
                                      s.prefill_has_init, use_qk_l2norm=True)

        core = split.run(packed, decode=decode, prefill=prefill, states=(ssm_state,))  # [T, HV, dv]
        return self.rank_sum(self._out_proj(core, z, hidden))

    @property
    def reads_codes(self) -> bool:
        """Whether forward_codes stands for this mixer's forward (not a subclass's own)."""
        return type(self).forward is GatedDeltaNetMixer.forward

    def forward_codes(self, hidden: torch.Tensor, batch: ForwardBatch, codes: QuantizedState) -> Optional[torch.Tensor]:
        """`forward` for a step of one-token decodes over quantized pools updated in place
        (ModelCaches.state_codes; ops.gdn_decode_q): what forward computes on the slots decoded, the
        slots encoded after. None when it cannot run here (nothing written: the caller runs forward
        on decoded slots)."""
        mixed, z, b, a = self._split_projections(hidden)
        g, beta = self._gates(a, b)
        core = ops.gdn_decode_q(
            mixed, g, beta.float(), codes.slots, conv_pool=codes.conv, conv_layout=codes.conv_layout,
            state_pool=codes.state, state_layout=codes.state_layout, conv_weight=self.conv1d.weight,
            num_k_heads=self.num_k_heads, head_k_dim=self.head_k_dim, num_v_heads=self.num_v_heads,
            head_v_dim=self.head_v_dim)
        return None if core is None else self.rank_sum(self._out_proj(core, z, hidden))

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """a, b [T, HV] -> (g log-decay fp32, beta) [T, HV]."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), b.sigmoid() * self.beta_scale

    def _out_proj(self, core: torch.Tensor, z: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """core [T, HV, dv] -> gated norm by z [T, HV, dv], out_proj -> [T, hidden_size] (this rank's part)."""
        core = self.norm(core.to(hidden.dtype).reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(hidden.shape[0], self.value_dim))
