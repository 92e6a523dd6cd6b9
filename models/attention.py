"""Attention over the paged KV pool: projections, optional q/k norm, rotary, output gate."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import AttentionSpec

from .forward_batch import ForwardBatch, QuantizedPages
from .fused_linear import FusedLinear
from .rotary import apply_rotary
from .row_parallel import RowParallel


class PagedAttention(RowParallel, nn.Module):
    """One attention layer whose KV lives in the paged pool `[num_blocks, 2, block_size, Hkv, D]`.

    Parameter names follow HF: q_proj, k_proj, v_proj, o_proj, and q_norm / k_norm when present.
    - GQA: num_heads a multiple of num_kv_heads.
    - qkv_bias / o_bias: biases on q,k,v and on o (Llama's attention_bias sets both).
    - qk_norm: a factory `dim -> nn.Module` applied per head to q and k before rotary (Qwen3).
    - output_gate: q_proj emits [query | gate] per head; output *= sigmoid(gate) (Qwen3-Next).
    - rotary: rope is applied when forward gets (cos, sin); Jamba-style layers pass None.
    - sliding_window / soft_cap / scale go to the kernel (scale defaults to head_dim ** -0.5).
    - sinks: a learned logit per query head in the softmax denominator, `sinks [num_heads]` (GPT-OSS).
    - head_gate: `g_proj` maps the layer input to one gate per head; head h's output *= sigmoid(gate_h) (LFM3).
    - out_size: o_proj's output width, hidden_size by default (Zamba's attention reads [h | emb] of
      width 2H and writes H).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: Optional[Callable[[int], nn.Module]] = None, output_gate: bool = False,
                 sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                 scale: Optional[float] = None, sinks: bool = False, head_gate: bool = False,
                 out_size: Optional[int] = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap
        self.scale = head_dim ** -0.5 if scale is None else scale
        q_out = num_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = nn.Linear(hidden_size, q_out, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, out_size or hidden_size, bias=o_bias)
        self.q_norm = qk_norm(head_dim) if qk_norm else None
        self.k_norm = qk_norm(head_dim) if qk_norm else None
        self.qkv = FusedLinear((self.q_proj, self.k_proj, self.v_proj))  # one matmul per step
        self.o = FusedLinear((self.o_proj,))  # (its CPU layout)
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self.g_proj = nn.Linear(hidden_size, num_heads, bias=False) if head_gate else None

    def spec(self, dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(self.num_kv_heads, self.head_dim, dtype, self.sliding_window)

    def forward(self, hidden: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size], rope (cos, sin) [T, rotary_dim] or None -> [T, hidden_size].

        Writes this step's K/V at the slot mapping of the layer's KV group (its window), then
        attends over each request's seq_lens[r] tokens through that group's block table.
        """
        qkv = F.linear(hidden, *self.qkv.weight_bias())
        block_table, slot_mapping, plans = batch.kv_tables(self.sliding_window)  # this layer's KV group
        q = gate = None
        if self.q_norm is None and not self.output_gate:  # rotary and the KV write in one C loop on CPU
            q = ops.rope_write_kv(qkv, rope, self.num_heads, self.num_kv_heads, self.head_dim,
                                  kv_cache, slot_mapping, plan_cache=plans)
        if q is None:
            q, k, v, gate = self._split_rotate(qkv, rope)
            ops.write_kv(k, v, kv_cache, slot_mapping, plan_cache=plans)
        out = ops.paged_attention(
            q, kv_cache, batch.query_start_loc, batch.seq_lens, block_table,
            self.scale, causal=True, sliding_window=self.sliding_window, soft_cap=self.soft_cap,
            max_query_len=max(batch.query_lens_cpu) if batch.query_lens_cpu else None,
            max_seq_len=max(batch.seq_lens_cpu) if batch.seq_lens_cpu else None,
            plan_cache=plans, sinks=self.sinks)
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(hidden))[..., None]
        out = out.reshape(hidden.shape[0], self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.rank_sum(F.linear(out, *self.o.weight_bias()))

    @property
    def reads_codes(self) -> bool:
        """Whether `forward_codes` stands for this layer's forward (not for a subclass that
        overrides forward)."""
        return type(self).forward is PagedAttention.forward

    def forward_codes(self, hidden: torch.Tensor, rope, batch: ForwardBatch,
                      pages: QuantizedPages) -> Optional[torch.Tensor]:
        """`forward` for a step of one-token decodes over a quantized pool read in place
        (ModelCaches.kv_codes): the new K/V computed as forward writes them, into float pages of
        one token each, then encoded into the pool and attended with its codes, the new token at
        full precision (ops.quantized_decode_attention): what forward computes on the pool
        decoded, the new K/V encoded after. None when that cannot run here (nothing written: the
        caller runs forward on decoded pages)."""
        qkv = F.linear(hidden, *self.qkv.weight_bias())
        _, _, plans = batch.kv_tables(self.sliding_window)
        T, Hq, Hkv, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        own = plans.get(("own_slots", T))
        if own is None:  # the new tokens' slots in their one-token pages, once per step
            own = plans[("own_slots", T)] = torch.arange(T, device=qkv.device)
        fresh = torch.empty(T, 2, 1, Hkv, D, dtype=torch.float32, device=qkv.device)
        q = gate = None
        if self.q_norm is None and not self.output_gate:
            q = ops.rope_write_kv(qkv, rope, Hq, Hkv, D, fresh, own, plan_cache=plans)
        if q is None:
            q, k, v, gate = self._split_rotate(qkv, rope)
            ops.write_kv(k, v, fresh, own, plan_cache=plans)
        out = ops.quantized_decode_attention(q, fresh, pages.pool, pages.layout, pages.slot_mapping,
                                             pages.block_table, batch.seq_lens, self.scale, self.soft_cap,
                                             self.sliding_window, self.sinks, plans)
        if out is None:
            return None
        out = out.to(q.dtype)
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(hidden))[..., None]
        out = out.reshape(T, Hq * D)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.rank_sum(F.linear(out, *self.o.weight_bias()))

    def _split_rotate(self, qkv: torch.Tensor, rope):
        """The torch path: qkv [T, q_out + 2 Hkv D] -> q [T, Hq, D], k, v [T, Hkv, D] (q and k
        normed and rotated), output gate [T, Hq D] or None."""
        T, Hq, Hkv, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.q_norm is None and not self.output_gate and rope is not None:
            # q and k are neighbouring columns of the fused output: rotate them in one pass
            qk = apply_rotary(qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D), *rope)
            return qk[:, :Hq], qk[:, Hq:], qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D), None
        gate = None
        q, k, v = qkv.split(self.qkv.sizes, -1)
        v = v.view(T, Hkv, D)
        if self.output_gate:
            q, gate = q.reshape(T, Hq, 2 * D).chunk(2, dim=-1)
            gate = gate.reshape(T, -1)
        q, k = q.reshape(T, Hq, D), k.reshape(T, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return q, k, v, gate
