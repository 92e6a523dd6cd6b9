"""The engine's stats dict (`Engine.stats()`, the server's /metrics and log lines): the manager's
pools and prefix hits, the engine's counters, the queues' lengths, throughput."""
from __future__ import annotations

from hybridkv.manager_stats import ManagerStats

from .scheduler import Scheduler


def engine_stats(m: ManagerStats, counters: dict, scheduler: Scheduler) -> dict:
    """Pools (blocks, slots), prefix hits and why requests missed, preemptions, tokens/s
    (processed and generated tokens over the seconds spent in model steps)."""
    c = counters
    secs = c["model_seconds"]
    return {
        "kv_blocks_used": m.kv_blocks_used, "kv_blocks_cached": m.kv_blocks_cached,
        "kv_blocks_total": m.kv_blocks_total, "state_slots_live": m.slots_live,
        "state_slots_checkpoint": m.slots_checkpoint, "state_slots_total": m.slots_total,
        "prefix_hit_tokens": m.prefix_hit_tokens, "prefix_query_tokens": m.prefix_query_tokens,
        "prefix_hit_rate": m.prefix_hit_rate, "prefix_misses": dict(m.prefix_misses),
        "preemptions": dict(m.preemptions), "burst_waits": m.burst_waits, "swaps": c["swaps_out"],
        "migrations": {"out": c["migrations_out"], "in": c["migrations_in"]},
        "forks": c["forks"], "aborted": c["aborted"], "failed": c["failed"],
        "fragmentation": m.fragmentation, "checkpoint_tiers": m.tiers, "cache_pins": m.pins,
        "running": len(scheduler.running), "waiting": len(scheduler.waiting),
        "swapped": len(scheduler.swapped), "steps": c["steps"],
        "generated_tokens": c["generated_tokens"],
        "tokens_per_second": c["processed_tokens"] / secs if secs else 0.0,  # prompt + decode
        "generated_tokens_per_second": c["generated_tokens"] / secs if secs else 0.0,
        "cache_hit_checks": c.get("cache_hit_checks", 0),  # the hit guard's (hit_guard.py)
        "cache_hit_mismatches": c.get("cache_hit_mismatches", 0),
        **speculation_stats(c),
    }


def speculation_stats(c: dict) -> dict:
    """Speculative decoding's counters (zeros when it is off): verification runs, drafted and
    accepted tokens, the acceptance rate and the mean tokens a run yields (accepted + 1)."""
    runs, drafted, accepted = (c.get(k, 0) for k in ("spec_verify_runs", "spec_draft_tokens", "spec_accepted_tokens"))
    return {"spec_verify_runs": runs, "spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_mean_accepted_length": (accepted + runs) / runs if runs else 0.0,
            # a draft model's work in the target's steps (zeros for the other drafters)
            "spec_draft_model": {k: c.get(f"draft_{k}", 0) for k in
                                 ("forwards", "real_tokens", "speculative_tokens", "evictions")}}
