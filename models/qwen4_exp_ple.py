"""Qwen4-Exp's per-layer embeddings (PLE): hashed n-gram embeddings of the last `ngram_size` tokens,
gated per hyper-connection stream and passed through a dilated depthwise conv
(transformers' Qwen4ExpTextNGramEmbedding / Qwen4ExpTextPLELayer).

Kept between steps, in one state slot per PLE layer under cache key `num_hidden_layers + i`: the
conv's last `(ple_conv_kernel_size - 1) x ngram_size` inputs `[hc_count x hidden, 9]` as the window
part, and the request's last `ngram_size - 1` token ids as a float32 state `[ngram_size - 1]`
(exact for ids below 2^24; a sequence starts from EOS ids, as transformers' context does). Both are
functions of the prefix, so they follow the recurrent rules (checkpoint at a block edge, copy on a
hit, reset at position 0). An n-gram reaching back over an EOS sees EOS there, as transformers'
segment-aware shift does.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.specs import RecurrentSpec

from .forward_batch import ForwardBatch
from .token_shift import lagged_inputs

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2, _PRIME_1 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd hash multipliers of PLE layer `ple_index` (transformers' _build_layer_multipliers)."""
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + _PRIME_1 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(v: int) -> bool:
    return v == 2 or (v > 2 and v % 2 == 1 and all(v % d for d in range(3, math.isqrt(v) + 1, 2)))


def nth_prime_after(start: int, count: int) -> int:
    p = start
    for _ in range(count):
        p += 1
        while not _is_prime(p):
            p += 1
    return p


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """x [..., G * group] -> each group RMS-normed, times (1 + weight), in float32, cast back."""
    h = x.float().unflatten(-1, (-1, group))
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (h * (1.0 + weight.float())).type_as(x)


class GroupedNorm(nn.Module):
    """Qwen4-Exp's zero-centered RMSNorm over groups of `group` channels (`weight` starts at 0)."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_rms_norm(x, self.weight, self.group, self.eps)


class NGramEmbedding(nn.Module):
    """`ple.ple_embedding`: ids, their two predecessors -> [T, ple_embed_dim]."""

    def __init__(self, c, ple_index: int):
        super().__init__()
        self.ngram_size, self.per_ngram = c.ngram_size, c.heads_per_ngram
        heads = (c.ngram_size - 1) * c.heads_per_ngram
        sizes = [nth_prime_after(c.ngram_vocab_size_base - 1, ple_index * heads + h + 1) for h in range(heads)]
        offsets = [sum(sizes[:h]) for h in range(heads)]
        # plain CPU tensors, not buffers: the model is built on `meta` and cast (models/loader.py)
        self.tables = [torch.tensor(layer_multipliers(c.vocab_size, c.ngram_size, ple_index, c.seed), device="cpu"),
                       torch.tensor(sizes, device="cpu"), torch.tensor(offsets, device="cpu")]
        padded = math.ceil(sum(sizes) / c.make_ngram_vocab_size_divisible_by) * c.make_ngram_vocab_size_divisible_by
        self.ngram_embedding = nn.Embedding(padded, c.ple_embed_dim // heads)

    def forward(self, shifted: list[torch.Tensor]) -> torch.Tensor:
        """shifted[s] [T] long: each token s places back (EOS where that crosses an EOS)."""
        if self.tables[0].device != shifted[0].device:
            self.tables = [t.to(shifted[0].device) for t in self.tables]
        multipliers, sizes, offsets = self.tables
        blocks = []
        for n in range(2, self.ngram_size + 1):
            mixed = shifted[0] * multipliers[0]
            for s in range(1, n):
                mixed = torch.bitwise_xor(mixed, shifted[s] * multipliers[s])
            heads = slice((n - 2) * self.per_ngram, (n - 1) * self.per_ngram)
            blocks.append(torch.remainder(mixed[:, None], sizes[heads][None]) + offsets[heads][None])
        return self.ngram_embedding(torch.cat(blocks, dim=-1)).flatten(-2)


class PleLayer(nn.Module):
    """`ple`: the residual streams [T, hc x H] and the step's ids -> what PLE adds to the streams."""

    def __init__(self, c, ple_index: int):
        super().__init__()
        self.hidden, self.hc = c.hidden_size, c.hc_count
        self.eos = c.eos_token_id[0] if isinstance(c.eos_token_id, list) else c.eos_token_id
        self.context, self.dilation = c.ngram_size - 1, c.ngram_size
        self.window = (c.ple_conv_kernel_size - 1) * c.ngram_size
        width, eps = c.hc_count * c.hidden_size, c.rms_norm_eps
        self.ple_embedding = NGramEmbedding(c, ple_index)
        self.key_proj = nn.Linear(c.ple_embed_dim, width, bias=False)
        self.value_proj = nn.Linear(c.ple_embed_dim, c.hidden_size, bias=False)
        self.norm_key, self.norm_query, self.norm_conv = (GroupedNorm(width, c.hidden_size, eps) for _ in range(3))
        self.conv1d = nn.Conv1d(width, width, c.ple_conv_kernel_size, groups=width, dilation=c.ngram_size, bias=False)

    def cache_spec(self, dtype: torch.dtype) -> RecurrentSpec:
        """The conv window [hc x H, (K - 1) x ngram_size]; the last ngram_size - 1 ids in float32."""
        return RecurrentSpec((self.hc * self.hidden, self.window), (self.context,), dtype, torch.float32)

    def shifted_ids(self, ids: torch.Tensor, history: torch.Tensor, batch: ForwardBatch) -> list[torch.Tensor]:
        """[ids, 1 back, ..., ngram_size - 1 back]; history [S, ngram_size - 1] float32 is the pool."""
        eos = torch.full((1,), float(self.eos), device=ids.device)
        ext = lagged_inputs(ids.float()[:, None], history.unsqueeze(1), batch, eos)[:, 0].long()  # oldest first
        out, crossed = [ids], torch.zeros_like(ids, dtype=torch.bool)
        for s in range(1, self.context + 1):
            prev = ext[:, self.context - s]
            out.append(torch.where(crossed, torch.full_like(prev, self.eos), prev))
            crossed = crossed | (prev == self.eos)
        return out

    def forward(self, streams: torch.Tensor, ids: torch.Tensor, batch: ForwardBatch, window: torch.Tensor,
                history: torch.Tensor) -> torch.Tensor:
        T = streams.shape[0]
        emb = self.ple_embedding(self.shifted_ids(ids, history, batch))
        key = self.norm_key(self.key_proj(emb)).view(T, self.hc, self.hidden)
        value = self.value_proj(emb)
        query = self.norm_query(streams).view(T, self.hc, self.hidden)
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
        taps = lagged_inputs(self.norm_conv(gated), window, batch)[:, :, ::self.dilation]  # [T, C, K]
        conv = (taps * self.conv1d.weight.squeeze(1)).sum(-1)
        return gated + F.silu(conv)
