"""Errors the memory manager raises: each names the value, the limit and what to do."""
from __future__ import annotations


class MemoryBudgetError(ValueError):
    """The byte budget or pool sizes cannot hold the minimum (one KV block and one live slot)."""


class RequestTooLargeError(ValueError):
    """A request can never fit in the pools, whatever else finishes: refuse it at admission."""


class SnapshotMismatchError(ValueError):
    """A RequestSnapshot cannot continue here: it was taken on another model (fingerprint or layer
    shapes differ), or it is malformed — a field of the wrong type or range, positions that
    disagree, an incomplete sampling state, tensors of the wrong shape, dtype or count, bytes that
    are not a snapshot — or its request id is in use. The one error of a refused import and of
    `snapshot_from_bytes`; the message names the field, the value and the rule. Raised before
    anything is allocated."""


class RequestStateError(ValueError):
    """An operation was asked of a request in the wrong state (unknown id, not running, ...)."""
