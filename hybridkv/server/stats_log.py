"""The periodic engine stats line (as vLLM's "Avg prompt throughput ... KV cache usage"), logged
by the engine thread every `interval` seconds in which the engine stepped."""
from __future__ import annotations

import logging
import time

log = logging.getLogger("hybridkv.engine")


class StatsLogger:
    """Throughput over the last interval plus the engine's gauges, one INFO line per interval."""

    def __init__(self, interval: float):
        self.interval = interval  # 0: never log
        self._last = time.monotonic()
        self._last_steps = -1
        self._last_generated = 0
        self._prompt_tokens = 0  # prompt tokens computed (not from the prefix cache) since the last line

    def on_prompt(self, computed_tokens: int) -> None:
        """A request's prompt was computed: `computed_tokens` of it were not prefix-cache hits."""
        self._prompt_tokens += computed_tokens

    def maybe_log(self, stats_fn) -> None:
        """Log a line if `interval` passed and the engine stepped since the last one; `stats_fn()`
        is `LLM.stats()` (only called when a line may be due)."""
        now = time.monotonic()
        if not self.interval or now - self._last < self.interval:
            return
        s = stats_fn()
        if s["steps"] != self._last_steps:
            log.info(stats_line(s, self._prompt_tokens / (now - self._last),
                                (s["generated_tokens"] - self._last_generated) / (now - self._last)))
        self._last, self._last_steps = now, s["steps"]
        self._last_generated, self._prompt_tokens = s["generated_tokens"], 0


def stats_line(s: dict, prompt_tps: float, generation_tps: float) -> str:
    """One log line from `LLM.stats()` and the throughputs (tokens/s) of the last interval."""
    used = s["kv_blocks_used"] / (s["kv_blocks_total"] or 1)
    return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: "
            f"{generation_tps:.1f} tokens/s, Running: {s['running']} reqs, Waiting: {s['waiting']} reqs, "
            f"Swapped: {s['swapped']} reqs, KV cache usage: {used:.1%} ({s['kv_blocks_used']}/"
            f"{s['kv_blocks_total']} blocks, {s['kv_blocks_cached']} cached), State slots: "
            f"{s['state_slots_live']} live, {s['state_slots_checkpoint']} checkpoints, "
            f"{s['state_slots_total']} total, Prefix cache hit rate: {s['prefix_hit_rate']:.1%}, "
            f"Preemptions: {s['preemptions']}")
