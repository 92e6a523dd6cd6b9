"""Prompt-lookup drafting: the request's last n tokens (n from `max_n` down to `min_n`) are looked
up among its earlier tokens, prompt and output; the tokens that followed their latest earlier
occurrence are the proposal, read on through the proposal itself where they reach the end of the
sequence (a loop of period p continues as that loop: p tokens back is the same text). No model runs. Each request's n-grams are indexed once as its tokens
grow (a dict lookup per n a step, not a scan of the sequence)."""
from __future__ import annotations

from typing import Hashable, Sequence


class NgramIndex:
    """{n-gram: the position after its latest occurrence} for n in [min_n, max_n] over a growing
    token list, indexed up to `indexed` (exclusive end of the last n-gram added)."""

    __slots__ = ("maps", "indexed", "source")

    def __init__(self, min_n: int, max_n: int, source: int):
        self.maps = {n: {} for n in range(max_n, min_n - 1, -1)}  # longest first
        self.indexed = 0
        self.source = source  # id() of the token list indexed (a request's list only grows)

    def extend(self, tokens: Sequence[int], end: int) -> None:
        """Index every n-gram ending at positions <= end (exclusive ends in (indexed, end])."""
        for stop in range(self.indexed + 1, end + 1):
            for n, m in self.maps.items():
                if stop >= n:
                    m[tuple(tokens[stop - n:stop])] = stop
        self.indexed = max(self.indexed, end)


class NgramDrafter:
    """Proposes up to k tokens for a request from its own tokens (see the module doc)."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[Hashable, NgramIndex] = {}

    def propose(self, request_id: Hashable, tokens: Sequence[int], k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest suffix n-gram of
        `tokens`, continued as a repeat where they reach its end ([] when none recurs)."""
        if k < 1 or len(tokens) <= self.min_n:
            return []
        index = self._index.get(request_id)
        if index is None or index.source != id(tokens) or index.indexed >= len(tokens):  # new, or other tokens
            index = self._index[request_id] = NgramIndex(self.min_n, self.max_n, id(tokens))
        end = len(tokens)
        index.extend(tokens, end - 1)  # n-grams ending before the last token: earlier occurrences
        for n, m in index.maps.items():
            if end < n:
                continue
            at = m.get(tuple(tokens[end - n:end]))
            if at is not None:
                out = list(tokens[at:at + k])
                while len(out) < k:  # the match runs into the end: its period repeats
                    out.append(out[len(out) - (end - at)])
                return out
        return []

    def propose_many(self, asks) -> list[list[int]]:
        """asks: (request id, its tokens, k) -> a proposal for each."""
        return [self.propose(rid, tokens, k) for rid, tokens, k in asks]

    def forget(self, request_id: Hashable) -> None:
        self._index.pop(request_id, None)
