"""Where a new request goes among data-parallel replicas: the longest usable cached prefix, else the
least loaded replica.

Two sources of "this replica has the prefix", the larger wins:
- the replicas' own answers (`PrefixCache.usable_tokens`, asked at routing time):
  exact under the hybrid hit rule (KV of every kind AND a state checkpoint at the same position),
  over every tier of the replica (device, host KV and states, disk: each piece from any of them,
  read from the tiers' indexes, memory/tier_reach.py), and aware of evictions, which a router-side
  copy of block hashes could not be without a message per eviction;
- the prompts this router sent that are still in flight (their chained block hashes): a burst of
  requests sharing a system prompt arrives before the first has cached anything, and should
  still land together (where the replica's burst rule makes the followers wait for one
  checkpoint instead of each computing the prefix).
Load is counted here, not asked: prompt + max_tokens of the unfinished requests routed to a
replica, updated on route, migration and finish, so concurrent routing decisions see each other.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

from hybridkv.block_hash import extend_hashes, extra_key


class PrefixRouter:
    """Routing decisions and the per-replica load they imply; not thread-safe (callers lock)."""

    def __init__(self, num_replicas: int, block_size: int):
        self.block_size = block_size
        self.load = [0] * num_replicas                     # tokens of unfinished routed requests
        self._inflight: dict[bytes, Counter] = {}          # block hash -> replica -> requests
        self._requests: dict[str, tuple[int, list[bytes], int]] = {}  # rid -> (replica, hashes, tokens)

    def _hashes(self, token_ids: Sequence[int], cache_salt: Optional[str]) -> list[bytes]:
        hashes: list[bytes] = []
        extend_hashes(hashes, token_ids, (len(token_ids) - 1) // self.block_size,
                      extra_key("router", None, (), cache_salt), self.block_size)
        return hashes

    def _inflight_prefix(self, hashes: list[bytes]) -> Counter:
        """Replica -> tokens of this prompt's prefix that a request in flight there shares."""
        depth: Counter = Counter()
        for m, h in enumerate(hashes):
            owners = self._inflight.get(h)
            if not owners:
                break
            for replica in owners:
                depth[replica] = (m + 1) * self.block_size
        return depth

    def choose(self, request_id: str, token_ids: Sequence[int], max_tokens: int, cache_salt: Optional[str],
               hit_tokens: Sequence[Optional[int]]) -> int:
        """The replica for a new request and record it there. `hit_tokens[i]`: replica i's usable
        cached prefix, None for a replica that cannot take requests (dead). ValueError if none can."""
        live = [i for i, h in enumerate(hit_tokens) if h is not None]
        if not live:
            raise ValueError("no data-parallel replica is running")
        hashes = self._hashes(token_ids, cache_salt)
        inflight = self._inflight_prefix(hashes)
        best = max(live, key=lambda i: (max(hit_tokens[i], inflight[i]), -self.load[i], -i))
        self._record(request_id, best, hashes, len(token_ids) + max_tokens)
        return best

    def _record(self, rid: str, replica: int, hashes: list[bytes], tokens: int) -> None:
        self._requests[rid] = (replica, hashes, tokens)
        self.load[replica] += tokens
        for h in hashes:
            self._inflight.setdefault(h, Counter())[replica] += 1

    def finished(self, request_id: str) -> None:
        """The request ended (finished, aborted, failed): its load and in-flight prefix go."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        replica, hashes, tokens = entry
        self.load[replica] -= tokens
        for h in hashes:
            owners = self._inflight[h]
            owners[replica] -= 1
            if owners[replica] <= 0:
                del owners[replica]
            if not owners:
                del self._inflight[h]

    def moved(self, request_id: str, to: int) -> None:
        """The request migrated to replica `to`."""
        entry = self._requests.get(request_id)
        if entry is not None:
            self.finished(request_id)
            self._record(request_id, to, entry[1], entry[2])

    def replica_of(self, request_id: str) -> Optional[int]:
        entry = self._requests.get(request_id)
        return None if entry is None else entry[0]
