"""A burst: requests sharing a prefix nobody has computed, sent together (docs/design.md, burst rule).

    python benchmarks/bench_burst.py                # 16 requests, a cold 512-token prefix
    python benchmarks/bench_burst.py --small        # 8 requests, 128 tokens: what the test runs

For tiny Llama (pure attention, the reference) and tiny Bamba, Jamba and Qwen3-Next (hybrid),
each request is the shared prefix plus 10-40 tokens of its own; all go to `LLM.generate` at once
(greedy, 4 new tokens), with prefix caching on (the default policy) and off. Printed per family:
prefill tokens computed (prompt tokens minus prefix-hit tokens; no preemption happens), that
number over Llama's (goal <= 1.1x), the hit tokens, how often a follower waited for its leader,
and the CPU seconds until the LAST follower's first token with caching on and off (goal: on <=
off). Every output is checked against transformers' model of the same checkpoint (teacher
forced: each of our tokens must be its argmax) and against the caching-off run.
torch runs on one thread; times are `time.process_time`, the median of `--repeats` runs.
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import make_tiny_checkpoint

FAMILIES = ("llama", "bamba", "jamba", "qwen3_next")


def burst(n: int, prefix_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(4, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(4, vocab) for _ in range(rng.randint(10, 40))] for _ in range(n)]


def run_burst(path: str, prompts: list[list[int]], caching: bool, new_tokens: int) -> dict:
    """One burst through a fresh engine: outputs, prefill tokens computed, waits, last TTFT."""
    llm = LLM(path, memory_budget_bytes=256 << 20, max_num_seqs=len(prompts), max_num_batched_tokens=4096,
              enable_prefix_caching=caching)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.process_time()
    ids = [llm.add_request(p, params) for p in prompts]
    first_token, done = {}, {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.outputs[0].token_ids and out.request_id not in first_token:
                first_token[out.request_id] = time.process_time() - t0
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    s = llm.stats()
    assert sum(s["preemptions"].values()) == 0, s["preemptions"]
    return {"outputs": [done[i] for i in ids], "hit_tokens": s["prefix_hit_tokens"],
            "prefill_tokens": sum(len(p) for p in prompts) - s["prefix_hit_tokens"],
            "waits": s.get("burst_waits", 0), "last_ttft": first_token[ids[-1]], "steps": s["steps"]}


def check_against_transformers(path: str, prompts: list[list[int]], outputs: list[list[int]]) -> int:
    """Teacher-forced: each generated token must be transformers' argmax (a 1e-6 log-prob tie
    counts as equal). Returns the number of prompts checked."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        for p, out in zip(prompts, outputs):
            logits = hf(torch.tensor([p + out])).logits[0, len(p) - 1: len(p) - 1 + len(out)]
            lp = torch.log_softmax(logits.float(), -1)
            for step, tok in enumerate(out):
                gap = (lp[step].max() - lp[step, tok]).item()
                assert gap <= 1e-6, f"{path}: step {step} ours {tok}, transformers {int(lp[step].argmax())}"
    return len(prompts)


def measure(families, n: int, prefix_len: int, new: int, repeats: int) -> list[dict]:
    """One row per family: prefill tokens with caching on and off, hits, waits, last-follower TTFT."""
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for fam in families:
            path = str(make_tiny_checkpoint(fam, Path(d) / fam, max_position_embeddings=2048))
            prompts = burst(n, prefix_len, 128, seed=1)
            on = [run_burst(path, prompts, True, new) for _ in range(repeats)]
            off = [run_burst(path, prompts, False, new) for _ in range(repeats)]
            assert on[0]["outputs"] == off[0]["outputs"], f"{fam}: caching changed the outputs"
            checked = check_against_transformers(path, prompts, on[0]["outputs"])
            ttft_on = [r["last_ttft"] for r in on]
            ttft_off = [r["last_ttft"] for r in off]
            rows.append(dict(family=fam, prefill=on[0]["prefill_tokens"], off=off[0]["prefill_tokens"],
                             hits=on[0]["hit_tokens"], waits=on[0]["waits"], checked=checked, n=n,
                             ttft_on=statistics.median(ttft_on), ttft_off=statistics.median(ttft_off),
                             ttft_on_range=(min(ttft_on), max(ttft_on)),
                             ttft_off_range=(min(ttft_off), max(ttft_off))))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    n, prefix_len, new = (8, 128, 3) if args.small else (16, 512, 4)
    print(f"# burst: {n} requests, shared cold prefix of {prefix_len} tokens + 10-40 own, {new} new tokens; "
          f"{platform.machine()} CPU, torch {torch.__version__}, 1 thread, {args.repeats} repeats")
    rows = measure(args.families, n, prefix_len, new, args.repeats)
    llama = next((r["prefill"] for r in rows if r["family"] == "llama"), None)
    print("| family | prefill tokens computed (caching off) | / Llama's | hit tokens | follower waits | "
          "last follower TTFT, caching on (min-max) | caching off (min-max) | on / off | vs transformers |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ms = lambda x: f"{x * 1e3:.0f}"  # noqa: E731
    for r in rows:
        ratio = f"{r['prefill'] / llama:.2f}x" if llama else "n/a"
        print(f"| {r['family']} | {r['prefill']} ({r['off']}) | {ratio} | {r['hits']} | {r['waits']} | "
              f"{ms(r['ttft_on'])} ms ({ms(r['ttft_on_range'][0])}-{ms(r['ttft_on_range'][1])}) | "
              f"{ms(r['ttft_off'])} ms ({ms(r['ttft_off_range'][0])}-{ms(r['ttft_off_range'][1])}) | "
              f"{r['ttft_on'] / r['ttft_off']:.2f} | {r['checked']}/{n} identical |")
    if llama:
        worst = max(r["prefill"] / llama for r in rows)
        print(f"worst prefill / Llama's: {worst:.2f}x (goal <= 1.10x); "
              f"worst last-follower TTFT on / off: {max(r['ttft_on'] / r['ttft_off'] for r in rows):.2f} (goal <= 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
