"""The engine's inbox for other threads: adds and aborts queue here and are applied in call order
at the start of the next step, or at once when no step runs.

`step()` is held while the queues and the memory manager change (a step, an export or import);
`lock` guards the request table's ids and the queued operations.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable


class RequestInbox:
    """apply(ops): applies a list of ("add" | "abort", argument) in order; called with both locks
    held."""

    def __init__(self, apply: Callable[[list[tuple[str, object]]], None]):
        self._apply = apply
        self._ops: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self._stepping = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._ops)

    @property
    def stepping(self) -> bool:
        """Whether a step (or export / import) holds the engine now."""
        return self._stepping.locked()

    def put(self, op: str, arg) -> None:
        """Queue an operation (caller holds `lock`); applied now when no step runs."""
        self._ops.append((op, arg))
        if self._stepping.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._stepping.release()

    @contextmanager
    def step(self):
        """Hold the engine for a step (or an export / import), the queued operations applied first."""
        with self._stepping:
            with self.lock:
                self._drain()
            yield

    def _drain(self) -> None:
        ops, self._ops = self._ops, []
        self._apply(ops)
