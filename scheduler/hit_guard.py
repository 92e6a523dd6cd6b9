"""The prefix-hit guard (`verify_cache_hits=p`, issue 26): a sampled fraction p of prefix hits is
recomputed cold in the background of the same engine and the first new token's logits compared.

When an admission hits a cached prefix (its KV, and a state checkpoint from either tier), with
probability p (an RNG seeded by the engine's seed) the scheduler also queues a SHADOW request:
the same tokens, greedy, one token, a cache salt of its own (so it cannot hit: the whole prompt
is computed cold) and the lowest priority (it runs when nothing else waits). The model runner
keeps the raw logits of the row that samples each one's first token (`ScheduledChunk.keep_logits`);
when both are in they are compared: a match is max |hit - cold| <= tol * max(1, max |cold|), tol
= TOLERANCE[the model's dtype] (1e-3 for float32, 3e-2 for 16-bit weights: chunking and batching
change float sums by far less; a wrong state changes them by more), or under quantized caches
QUANTIZED_TOLERANCE[the cache dtype] if larger (a hit reads rounded KV and state, the cold run not). A mismatch is counted
(`cache_hit_mismatches`), logged with the entry's key and position, and the entry is invalidated
(its state checkpoint dropped from the device and the host tier) so no later request uses it.
The user's request is not held back: the check is after the fact, on the engine's own time.
A shadow reports no output; either side ending first (abort, failure) drops the pair.
"""
from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass
from typing import Callable, Hashable, Optional

import torch

from hybridkv.request import Request
from hybridkv.sampling_params import SamplingParams

log = logging.getLogger(__name__)

TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.bfloat16: 3e-2, torch.float16: 3e-2}  # x max(1, max |cold|)
# Under a quantized cache dtype a hit reads quantized KV and state where the cold run may have computed
# the prefix at full precision: measured up to 4.4e-3 (int8) and 7.9e-3 (fp8_e4m3) x max |cold| on a
# tiny random Qwen3-Next and 3.6e-4 / 1.5e-3 on tiny-code, 200-token prefixes in chunks of 64. Errors
# below these go unseen there (BENCHMARKS.md, "Quantized caches": what a zeroed state gives)
QUANTIZED_TOLERANCE = {"int8": 5e-3, "fp8_e4m3": 1e-2}
LOWEST = 2 ** 31     # a shadow's priority: after every user request (lower runs first)


@dataclass
class _Pair:
    hit: Hashable          # the user's request id
    shadow: Hashable       # the shadow's id
    key: bytes             # the hit's block hash: the entry's key
    position: int          # the hit length in tokens
    hit_logits: Optional[torch.Tensor] = None
    cold_logits: Optional[torch.Tensor] = None


class HitGuard:
    """p: the fraction of hits checked (0 < p <= 1); seed: the sampling RNG's seed;
    invalidate(key): drop the entry keyed `key` from every tier (the scheduler's manager call);
    dtype: the model's weights' dtype, which sets the tolerance; cache_dtypes: the engine's
    kv_cache_dtype and state_cache_dtype, which widen it (QUANTIZED_TOLERANCE)."""

    def __init__(self, p: float, seed: int, invalidate: Callable[[bytes], None], dtype=torch.float32,
                 cache_dtypes: tuple = ()):
        if not 0.0 < p <= 1.0:
            raise ValueError(f"verify_cache_hits={p!r}; give a fraction in (0, 1] (0 turns the guard off)")
        self.p, self.rng, self.invalidate = p, random.Random(seed), invalidate
        self.tolerance = max([TOLERANCE.get(dtype, 3e-2)] + [QUANTIZED_TOLERANCE[d] for d in cache_dtypes
                                                             if d in QUANTIZED_TOLERANCE])
        self._pairs: dict[Hashable, _Pair] = {}  # by both of its request ids
        self._serial = itertools.count()
        self.counters = {"cache_hit_checks": 0, "cache_hit_mismatches": 0}

    def on_hit(self, seq: Request, hit: int, block_size: int) -> Optional[Request]:
        """Called once per first admission of `seq` with a prefix hit of `hit` tokens (> 0):
        the shadow request to queue, or None when this hit is not sampled."""
        if self.rng.random() >= self.p or seq.request_id in self._pairs:
            return None
        sid = ("verify", next(self._serial))
        salt = f"{seq.cache_salt or ''}\x1fverify:{sid[1]}"
        shadow = Request(sid, seq.token_ids, SamplingParams(max_tokens=1, temperature=0.0), max_tokens=1,
                         priority=LOWEST, cache_salt=salt, adapter_id=seq.adapter_id, mm_hashes=seq.mm_hashes)
        pair = _Pair(seq.request_id, sid, seq.block_hashes[hit // block_size - 1], hit)
        self._pairs[seq.request_id] = self._pairs[sid] = pair
        return shadow

    @property
    def busy(self) -> bool:
        """Whether a check is under way (a shadow or its hit still to run)."""
        return bool(self._pairs)

    def wants_logits(self, rid: Hashable) -> bool:
        """Whether the runner should keep this request's first sampled row's logits."""
        p = self._pairs.get(rid)
        return p is not None and (p.hit_logits if rid == p.hit else p.cold_logits) is None

    def observe(self, kept: dict[Hashable, torch.Tensor]) -> list[bytes]:
        """Take the logits kept this step ({request id: [vocab]}); compare every pair now
        complete. Returns the keys found wrong (already invalidated, counted and logged)."""
        wrong = []
        for rid, logits in kept.items():
            p = self._pairs.get(rid)
            if p is None:
                continue
            if rid == p.hit:
                p.hit_logits = logits
            else:
                p.cold_logits = logits
            if p.hit_logits is None or p.cold_logits is None:
                continue
            del self._pairs[p.hit], self._pairs[p.shadow]
            self.counters["cache_hit_checks"] += 1
            diff = float((p.hit_logits - p.cold_logits).abs().max())
            limit = self.tolerance * max(1.0, float(p.cold_logits.abs().max()))
            if diff > limit:
                self.counters["cache_hit_mismatches"] += 1
                log.error("prefix hit of request %r does not match its cold recompute: entry key %s at "
                          "position %d, max |logits difference| %.4g > %.4g; the entry is invalidated",
                          p.hit, p.key.hex(), p.position, diff, limit)
                self.invalidate(p.key)
                wrong.append(p.key)
        return wrong

    def forget(self, rid: Hashable) -> None:
        """`rid` ended: a pair still waiting for its logits is dropped (the other side, if it
        runs on, is then ignored)."""
        p = self._pairs.get(rid)
        if p is not None and (p.hit_logits if rid == p.hit else p.cold_logits) is None:
            self._pairs.pop(p.hit, None), self._pairs.pop(p.shadow, None)
