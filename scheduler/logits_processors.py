"""The logits processors, batched over rows on the logits' device, in vLLM's / transformers' order:
logit_bias, min_tokens, penalties (repetition, frequency, presence), temperature, top-k, top-p,
min-p. Each takes float32 logits [R, V] (changed in place where it says so) and per-row settings;
none loops over the vocabulary in Python or copies the logits to the host.
"""
from __future__ import annotations

from typing import Sequence

import torch

NEG_INF = float("-inf")


def add_logit_bias(logits: torch.Tensor, biases: Sequence[dict[int, float]]) -> None:
    """logits[r, t] += biases[r][t] for every (row, token) given; in place."""
    rows = [r for r, b in enumerate(biases) for _ in b]
    if not rows:
        return
    dev = logits.device
    toks = torch.tensor([t for b in biases for t in b], dtype=torch.long, device=dev)
    vals = torch.tensor([v for b in biases for v in b.values()], dtype=logits.dtype, device=dev)
    logits.index_put_((torch.tensor(rows, dtype=torch.long, device=dev), toks), vals, accumulate=True)


def mask_tokens(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> None:
    """logits[r, t] = -inf for t in banned[r] (min_tokens: EOS and stop ids not yet allowed); in place."""
    rows = [r for r, ids in enumerate(banned) for _ in ids]
    if not rows:
        return
    dev = logits.device
    toks = torch.tensor([t for ids in banned for t in ids], dtype=torch.long, device=dev)
    logits[torch.tensor(rows, dtype=torch.long, device=dev), toks] = NEG_INF


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """How often each token occurs in each list: [R, V] float32, one scatter_add over the lists
    padded with an extra id V (its column is dropped)."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    if width:
        padded = [list(t) + [vocab_size] * (width - len(t)) for t in token_lists]
        ids = torch.tensor(padded, dtype=torch.long, device=device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, prompt_counts: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Penalize logits [R, V]. repetition [R] (1 = off) as transformers: tokens seen in the prompt
    or the output have positive logits divided and negative ones multiplied by it; frequency and
    presence [R] as OpenAI: logit -= count_in_output * frequency + (count > 0) * presence.
    Returns the new logits."""
    seen = (prompt_counts > 0) | (output_counts > 0)
    rep = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - output_counts * frequency.unsqueeze(1) - (output_counts > 0) * presence.unsqueeze(1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k [R] (long, V = off) largest logits, then the smallest set whose
    probability reaches top_p [R] (1 = off; the most likely token always stays); -inf elsewhere.
    transformers' rule: a token is dropped when the cumulative probability of the tokens up to
    and including it, in ascending order, is <= 1 - top_p."""
    vocab = logits.shape[-1]
    if bool((top_p >= 1.0).all()):  # top-k alone: a partial top-k is cheaper than a full sort
        kmax = int(top_k.max())
        kth = torch.topk(logits, kmax, dim=-1).values.gather(1, (top_k.clamp(max=kmax) - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth, NEG_INF)
    ascending, order = logits.sort(dim=-1)
    kth = ascending.gather(1, (vocab - top_k).unsqueeze(1))
    ascending = ascending.masked_fill(ascending < kth, NEG_INF)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, ascending)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p [R] times their row's top probability."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < floor, NEG_INF)
