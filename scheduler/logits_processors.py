"""The logits processors, batched over rows on the logits' device, in vLLM's / transformers' order:
logit_bias, min_tokens, penalties (repetition, frequency, presence), temperature, top-k, top-p,
min-p. Each takes float32 logits [R, V] (changed in place where it says so) and per-row settings;
none loops over the vocabulary in Python or copies the logits to the host.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

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
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    if any(len(t) for t in token_lists):
        rows = [torch.tensor(t, dtype=torch.long) if len(t) else torch.empty(0, dtype=torch.long)
                for t in token_lists]
        ids = pad_sequence(rows, batch_first=True, padding_value=vocab_size).to(device)
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


# top-p looks for its nucleus among this many most likely tokens first (a partial top-k, far
# cheaper than sorting a 128k vocabulary); rows whose nucleus is wider fall back to a full sort.
TOP_P_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:
    """Keep each row's top_k [R] (long, V = off) largest logits, then the smallest set whose
    probability reaches top_p [R] (1 = off; the most likely token always stays); -inf elsewhere.
    transformers' rule: a token is dropped when the probability of it and every less likely
    token (after top-k) is <= 1 - top_p. Exact whichever path a row takes."""
    vocab = logits.shape[-1]
    kmax = int(top_k.max())
    if bool((top_p >= 1.0).all()):  # top-k alone
        kth = torch.topk(logits, kmax, dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth, NEG_INF)
    limited = top_k < vocab
    width = min(vocab, max(candidates, int(top_k[limited].max()) if bool(limited.any()) else 0))
    vals, idx = torch.topk(logits, width, dim=-1)  # descending
    kth = vals.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1))
    vals = vals.masked_fill(limited.unsqueeze(1) & (vals < kth), NEG_INF)
    # probabilities over the whole vocabulary, or over the top-k survivors (all among the candidates)
    norm = torch.where(limited, vals.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (vals - norm.unsqueeze(1)).exp()
    inside = probs.sum(dim=-1)
    # mass of a candidate and every less likely token: the tokens outside, plus the tail from it on
    at_or_below = (1.0 - inside).clamp(min=0).unsqueeze(1) + probs.flip(-1).cumsum(-1).flip(-1)
    drop = at_or_below <= (1.0 - top_p).unsqueeze(1)
    drop[:, 0] = False
    out = torch.full_like(logits, NEG_INF).scatter_(1, idx, vals.masked_fill(drop, NEG_INF))
    wide = (~limited & (inside < top_p)).nonzero().squeeze(1)  # the nucleus passes the candidates
    if wide.numel():
        out[wide] = _sorted_top_p(logits[wide], top_p[wide])
    return out


def _sorted_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top-p over a full ascending sort of each row (transformers' own procedure)."""
    ascending, order = logits.sort(dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    return torch.empty_like(logits).scatter_(1, order, ascending.masked_fill(drop, NEG_INF))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p [R] times their row's top probability."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < floor, NEG_INF)
