"""The disk tier's files: one directory per namespace, an index of its entries, a byte budget, and
a writer thread that writes each entry atomically.

    store = DiskStore(root, namespace, budget_bytes, describe={...})
    store.has(name);  store.put(name, kind, key, position, tensors)   queue a write (no I/O here)
    store.read(name, kind, key, position, layout) -> {tensor name: tensor} | None   verified, or refused
    store.serial(name)   which indexing of `name` this is (a staged read is usable only while it holds)
    store.flush();  store.close();  store.stats()

`root/<namespace>/` holds the entries of one model, block size and cache layout (the namespace is
a digest of them; `namespace.json` there names them for a person). An entry's name says what it
is and where (`state-<position>-<key hex>.hkv`, `kv-<group>-<block index>-<key hex>.hkv`); the key
is the chained block hash, which folds in the model fingerprint and the tenant's cache salt, so a
salt never appears in a name. Writes go to a temporary file in the same directory, are fsynced
and renamed over the final name (`os.replace`): a reader sees a whole entry or none, and a crash
leaves at most a temporary file, removed at the next start. The index (name -> bytes, least
recently used first) is read from the directory at start; entries past the budget are evicted
least recently used first. A read checks everything (disk_format.py); a file that fails is
deleted and counted (`refused_corrupt`), and the caller treats it as a miss. Reads may run on
the disk tier's reader thread (disk_reader.py) as well as the step's: the index and the counters
change under the store's lock, which no file I/O ever holds.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import itertools
import queue
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .disk_format import DiskEntryError, Layout, decode, encode_to

log = logging.getLogger("hybridkv.disk")
SUFFIX = ".hkv"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 600.0  # a temporary file older than this is a crashed writer's (another live process may be writing)
_MAX_PENDING_BYTES = 1 << 30  # writes queued beyond this are dropped (counted), so a slow disk never grows memory


@dataclass
class DiskCounters:
    writes: int = 0             # entries written (files renamed into place)
    write_bytes: int = 0
    write_seconds: float = 0.0  # the writer thread's time (encode, CRC, write, fsync, rename)
    write_errors: int = 0       # writes that failed (disk full, permissions): logged, entry dropped
    dropped_writes: int = 0     # writes not queued: more than _MAX_PENDING_BYTES were pending
    reads: int = 0              # entries read and verified
    read_seconds: float = 0.0
    refused_corrupt: int = 0    # files that failed a check: deleted, never used
    evictions: int = 0          # entries deleted for the budget


class DiskStore:
    """Entries of one namespace under `root`, within `budget_bytes` (this process's view: files
    other processes write after start-up are seen at the next start)."""

    def __init__(self, root: str, namespace: str, budget_bytes: int, describe: Optional[dict] = None):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"disk cache budget {budget_bytes!r} bytes: it must be a positive integer")
        self.namespace = namespace
        self.dir = os.path.join(os.path.abspath(os.path.expanduser(str(root))), namespace)
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, f"{_TMP_PREFIX}probe-{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.remove(probe)
        except OSError as e:
            raise ValueError(f"disk_cache_dir {root!r}: cannot create and write {self.dir} ({e.strerror or e}); "
                             f"pass a directory this process may write, or leave the disk cache off") from None
        if describe is not None:
            self._write_description(describe)
        self.budget_bytes = budget_bytes
        self.counters = DiskCounters()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # name -> bytes (queued or on disk), LRU first
        self._pending: set[str] = set()  # queued, not yet on disk
        self._pending_bytes = 0
        self._used = 0
        self._kinds: Counter = Counter()  # entries by the part of their name before the first "-"
        self._serials: dict[str, int] = {}  # name -> when it was indexed (a new entry of a name, a new serial)
        self._next_serial = itertools.count(1)
        self._scan()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hybridkv-disk-writer", daemon=True)
        self._thread.start()
        self._closed = False
        atexit.register(self.close)
        with self._lock:
            self._evict_for(0)

    def _write_description(self, describe: dict) -> None:
        path = os.path.join(self.dir, "namespace.json")
        if not os.path.exists(path):
            tmp = os.path.join(self.dir, f"{_TMP_PREFIX}ns-{os.getpid()}")
            with open(tmp, "w") as f:
                json.dump(describe, f, indent=1, default=str)
            os.replace(tmp, path)

    def _scan(self) -> None:
        """Index the directory's entries, oldest modification first; remove stale temporary files."""
        now, found = time.time(), []
        with os.scandir(self.dir) as it:
            for e in it:
                try:
                    st = e.stat()
                except OSError:
                    continue
                if e.name.startswith(_TMP_PREFIX):
                    if now - st.st_mtime > _STALE_TMP_S:
                        _unlink(e.path)
                elif e.name.endswith(SUFFIX) and e.is_file():
                    found.append((st.st_mtime, e.name, st.st_size))
        for _, name, size in sorted(found):
            self._add(name, size)

    # ---- index -------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self._index)

    def size(self, name: str) -> int:
        """The entry's bytes as indexed (0: not indexed)."""
        return self._index.get(name, 0)

    def serial(self, name: str) -> Optional[int]:
        """Which indexing of `name` the index holds (None: not indexed): a read staged under one serial
        is stale once the entry was dropped, even if a later write brought the name back."""
        return self._serials.get(name)

    def names(self, prefix: str = "") -> list[str]:
        with self._lock:
            return [n for n in self._index if n.startswith(prefix)]

    def touch(self, name: str) -> None:
        """The entry was used: the last to be evicted now."""
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)

    def count(self, kind: str) -> int:
        """Entries whose name starts with `kind` + "-" ("state", "kv")."""
        return self._kinds[kind]

    def _add(self, name: str, size: int) -> None:
        """Index an entry (lock held, or at start)."""
        self._index[name] = size
        self._serials[name] = next(self._next_serial)
        self._used += size
        self._kinds[name.split("-", 1)[0]] += 1

    def _drop(self, name: str) -> Optional[int]:
        """Unindex an entry (lock held); its size, or None when it was not indexed."""
        size = self._index.pop(name, None)
        if size is not None:
            del self._serials[name]
            self._used -= size
            self._kinds[name.split("-", 1)[0]] -= 1
        return size

    def _evict_for(self, nbytes: int) -> None:
        """Evict least recently used entries on disk until `nbytes` more fit the budget (lock held)."""
        while self._used + nbytes > self.budget_bytes:
            victim = next((n for n in self._index if n not in self._pending), None)
            if victim is None:
                return
            self._drop(victim)
            self.counters.evictions += 1
            self._jobs.put(("delete", victim))

    # ---- writes ------------------------------------------------------------------------------
    def put(self, name: str, kind: str, key: bytes, position: int,
            tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Queue an entry (host tensors, owned by the store from now) for the writer thread;
        False when it is known already, larger than the budget, or too much is pending."""
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors) + 512  # + header, roughly
        with self._lock:
            if self._closed or name in self._index or nbytes > self.budget_bytes:
                return False
            if self._pending_bytes + nbytes > _MAX_PENDING_BYTES:
                self.counters.dropped_writes += 1
                return False
            self._evict_for(nbytes)
            self._add(name, nbytes)
            self._pending.add(name)
            self._pending_bytes += nbytes
        self._jobs.put(("write", (name, kind, key, position, tensors, nbytes)))
        return True

    def _run(self) -> None:
        while True:
            job, arg = self._jobs.get()
            try:
                if job == "stop":
                    return
                if job == "delete":
                    _unlink(os.path.join(self.dir, arg))
                else:
                    self._write(*arg)
            finally:
                self._jobs.task_done()

    def _write(self, name: str, kind: str, key: bytes, position: int, tensors, estimate: int) -> None:
        t0 = time.perf_counter()
        tmp = os.path.join(self.dir, f"{_TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{name}")
        try:
            with open(tmp, "wb") as f:
                size = encode_to(f, kind, key, position, self.namespace, tensors)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.dir, name))
        except OSError as e:
            _unlink(tmp)
            log.warning("disk cache: writing %s failed (%s); the entry is dropped", name, e)
            with self._lock:
                self.counters.write_errors += 1
                self._pending.discard(name)
                self._pending_bytes -= estimate
                self._drop(name)
            return
        with self._lock:
            self._pending.discard(name)
            self._pending_bytes -= estimate
            if name in self._index:  # the real size replaces the estimate
                self._used += size - self._index[name]
                self._index[name] = size
            c = self.counters
            c.writes += 1
            c.write_bytes += size
            c.write_seconds += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        self._jobs.join()

    def close(self) -> None:
        """Flush and stop the writer thread (later puts are refused); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._jobs.put(("stop", None))
        self._thread.join()
        atexit.unregister(self.close)

    # ---- reads -------------------------------------------------------------------------------
    def read(self, name: str, kind: str, key: bytes, position: int, layout: Layout) -> Optional[dict]:
        """The entry's tensors when it is indexed, on disk and passes every check; None otherwise.
        A file that fails a check is deleted and counted (`refused_corrupt`); one still queued or
        gone (another process evicted it) is a plain miss."""
        if name not in self._index or name in self._pending:
            return None
        t0 = time.perf_counter()
        path = os.path.join(self.dir, name)
        try:
            with open(path, "rb") as f:
                data = bytearray(f.read())
        except OSError:
            self._forget(name)
            return None
        try:
            tensors = decode(data, kind, key, position, self.namespace, layout)
        except DiskEntryError as e:
            log.warning("disk cache: refused %s: %s; it is deleted and recomputed", name, e)
            _unlink(path)  # before unindexing: a write of the name, accepted only then, is never deleted here
            with self._lock:
                self._drop(name)
                self.counters.refused_corrupt += 1
            return None
        with self._lock:
            self.counters.reads += 1
            self.counters.read_seconds += time.perf_counter() - t0
            if name in self._index:  # the use: the last to be evicted now
                self._index.move_to_end(name)
        try:  # the use outlives the process: the next start orders entries by modification time
            os.utime(path)
        except OSError:
            pass
        return tensors

    def remove(self, name: str) -> None:
        """Delete an entry (queued behind any write of it)."""
        with self._lock:
            if self._drop(name) is not None:  # a write still queued runs first, then this delete
                self._jobs.put(("delete", name))

    def _forget(self, name: str) -> None:
        with self._lock:
            self._drop(name)

    def stats(self) -> dict:
        c = self.counters
        return {"bytes": self._used, "budget_bytes": self.budget_bytes, "files": len(self._index),
                "writes": c.writes, "write_bytes": c.write_bytes, "write_seconds": c.write_seconds,
                "write_errors": c.write_errors, "dropped_writes": c.dropped_writes, "reads": c.reads,
                "read_seconds": c.read_seconds, "refused_corrupt": c.refused_corrupt, "evictions": c.evictions}


def _unlink(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
