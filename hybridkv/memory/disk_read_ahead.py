"""The read-ahead rule: a waiting request whose prefix the disk tier takes deeper than the device and
the host do is held back from admission while its files are read off the step (docs/design.md,
"Disk tier", *Read*; vLLM's requests waiting for remote KVs, in spirit).

Before the scheduler admits a waiting request it asks `waits` (PrefixCache.waits_for_disk_read):

1. The tiers' one rule (memory/tier_reach.py, `reaches`: read-only) names the deepest position past
   the device's hit and the disk files it takes. None: nothing to read, admit now.
2. Files not yet staged for this request are handed to the reader thread (memory/disk_reader.py),
   which reads and verifies them as the admission would; the request is held (skipped, not refused:
   the scan goes on and other requests are admitted) while they are in flight.
3. When they are done the position is asked for again: a file that failed was deleted from the
   index (refused and counted by the store), so the position may now be shallower and take other
   files; those are read the same way, at most `MAX_ROUNDS` times in all. Then the request is
   admitted, and `take` hands its admission the staged bytes (TierReach.promote uses them in place
   of reading; what they lack, or what the tiers no longer hold as staged, it reads or skips as
   without a reader).

A request never waits forever: every round ends (the reader never leaves a job in flight), each
round either stages what the position needs or deletes a failing file, the rounds are bounded, and
a job over the reader's byte bound is refused (the request is admitted at once). The time from a
request's first hold to its release is counted (`read_wait_seconds`).
"""
from __future__ import annotations

import time
from typing import Hashable, Sequence

from .disk_reader import DiskReader, Staged
from .disk_tier import DiskTierCounters
from .tier_reach import TierReach

MAX_ROUNDS = 3  # reads per request: a failure makes the position shallower, and it may need other files


class DiskReadAhead:
    """The rule above over one manager's tiers (`tiers`), its disk tier's reader and counters."""

    def __init__(self, tiers: TierReach, reader: DiskReader, counters: DiskTierCounters):
        self.tiers = tiers
        self.reader = reader
        self.counters = counters
        self._rounds: dict[Hashable, int] = {}
        self._held_since: dict[Hashable, float] = {}

    def waits(self, owner: Hashable, hashes: Sequence[bytes], limit: int, floor: int) -> bool:
        """True to hold `owner` (a waiting request, its block hashes, at most `limit` blocks of a hit,
        `floor` blocks hit on the device alone) while its disk files are read; starts those reads."""
        if self.reader.busy(owner):  # (a job runs to its end: every file of it is checked, as in the admission)
            return True
        reach = next(self.tiers.reaches(hashes, limit, floor), None)
        entries = self.tiers.disk_entries(hashes, reach) if reach is not None else []
        if not entries:  # nothing to read (any more): what was staged is of no use
            self.reader.drop(owner)
            return self._released(owner)
        staged = self.reader.staged(owner)
        missing = [e for e in entries if not self.tiers.disk.fresh(staged.get(e.name), e.name)]
        rounds = self._rounds.get(owner, 0)
        if missing and rounds < MAX_ROUNDS and self.reader.start(owner, missing):
            self._rounds[owner] = rounds + 1
            self._held_since.setdefault(owner, time.perf_counter())
            return True
        return self._released(owner)

    def _released(self, owner: Hashable) -> bool:
        since = self._held_since.pop(owner, None)
        if since is not None:
            self.counters.read_wait_seconds += time.perf_counter() - since
        return False

    def take(self, owner: Hashable) -> dict[str, Staged]:
        """What was read for `owner` {file name: Staged}, for its admission; its job ends."""
        self._rounds.pop(owner, None)
        self._released(owner)
        return self.reader.take(owner)

    def forget(self, owner: Hashable) -> None:
        """`owner` left the queue (finished, aborted, failed): its reads end unused."""
        self._rounds.pop(owner, None)
        self._held_since.pop(owner, None)
        self.reader.drop(owner)

    def wait(self, timeout: float) -> None:
        """Block until a read in flight finishes, or `timeout` seconds (at once when none is in flight):
        a step that scheduled nothing while requests wait for reads does not spin."""
        self.reader.wait(timeout)
