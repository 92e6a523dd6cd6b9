"""Turn a step's logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

A seeded sequence draws step t from a generator seeded with (seed, sequence index, t), so its
draws depend on nothing but its own history: not on what else is batched with it, not on
preemption, and not on which engine it runs in after a migration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hybridkv.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def step_seed(seed: int, seq_index: int, step: int) -> int:
    """A well-mixed 63-bit seed for draw `step` of sequence `seq_index` of a seeded request."""
    x = (seed * _MIX + (seq_index + 1) * 0xBF58476D1CE4E5B9 + (step + 1) * 0x94D049BB133111EB)
    x &= (1 << 64) - 1
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & ((1 << 64) - 1)
    return (x ^ (x >> 32)) & _MASK


@dataclass
class SampleRow:
    """What the sampler needs of one sequence: its params, index (of n) and tokens so far."""

    params: SamplingParams
    seq_index: int
    num_generated: int


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask a [V] row to its top-k tokens and then its top-p nucleus (at least one kept)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p  # tokens after the nucleus is full
        drop[0] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    """Samples one token per row of a [R, V] float32 logits tensor."""

    def __init__(self, seed: int = 0):
        self._generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]
                 ) -> tuple[list[int], list[Optional[dict[int, float]]]]:
        """logits [R, V] -> (token ids [R], per row {token: logprob} when logprobs asked)."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            host = logits[sampled].cpu()
            for j, i in enumerate(sampled):
                tokens[i] = self._draw(host[j], rows[i])
        logprobs: list[Optional[dict[int, float]]] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1).cpu()
            for j, i in enumerate(want):
                k = rows[i].params.logprobs
                top = torch.topk(lp[j], k) if k else None
                entry = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist()))
                entry[tokens[i]] = float(lp[j, tokens[i]])
                logprobs[i] = entry
        return tokens, logprobs

    def state(self) -> torch.Tensor:
        """The shared generator's state, to redo a batch's unseeded draws after a failure."""
        return self._generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self._generator.set_state(state)

    def _draw(self, row: torch.Tensor, r: SampleRow) -> int:
        p = r.params
        row = _filter(row / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        if p.seed is None:
            gen = self._generator
        else:
            gen = torch.Generator().manual_seed(step_seed(p.seed, r.seq_index, r.num_generated))
        return int(torch.multinomial(probs, 1, generator=gen).item())
