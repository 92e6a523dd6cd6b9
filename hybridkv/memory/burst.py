"""Bursts: requests that arrive together and share a prefix nobody has computed yet.

Without help each of them computes the shared part itself (its state exists nowhere until some
request's chunk ends exactly there). The rule: the first request computing a shared stretch is
its leader; a later request that shares blocks with it beyond every usable checkpoint waits,
and the leader checkpoints at the deepest shared block boundary (its chunk is cut there). Once
the leader is past that boundary the follower admits as an ordinary prefix hit. The wait is
bounded: a follower waits only while its leader is running and short of the boundary, so a
leader that finishes, is preempted, aborted or fails releases it at once.
"""
from __future__ import annotations

from typing import Hashable, Optional, Sequence


class BurstTracker:
    """Which running request is computing each not-yet-cached prompt block (by hash)."""

    def __init__(self):
        self._leader: dict[bytes, Hashable] = {}     # block hash -> the request computing it
        self._blocks: dict[Hashable, list[bytes]] = {}  # request -> hashes it registered
        self.waits = 0

    def register(self, rid: Hashable, hashes: Sequence[bytes]) -> None:
        """rid is about to compute the blocks with these hashes (beyond its hit, inside its prompt)."""
        mine = self._blocks.setdefault(rid, [])
        for h in hashes:
            if h not in self._leader:
                self._leader[h] = rid
                mine.append(h)

    def drop(self, rid: Hashable) -> None:
        for h in self._blocks.pop(rid, ()):
            if self._leader.get(h) == rid:
                del self._leader[h]

    def shared_with(self, rid: Hashable, hashes: Sequence[bytes], hit: int, limit: int
                    ) -> tuple[Optional[Hashable], int]:
        """(leader, s): the request computing blocks hashes[hit:s] that rid shares, with s the
        deepest such boundary (<= limit blocks); (None, hit) if none."""
        s, leader = hit, None
        while s < limit and s < len(hashes):
            owner = self._leader.get(hashes[s])
            if owner is None or owner == rid:
                break
            leader, s = owner, s + 1
        return leader, s
