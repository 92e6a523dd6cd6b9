"""Time to first token of a long prompt served from the host tier vs a cold prefill (issue 26's
promotion goal: <= 0.3x), on the built-in hybridkv/tiny-code (a tiny Bamba), CPU, one run.

    python benchmarks/bench_tier_ttft.py                      # 1024- and 2048-token prefixes, 5 repeats
    python benchmarks/bench_tier_ttft.py --lengths 256 --repeats 3   # what the test runs

Each repeat takes a fresh random prefix P (block-aligned) and, untimed: computes P once (its
prompt-end state becomes a device checkpoint), then runs short prompts until the device slots
(2 checkpoint slots, LRU eviction so that the short prompts push it out) demote P's state to the
host tier. Then, alternating which goes first, two timed requests for P + 16 new tokens, one
token each: "cold" with a cache_salt of its own (so it cannot hit: the whole prompt is prefilled)
and "host" (its state promoted from the host tier into a live slot, its KV still cached; only the
16 new tokens are computed). The script checks that each host request hit the host tier (and not
the device) and that both give the same first token. Time to first token is `generate`'s CPU
time (1 torch thread; wall time beside it); the promotion's own copy time is the host tier's
`promotion_seconds`. Printed: median and min-max of each, and the ratio host / cold.
"""
from __future__ import annotations

import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from hybridkv import LLM, SamplingParams
from hybridkv.plan import kv_bytes_per_block, state_bytes_per_slot

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ttft_cli.py beside this file
import ttft_cli  # noqa: E402

MODEL = str(Path(__file__).resolve().parents[1] / "hybridkv" / "builtin_models" / "tiny-code")
BLOCK = ttft_cli.BLOCK
SUFFIX = 16


def make_llm(max_len: int) -> LLM:
    """tiny-code with one live slot, 2 device checkpoint slots, a host tier of 64 states and
    KV for several prompts of `max_len` tokens (KV is never what limits the hit)."""
    probe = LLM(MODEL, memory_budget_bytes=64 << 20)
    specs = probe.model.cache_specs()
    blocks = 6 * (max_len + SUFFIX) // BLOCK + 64
    slot = state_bytes_per_slot(specs)
    budget = kv_bytes_per_block(specs, BLOCK) * blocks + slot * (1 + 1 + 2)  # null, live, 2 checkpoints
    llm = LLM(MODEL, max_num_seqs=1, checkpoint_share=2.5 * slot / budget, checkpoint_eviction="lru",
              max_model_len=max_len + 2 * SUFFIX, memory_budget_bytes=budget, host_cache_bytes=64 * slot)
    if llm.manager.num_slots != 4:
        raise RuntimeError(f"expected 4 state slots (null, live, 2 checkpoints), got {llm.manager.num_slots}")
    return llm


def _first_token(llm: LLM, prompt) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, token) of one greedy token for `prompt`."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return time.process_time() - c0, time.perf_counter() - t0, out.outputs[0].token_ids[0]


def _host(llm: LLM) -> dict:
    return llm.stats()["checkpoint_tiers"]["host"]


def measure(llm: LLM, length: int, repeats: int, seed: int = 0) -> dict:
    """Alternating cold / host-tier first tokens for `repeats` fresh prefixes of `length` tokens."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(4, 500) for _ in range(n)]  # noqa: E731
    cold, host, cold_wall, host_wall, promo = [], [], [], [], []
    for i in range(-1, repeats):  # i = -1: a warm-up pair, not reported
        prefix = tok(length)
        _first_token(llm, prefix)  # untimed: P's state becomes a device checkpoint
        for _ in range(3):  # untimed: push it to the host tier
            _first_token(llm, tok(2 * BLOCK))
        dev = llm.stats()["checkpoint_tiers"]["device"]["hits"]
        before = _host(llm)
        prompt = prefix + tok(SUFFIX)
        runs = {}
        for which in (("cold", "host") if i % 2 == 0 else ("host", "cold")):
            p = {"prompt_token_ids": prompt, "cache_salt": f"cold-{length}-{i}"} if which == "cold" else prompt
            runs[which] = _first_token(llm, p)
        after = _host(llm)
        if after["hits"] - before["hits"] != 1 or llm.stats()["checkpoint_tiers"]["device"]["hits"] != dev:
            raise RuntimeError(f"the host request did not hit the host tier: {before} -> {after}")
        if runs["cold"][2] != runs["host"][2]:
            raise RuntimeError(f"first tokens differ: cold {runs['cold'][2]}, host {runs['host'][2]}")
        if i >= 0:
            cold.append(runs["cold"][0]), host.append(runs["host"][0])
            cold_wall.append(runs["cold"][1]), host_wall.append(runs["host"][1])
            promo.append(after["promotion_seconds"] - before["promotion_seconds"])
    med = statistics.median
    return {"length": length, "repeats": repeats, "cold_s": cold, "host_s": host, "cold_wall_s": cold_wall,
            "host_wall_s": host_wall, "promotion_s": promo, "ratio": med(host) / med(cold),
            "ratio_wall": med(host_wall) / med(cold_wall)}


def report(r: dict) -> str:
    ms = ttft_cli.ms
    return (f"prefix {r['length']} + {SUFFIX} tokens, {r['repeats']} alternating repeats, median (min-max):\n"
            f"  cold prefill, CPU time to first token:     {ms(r['cold_s'])}\n"
            f"  host-tier hit, CPU time to first token:    {ms(r['host_s'])}\n"
            f"    of which the promotion's copy:           {ms(r['promotion_s'])}\n"
            f"  ratio host / cold: {r['ratio']:.3f} CPU, {r['ratio_wall']:.3f} wall (goal <= 0.3)")


def main(argv=None) -> list[dict]:
    lengths, repeats = ttft_cli.parse(argv, __doc__.split("\n")[0])
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch thread, torch {torch.__version__}, "
          f"model hybridkv/tiny-code")
    llm = make_llm(max(lengths))
    out = []
    for n in lengths:
        out.append(measure(llm, n, repeats))
        print(report(out[-1]), flush=True)
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
