"""Speculative decoding's speed (issue 25): generated tokens per CPU second with speculation on,
as a ratio to speculation off measured in the same run (1 thread; the two alternate; median of
`--repeats` with min-max).

Workloads, on the built-in trained model (hybridkv/tiny-code, a small Bamba):
- copy: batch 1, a prompt that holds a stretch of standard-library source and then starts it
  again; the continuation repeats what the prompt holds (the n-gram drafter's case).
- wrong: the same requests with drafts that are never right (a drafter proposing tokens the
  model does not choose): what verification costs when it never pays, after adaptive k backs off.
- batch: 8 copy prompts at once.
Prints one table; `--json PATH` also writes the figures.

    python benchmarks/bench_speculative.py --repeats 5
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

import torch

MODEL = "hybridkv/tiny-code"
SPEC = {"method": "ngram", "num_speculative_tokens": 12, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def copy_prompts(n: int) -> list[str]:
    """n prompts: a function of the standard library, a blank line, then its first lines again."""
    import collections
    import json as json_module
    import textwrap

    sources = [textwrap.dedent(inspect.getsource(f)) for f in (
        json_module.dumps, collections.Counter.most_common, textwrap.wrap, textwrap.indent, statistics.median,
        statistics.mean, json_module.loads, textwrap.dedent)]
    out = []
    for src in sources[:n]:
        body = src[:1500]
        head = "\n".join(body.split("\n")[:3])
        out.append(body + "\n\n" + head + "\n")
    return out


class NeverRight:
    """Drafts k copies of a token the model never chose at this point (the last token + 1)."""

    def propose(self, request_id, tokens, k):
        return [(tokens[-1] + 1) % 96 + 4] * k

    def forget(self, request_id):
        pass


def run(llm, prompts, params) -> tuple[float, int]:
    t = time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.process_time() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from hybridkv import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    off = LLM(MODEL, device="cpu", memory_budget_bytes=64 << 20)
    on = LLM(MODEL, device="cpu", memory_budget_bytes=64 << 20, speculative_config=SPEC)
    wrong = LLM(MODEL, device="cpu", memory_budget_bytes=64 << 20, speculative_config=SPEC)
    wrong.engine.scheduler.speculation.drafter = NeverRight()
    workloads = {"copy (batch 1)": (copy_prompts(1), on), "wrong drafts (batch 1)": (copy_prompts(1), wrong),
                 "copy (batch 8)": (copy_prompts(8), on)}
    rows = {}
    for name, (prompts, spec) in workloads.items():
        for llm in (off, spec):  # warm up: kernels built, prefix cache of the prompts filled alike
            run(llm, prompts, params)
        ratios, rates, same = [], [], True
        before = dict(spec.stats())
        for _ in range(args.repeats):
            t_off, n_off = run(off, prompts, params)
            t_on, n_on = run(spec, prompts, params)
            ratios.append((n_on / t_on) / (n_off / t_off))
            rates.append((n_off / t_off, n_on / t_on))
        s = spec.stats()
        drafted = s["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = s["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        runs = s["spec_verify_runs"] - before["spec_verify_runs"]
        a = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
        same = a == b
        rows[name] = dict(ratio=statistics.median(ratios), min=min(ratios), max=max(ratios),
                          off_tok_s=statistics.median(r[0] for r in rates), on_tok_s=statistics.median(r[1] for r in rates),
                          acceptance=accepted / drafted if drafted else 0.0,
                          mean_run=(accepted + runs) / runs if runs else 0.0, identical=same)
    print(f"{'workload':24} {'off tok/s':>10} {'on tok/s':>10} {'ratio (min-max)':>20} {'accept':>7} "
          f"{'tok/run':>7} identical")
    for name, r in rows.items():
        print(f"{name:24} {r['off_tok_s']:10.0f} {r['on_tok_s']:10.0f} {r['ratio']:8.2f}x ({r['min']:.2f}-{r['max']:.2f})"
              f" {r['acceptance']:7.2f} {r['mean_run']:7.2f} {r['identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["identical"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
