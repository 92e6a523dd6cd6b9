"""Errors the memory manager raises: each names the value, the limit and what to do."""
from __future__ import annotations


class MemoryBudgetError(ValueError):
    """The byte budget or pool sizes cannot hold the minimum (one KV block and one live slot)."""


class RequestTooLargeError(ValueError):
    """A request can never fit in the pools, whatever else finishes: refuse it at admission."""


class SnapshotMismatchError(ValueError):
    """A RequestSnapshot was taken on another model (fingerprint or layer shapes differ)."""


class RequestStateError(ValueError):
    """An operation was asked of a request in the wrong state (unknown id, not running, ...)."""
