"""Inkling's attention: q/k RMS-normed per head, keys and values through short convs, no rope;
position enters as a relative bias that each query mixes from a learned bank of profiles.

As transformers' InklingAttention (its eager path; its SDPA path drops the bias):
- k = k_norm(k_sconv(k_proj(x))), v = v_sconv(v_proj(x)) (causal depthwise convs in float32 plus
  the input, `InklingShortConv`), q = q_norm(q_proj(x)); scores are q.k / head_dim;
- bias(query i, key j) = r_i . proj[:, i - j] for 0 <= i - j < rel_extent, else 0, where
  r = r_proj(x) per head (`d_rel` values) and proj [d_rel, rel_extent] (sliding layers: extent =
  window);
- full layers with `log_scaling_n_floor`: q and the bias times 1 + alpha log(max(1, (pos + 1) / floor)).
The KV pages hold the normed keys and the convolved values; the convs' windows are state slots
(models/inkling.py). The attention itself is torch here (`relative_attention`): the paged kernels
know no per-distance bias. Decode steps read every request's window (sliding) or table at once
with no host sync; prefill chunks loop over requests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import AttentionSpec

from .forward_batch import ForwardBatch
from .norms import RMSNorm
from .token_shift import lagged_inputs


class InklingShortConv(nn.Module):
    """x [T, C] -> (x + causal depthwise conv of x) / divisor (kernel K, no bias), in float32, cast
    back (Inkling 2 divides by sqrt(K + 1)). Its window (the last K - 1 inputs, float32) is
    `window [S, C, K - 1]`, a view of the layer's pool."""

    def __init__(self, channels: int, kernel_size: int, divisor: float = 1.0):
        super().__init__()
        self.channels, self.kernel_size, self.divisor = channels, kernel_size, divisor
        self.conv1d = nn.Conv1d(channels, channels, kernel_size, groups=channels, padding=kernel_size - 1, bias=False)

    def forward(self, x: torch.Tensor, window: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        xf = x.float()
        taps = lagged_inputs(xf, window, batch)  # [T, C, K]
        y = F.conv1d(taps, self.conv1d.weight.float(), groups=self.channels)[:, :, 0] + xf
        return (y if self.divisor == 1.0 else y / self.divisor).to(x.dtype)


class RelativeLogits(nn.Module):
    """`rel_logits_proj`: the bank of bias-versus-distance profiles, proj [d_rel, rel_extent]."""

    def __init__(self, d_rel: int, rel_extent: int):
        super().__init__()
        self.rel_extent = rel_extent
        self.proj = nn.Parameter(torch.empty(d_rel, rel_extent))


def relative_attention(q, rel, kv_cache, batch: ForwardBatch, block_table, window, scale, tau, sinks=None):
    """q [T, Hq, D]; rel [T, Hq, E] (each query's bias per backward distance 0..E-1); kv_cache
    [blocks, 2, bs, Hkv, D] (this step's K/V already written); tau [T] float32 or None (log
    scaling of the bias); sinks [T, Hq] or None (a logit per query and head that joins the
    softmax with no value, Inkling 2). Returns [T, Hq, D]: softmax(q.k * scale + bias) v over
    each request's keys (causal; within `window` when set)."""
    bs = kv_cache.shape[2]
    qlens = batch.query_lens_cpu or (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    if qlens and max(qlens) == 1 and min(qlens) == 1:  # every request decodes one token: all at once
        L = window or block_table.shape[1] * bs
        q_pos = batch.seq_lens.long() - 1
        key_pos = q_pos[:, None] - (L - 1) + torch.arange(L, device=q.device)
        return _attend(q, rel, q_pos, key_pos, block_table, kv_cache, bs, window, scale, tau, sinks)
    out = torch.zeros_like(q)
    qsl = batch.query_start_loc.tolist()
    for r, n in enumerate(qlens):
        if n == 0:
            continue
        rows = slice(qsl[r], qsl[r + 1])
        q_pos = batch.positions[rows]
        first, last = int(q_pos[0]), int(q_pos[-1])
        lo = max(0, first - window + 1) if window else 0
        key_pos = torch.arange(lo, last + 1, device=q.device)[None].expand(n, -1)
        out[rows] = _attend(q[rows], rel[rows], q_pos, key_pos, block_table[r:r + 1].expand(n, -1), kv_cache, bs,
                            window, scale, None if tau is None else tau[rows], None if sinks is None else sinks[rows])
    return out


def _attend(q, rel, q_pos, key_pos, tables, kv_cache, bs, window, scale, tau, sinks=None):
    """N query rows: q [N, Hq, D], rel [N, Hq, E], q_pos [N], key_pos [N, L] (may be < 0: masked),
    tables [N, W] each row's block table, sinks [N, Hq] or None -> [N, Hq, D]."""
    N, Hq, _ = q.shape
    E = rel.shape[-1]
    dist = q_pos[:, None] - key_pos
    valid = (key_pos >= 0) & (dist >= 0)
    if window:
        valid &= dist < window
    kp = key_pos.clamp(min=0)
    blocks, offsets = tables.long().gather(1, kp // bs), kp % bs
    k, v = kv_cache[blocks, 0, offsets], kv_cache[blocks, 1, offsets]  # [N, L, Hkv, D]
    group = Hq // k.shape[2]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("nhd,nlhd->nhl", q, k) * scale
    bias = rel.gather(-1, dist.clamp(0, E - 1)[:, None, :].expand(N, Hq, -1))
    bias = bias.masked_fill(((dist < 0) | (dist >= E))[:, None, :], 0.0)
    if tau is not None:
        bias = (bias.float() * tau[:, None, None]).to(bias.dtype)
    scores = (scores + bias).masked_fill(~valid[:, None, :], float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:  # one more logit per row, with no value: it only takes probability mass
        weights = torch.softmax(torch.cat([scores, sinks[:, :, None]], dim=-1).float(), dim=-1)[..., :-1].to(q.dtype)
    return torch.einsum("nhl,nlhd->nhd", weights, v)


class InklingAttention(nn.Module):
    """`self_attn` of one layer; full or sliding (its own head counts, `swa_*`, on sliding layers)."""

    def __init__(self, config, sliding: bool):
        super().__init__()
        p = "swa_" if sliding else ""
        self.num_heads = getattr(config, f"{p}num_attention_heads")
        self.num_kv_heads = getattr(config, f"{p}num_key_value_heads")
        self.head_dim = getattr(config, f"{p}head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{p}num_attention_heads={self.num_heads} is not a multiple of "
                             f"{p}num_key_value_heads={self.num_kv_heads}")
        self.sliding_window = config.sliding_window_size if sliding else None
        self.scale = 1.0 / self.head_dim  # q and k are RMS-normed per head
        self.log_floor = None if sliding else config.log_scaling_n_floor
        self.log_alpha = float(config.log_scaling_alpha)
        h, kv = config.hidden_size, self.num_kv_heads * self.head_dim
        self.kv_width = kv
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.r_proj = nn.Linear(h, self.num_heads * config.d_rel, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.k_sconv = InklingShortConv(kv, config.conv_kernel_size)
        self.v_sconv = InklingShortConv(kv, config.conv_kernel_size)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rel_logits_proj = RelativeLogits(config.d_rel, config.sliding_window_size if sliding else config.rel_extent)

    def spec(self, dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(self.num_kv_heads, self.head_dim, dtype, self.sliding_window)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, k_window: torch.Tensor,
                v_window: torch.Tensor) -> torch.Tensor:
        """x [T, H] normed -> [T, H]; k_window / v_window [S, kv width, K - 1] are the convs' windows."""
        T, Hq, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(x).view(T, Hq, D))
        k = self.k_norm(self.k_sconv(self.k_proj(x), k_window, batch).view(T, Hkv, D))
        v = self.v_sconv(self.v_proj(x), v_window, batch).view(T, Hkv, D)
        rel = self.r_proj(x).view(T, Hq, -1) @ self.rel_logits_proj.proj  # [T, Hq, extent]
        tau = None
        if self.log_floor is not None:
            tau = 1.0 + self.log_alpha * torch.log(((batch.positions + 1).float() / self.log_floor).clamp(min=1.0))
            q = (q.float() * tau[:, None, None]).to(q.dtype)
        block_table, slot_mapping, plans = batch.kv_tables(self.sliding_window)
        ops.write_kv(k.contiguous(), v, kv_cache, slot_mapping, plan_cache=plans)
        out = relative_attention(q, rel, kv_cache, batch, block_table, self.sliding_window, self.scale, tau)
        return self.o_proj(out.reshape(T, Hq * D))
