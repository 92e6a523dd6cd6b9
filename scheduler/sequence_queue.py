"""A queue of sequences in run order (priority, then arrival), with removal by id.

A binary heap of (priority, arrival, serial, ticket, id) entries plus a dict id -> (ticket, sequence).
Removing a sequence only drops it from the dict; its heap entry goes stale (its ticket no longer
matches) and is discarded when it reaches the top, or when stale entries outnumber live ones.
So add is O(log n), remove O(1), the head O(log n) amortized: a scheduler step that looks at the
first k sequences costs O(k log n), not a sort of the whole queue.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Iterator, Optional

from hybridkv.request import Request, run_order


class SequenceQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, int, str]] = []  # sort key, ticket, id
        self._live: dict[str, tuple[int, Request]] = {}
        self._tickets = itertools.count()
        self._order: Optional[list[Request]] = None  # run order of the live ones, until one changes
        self.version = 0  # counts adds and removes: the same version, the same sequences
        self.added = 0  # counts adds: the same count, nobody joined (those left may have)

    def add(self, seq: Request) -> None:
        """Queue `seq` at its place by (priority, arrival, serial); its id must not be queued."""
        if seq.request_id in self._live:
            raise ValueError(f"sequence {seq.request_id!r} is already in this queue")
        ticket = next(self._tickets)
        self._live[seq.request_id] = (ticket, seq)
        self._order = None
        self.version += 1
        self.added += 1
        heapq.heappush(self._heap, (*run_order(seq), ticket, seq.request_id))

    def remove(self, seq: Request) -> bool:
        """Take `seq` out; False if it was not queued here."""
        entry = self._live.get(seq.request_id)
        if entry is None or entry[1] is not seq:
            return False
        del self._live[seq.request_id]
        self._order = None
        self.version += 1
        if len(self._heap) > 2 * len(self._live) + 64:  # keep stale entries a bounded share
            self._heap = [(*run_order(s), t, s.request_id) for t, s in self._live.values()]
            heapq.heapify(self._heap)
        return True

    def peek(self) -> Optional[Request]:
        """The sequence that runs first, or None when empty."""
        heap, live = self._heap, self._live
        while heap:
            entry = live.get(heap[0][4])
            if entry is not None and entry[0] == heap[0][3]:
                return entry[1]
            heapq.heappop(heap)  # stale: removed (and maybe queued again under a new ticket)
        return None

    def head(self, k: int) -> list[Request]:
        """The first k sequences in run order, left in the queue (O(k log n), not a scan)."""
        entries = []
        while len(entries) < k and self.peek() is not None:  # peek drops stale entries on top
            entries.append(heapq.heappop(self._heap))
        for entry in entries:
            heapq.heappush(self._heap, entry)
        return [self._live[entry[4]][1] for entry in entries]

    def pop(self) -> Request:
        seq = self.peek()
        if seq is None:
            raise IndexError("pop from an empty SequenceQueue")
        self.remove(seq)
        return seq

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, seq: Request) -> bool:
        entry = self._live.get(seq.request_id)
        return entry is not None and entry[1] is seq

    def __iter__(self) -> Iterator[Request]:
        """All queued sequences in run order (sorted once, then kept until the queue changes: the
        running queue is walked every step and changes only when a sequence joins or leaves)."""
        if self._order is None:
            self._order = sorted((s for _, s in self._live.values()), key=run_order)
        return iter(self._order)
