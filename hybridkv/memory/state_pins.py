"""Pinned turns' state checkpoints (prefix_cache.pin, SamplingParams.cache_pin_ttl_s): which state
keys are pinned, until when, and how many pins were lost before their deadline.

A pin belongs to the key, not to a tier: a pinned state evicted from the device slots is demoted
to the host tier still pinned (memory/state_checkpoints.py), and the host tier keeps it by its own rule
(memory/host_tier.py). So a pin is lost (`reclaimed`, counted) only when its state leaves EVERY
tier before the deadline; the key then leaves this map too, so no later state kept under the same
key inherits the pin, and the map never holds a key that no tier holds (once the release that
keeps a pinned turn's final state has run).
"""
from __future__ import annotations

import time


class StatePins:
    """until: {state key: monotonic deadline}; reclaimed: pins whose state left every tier before
    its deadline."""

    def __init__(self):
        self.until: dict[bytes, float] = {}
        self.reclaimed = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.until

    def __bool__(self) -> bool:
        return bool(self.until)

    def pin(self, key: bytes, until: float) -> None:
        """Pin the state keyed `key` (kept now, or by the release that follows) until `until`."""
        self.until[key] = max(until, self.until.get(key, until))

    def pinned(self, key: bytes) -> bool:
        """Whether `key` is pinned now (a pin past its deadline is no pin)."""
        return self.until.get(key, 0.0) > time.monotonic()

    def expire(self) -> None:
        """Drop the pins past their deadline."""
        now = time.monotonic()
        for key in [k for k, t in self.until.items() if t <= now]:
            del self.until[key]

    def left(self, key: bytes) -> None:
        """The state keyed `key` left every tier: its pin goes, counted when before its deadline."""
        if self.until.pop(key, 0.0) > time.monotonic():
            self.reclaimed += 1

    def never_kept(self, key: bytes) -> None:
        """A pinned turn's final state was not kept at all (no live state to keep): its pin goes,
        uncounted (nothing was ever findable under it)."""
        self.until.pop(key, None)

    def live(self, held) -> int:
        """Pins before their deadline whose state `held(key)` (some tier holds it)."""
        now = time.monotonic()
        return sum(1 for k, t in self.until.items() if t > now and held(k))
