"""The disk tier's reader thread: the files a waiting request's hit will take, read and verified
before its admission, so the engine step never waits for a disk.

    reader = DiskReader(read_entry, max_bytes)    read_entry(EntryRead) -> Staged | None (disk_tier.py)
    reader.start(owner, [EntryRead, ...]) -> bool  queue one waiting request's reads (False: over the bound)
    reader.busy(owner);  reader.staged(owner) -> {name: Staged}
    reader.take(owner) -> {name: Staged}   the admission's: the job ends, its bytes are released
    reader.drop(owner);  reader.wait(timeout);  reader.close()

The thread runs the very read the admission would run (`DiskTier.read_entry`: DiskStore.read, every
check of disk_format.py; a file that fails is deleted and counted there, exactly as on the step's
thread); only when it runs moves. What it reads is kept per owner (a request id) until the
admission takes it or the request leaves. Bytes of the jobs started and not yet taken (in flight or
staged) are bounded by `max_bytes`: a job that would pass the bound is refused (the request is then
admitted as without a reader, reading on the step's thread), unless no other job holds bytes, so
one request's reads always run whatever their size. The reader holds no lock of the store or the
step while it reads; its own lock guards only its jobs.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

import torch

from .disk_format import Layout

log = logging.getLogger("hybridkv.disk")
DEFAULT_READ_AHEAD_BYTES = 256 << 20  # staged or in flight: a few long prefixes of a 7-9B hybrid


@dataclass(frozen=True)
class EntryRead:
    """One file to read and what it must hold: name, kind ("kv" / "state"), key, position and
    layout are DiskStore.read's expectations; nbytes: its size in the store's index."""

    name: str
    kind: str
    key: bytes
    position: int
    layout: Layout
    nbytes: int


@dataclass(frozen=True)
class Staged:
    """A verified entry's tensors {tensor name: host tensor} and the store's serial of the name when
    it was read (usable while the store still holds that serial)."""

    tensors: dict[str, torch.Tensor]
    serial: Optional[int]


@dataclass
class ReaderCounters:
    reads: int = 0              # entries read and verified on the reader thread (failures included)
    read_seconds: float = 0.0   # the thread's time reading and verifying them
    over_bound: int = 0         # jobs refused: the bytes staged or in flight would pass max_bytes


@dataclass
class _Job:
    todo: list[EntryRead] = field(default_factory=list)
    results: dict[str, Optional[Staged]] = field(default_factory=dict)
    nbytes: int = 0
    busy: bool = False
    dropped: bool = False


class DiskReader:
    """See the module docstring. `read_entry` is called on the reader thread only."""

    def __init__(self, read_entry: Callable[[EntryRead], Optional[Staged]], max_bytes: int = DEFAULT_READ_AHEAD_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"disk read-ahead bound {max_bytes!r} bytes: it must be a positive integer")
        self.max_bytes = max_bytes
        self.counters = ReaderCounters()
        self._read_entry = read_entry
        self._cond = threading.Condition()
        self._jobs: dict[Hashable, _Job] = {}
        self._bytes = 0  # of the jobs in _jobs
        self._finished = 0  # jobs the thread has finished (wait() watches it)
        self._closed = False
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hybridkv-disk-reader", daemon=True)
        self._thread.start()

    @property
    def staged_bytes(self) -> int:
        """Bytes of the jobs started and not yet taken or dropped (in flight or staged)."""
        return self._bytes

    def start(self, owner: Hashable, entries: list[EntryRead]) -> bool:
        """Queue the reads of `entries` for `owner` (added to what it has staged already). False,
        queueing nothing, when the reader is closed, owner's reads are in flight, or the bytes
        would pass the bound while another job holds bytes."""
        n = sum(e.nbytes for e in entries)
        with self._cond:
            job = self._jobs.get(owner)
            if self._closed or not entries or job is not None and job.busy:
                return False
            if self._bytes and self._bytes + n > self.max_bytes:
                self.counters.over_bound += 1
                return False
            if job is None:
                job = self._jobs[owner] = _Job()
            job.todo, job.busy = list(entries), True
            job.nbytes += n
            self._bytes += n
        self._queue.put(job)
        return True

    def busy(self, owner: Hashable) -> bool:
        """Whether owner's reads are in flight."""
        with self._cond:
            job = self._jobs.get(owner)
            return job is not None and job.busy

    def in_flight(self) -> bool:
        """Whether any job's reads are in flight."""
        with self._cond:
            return any(j.busy for j in self._jobs.values())

    def staged(self, owner: Hashable) -> dict[str, Staged]:
        """The entries read and verified for owner so far (those that failed are absent)."""
        with self._cond:
            job = self._jobs.get(owner)
            return {} if job is None else {n: s for n, s in job.results.items() if s is not None}

    def take(self, owner: Hashable) -> dict[str, Staged]:
        """staged(owner), ending owner's job (its bytes released). A job still in flight is
        dropped and {} returned: the admission reads for itself."""
        with self._cond:
            job = self._end(owner)
            if job is None or job.busy:
                return {}
            return {n: s for n, s in job.results.items() if s is not None}

    def drop(self, owner: Hashable) -> None:
        """Forget owner's job (the request left, or needs no read any more); a read in flight ends
        unused."""
        with self._cond:
            self._end(owner)

    def _end(self, owner: Hashable) -> Optional[_Job]:
        job = self._jobs.pop(owner, None)
        if job is not None:
            job.dropped = True
            self._bytes -= job.nbytes
        return job

    def wait(self, timeout: float) -> None:
        """Block until some job in flight finishes or `timeout` seconds pass; at once if none is in flight."""
        with self._cond:
            if any(j.busy for j in self._jobs.values()):
                seen = self._finished
                self._cond.wait_for(lambda: self._finished != seen or self._closed, timeout)

    def close(self) -> None:
        """Stop the thread after the read in progress (queued jobs end unread); idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for owner in list(self._jobs):
                self._end(owner)
            self._cond.notify_all()
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            for e in job.todo:
                if job.dropped:
                    break
                t0 = time.perf_counter()
                try:
                    got = self._read_entry(e)
                except Exception as err:  # never a job left in flight: its request would wait forever
                    log.error("disk cache: reading %s ahead failed (%r); the admission reads it", e.name, err)
                    got = None
                with self._cond:
                    job.results[e.name] = got
                    self.counters.reads += 1
                    self.counters.read_seconds += time.perf_counter() - t0
            with self._cond:
                job.busy = False
                self._finished += 1
                self._cond.notify_all()
