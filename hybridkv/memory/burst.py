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

from typing import Callable, Hashable, Optional, Sequence

Candidate = tuple[Hashable, Sequence[int], Optional[str]]  # (request id, token ids, cache_salt)


class BurstRule:
    """Who is computing which not-yet-cached prompt block, and who waits for whom.

    hash_prompt(tokens, cache_salt): the hashes of the full blocks strictly inside a prompt.
    usable_hit(hashes, num_tokens): how many blocks of it every kind can resume from now.
    """

    def __init__(self, block_size: int, hash_prompt: Callable[[Sequence[int], Optional[str]], list[bytes]],
                 usable_hit: Callable[[Sequence[bytes], int], int]):
        self.block_size = block_size
        self.hash_prompt = hash_prompt
        self.usable_hit = usable_hit
        self._leader: dict[bytes, Hashable] = {}        # block hash -> the running request computing it
        self._blocks: dict[Hashable, list[bytes]] = {}  # running request -> hashes it registered
        self._planned: dict[Hashable, set[int]] = {}    # not yet admitted leader -> boundaries
        self._hashes: dict[Hashable, list[bytes]] = {}  # waiting request -> its prompt's hashes
        self.waits = 0

    def _prompt_hashes(self, rid: Hashable, tokens: Sequence[int], salt: Optional[str]) -> list[bytes]:
        hashes = self._hashes.get(rid)
        if hashes is None or len(hashes) != (len(tokens) - 1) // self.block_size:
            if len(self._hashes) > 4096:  # ids that were never admitted (aborted while waiting)
                self._hashes.clear()
            hashes = self._hashes[rid] = self.hash_prompt(tokens, salt)
        return hashes

    def plan(self, candidates: Sequence[Candidate]) -> None:
        """Before a step admits: the next not-yet-admitted requests in queue order. Where a later
        one shares blocks beyond its usable hit with an earlier one, the earlier one will be told
        the deepest shared boundary when it is admitted (so its first chunk is cut there)."""
        self._planned = {}
        owner: dict[bytes, Hashable] = {}
        for rid, tokens, salt in candidates:
            hashes = self._prompt_hashes(rid, tokens, salt)
            m = self.usable_hit(hashes, len(tokens))
            s, leader = m, None
            while s < len(hashes) and owner.get(hashes[s], rid) != rid:
                leader, s = owner[hashes[s]], s + 1
            if leader is not None:
                self._planned.setdefault(leader, set()).add(s * self.block_size)
            for h in hashes[m:]:
                owner.setdefault(h, rid)

    def admitted(self, rid: Hashable, computing: Sequence[bytes], hit_tokens: int) -> list[int]:
        """rid starts computing the prompt blocks `computing`; returns the boundaries planned for it."""
        self._hashes.pop(rid, None)
        mine = self._blocks.setdefault(rid, [])
        for h in computing:
            if h not in self._leader:
                self._leader[h] = rid
                mine.append(h)
        return sorted(b for b in self._planned.pop(rid, ()) if b > hit_tokens)

    def drop(self, rid: Hashable) -> None:
        """rid stopped computing its prompt (finished, preempted, aborted): nobody waits for it."""
        for h in self._blocks.pop(rid, ()):
            if self._leader.get(h) == rid:
                del self._leader[h]

    def leader_for(self, rid: Hashable, tokens: Sequence[int], salt: Optional[str]
                   ) -> tuple[Optional[Hashable], int]:
        """(leader, boundary): the running request computing the blocks rid shares beyond its
        usable hit, and the deepest shared block boundary in tokens; (None, 0) if none."""
        if not self._leader:  # nobody is computing a prompt: nothing to hash or match
            return None, 0
        hashes = self._prompt_hashes(rid, tokens, salt)
        s = m = self.usable_hit(hashes, len(tokens))
        leader = None
        while s < len(hashes):
            owner = self._leader.get(hashes[s])
            if owner is None or owner == rid:
                break
            leader, s = owner, s + 1
        return (leader, s * self.block_size) if s > m else (None, 0)
