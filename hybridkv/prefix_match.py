"""The prefix hit over every kind of layer memory, and the counters of hits and misses.

A prefix is usable only as far as EVERY kind can resume it: starting from the blocks the lead
attention group has cached (never the whole prompt: one token is always left to compute), each
kind lowers the count to the largest position it accepts, until no kind lowers it further.
A miss is counted by its reason: no KV match, a KV match with no state checkpoint, caching off.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

MISS_NO_KV = "no_kv_match"
MISS_NO_CHECKPOINT = "kv_match_no_checkpoint"
MISS_CACHING_OFF = "caching_off"


@dataclass(frozen=True)
class PrefixMatch:
    """blocks: hit blocks every kind accepts; kv_blocks: blocks the KV alone matches; miss: why
    nothing hit (None on a hit); branches: the KV match ends at a junction (another cached
    continuation of the same prefix)."""

    blocks: int
    kv_blocks: int
    miss: Optional[str]
    branches: bool


NO_MATCH = PrefixMatch(0, 0, MISS_CACHING_OFF, False)  # prefix caching is off


def match_prefix(kinds: Sequence, attention, hashes: Sequence[bytes], num_tokens: int,
                 block_size: int) -> PrefixMatch:
    """kinds: every LayerMemory of the model; attention: the lead attention group (None without
    attention layers); hashes: the prompt's chained block hashes; num_tokens: its length."""
    limit = min(len(hashes), (num_tokens - 1) // block_size)
    kv = attention.usable_prefix(hashes, limit) if attention is not None else limit
    m = kv
    while True:  # the largest position every kind accepts
        before = m
        for kind in kinds:
            m = kind.usable_prefix(hashes, m)
        if m == before:
            break
    if attention is None:
        kv = m  # no KV to tell where known prefixes run
    miss = None if m else (MISS_NO_KV if kv == 0 else MISS_NO_CHECKPOINT)
    branches = attention is not None and attention.branches(hashes, kv)
    return PrefixMatch(m, kv, miss, branches)


@dataclass
class PrefixHitCounter:
    """Admissions that asked for a prefix, their prompt tokens, the tokens that hit, and the
    misses by reason."""

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    misses: dict = field(default_factory=lambda: {MISS_NO_KV: 0, MISS_NO_CHECKPOINT: 0, MISS_CACHING_OFF: 0})

    def record(self, num_tokens: int, hit_tokens: int, miss: Optional[str]) -> None:
        self.queries += 1
        self.query_tokens += num_tokens
        self.hit_tokens += hit_tokens
        if miss:
            self.misses[miss] += 1
