"""Speculative decoding's speed (issue 25): generated tokens per CPU second with speculation on,
as a ratio to speculation off measured in the same run (1 thread; the two alternate; median of
`--repeats` with min-max).

Workloads, on the built-in trained model (hybridkv/tiny-code, a small Bamba):
- copy: batch 1, a prompt that holds a stretch of standard-library source and then starts it
  again; the continuation repeats what the prompt holds (the n-gram drafter's case).
- wrong: the same requests with drafts that are never right (a drafter proposing tokens the
  model does not choose): what verification costs when it never pays, after adaptive k backs off.
- batch: 8 copy prompts at once.
- draft model (batch 1): the copy prompt with the built-in draft (hybridkv/tiny-code-draft, 2 layers
  of 128) proposing num_speculative_tokens = 4 greedily, inside the target's steps on pools of its own.
Each row also gives what a step costs (CPU ms): a plain decode step, a step of the speculating
engine (without drafting; probes and steps without a draft included), and drafting per step.
`--part costs` measures what verifying k drafted tokens costs against a plain decode step (drafts
that are always right: every step of that engine verifies k + 1 positions), from which the
arithmetic of where speculation pays follows (BENCHMARKS.md). `--part mtp` measures the MTP
drafter (`mtp_costs`) on a random Qwen3-Next of tiny-code's size with random `mtp.*` weights (no
trained checkpoint with an MTP head is on this machine): what the head costs a step, and the
speed against speculation off when a given share of its proposals is right (the proposals are
replaced by the true token at that rate; 'own' is the random head's). `--json PATH` also writes
the figures.

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
DRAFT = {"method": "draft_model", "model": "hybridkv/tiny-code-draft", "num_speculative_tokens": 4}


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

    def propose_many(self, asks):
        return [[(tokens[-1] + 1) % 96 + 4] * k for _, tokens, k in asks]

    def forget(self, request_id):
        pass


class Timed:
    """A drafter whose proposals' CPU time is summed in `seconds`."""

    def __init__(self, drafter):
        self.drafter, self.seconds = drafter, 0.0

    def propose_many(self, asks):
        t = time.process_time()
        try:
            return self.drafter.propose_many(asks)
        finally:
            self.seconds += time.process_time() - t

    def forget(self, request_id):
        self.drafter.forget(request_id)


class Known:
    """Drafts the continuation a plain run produced (`runs`: full token lists): always right."""

    def __init__(self, runs):
        self.runs = [list(r) for r in runs]

    def propose_many(self, asks):
        out = []
        for _, tokens, k in asks:
            n = len(tokens)
            out.append(next((r[n:n + k] for r in self.runs if len(r) > n and r[:n] == list(tokens)), []))
        return out

    def forget(self, request_id):
        pass


def verify_costs(args, params) -> dict:
    """CPU ms per step of an engine whose every decode verifies k always-right drafted tokens, as a
    ratio to a plain decode step, for k in 1, 3, 7, 12 (batch 1 and 8; the same repeats)."""
    from hybridkv import LLM

    out = {}
    for batch in (1, 8):
        prompts = copy_prompts(batch)
        off = LLM(MODEL, device="cpu", memory_budget_bytes=64 << 20)
        plain = off.generate(prompts, params, use_tqdm=False)
        runs = [off.engine.tokenizer(p)["input_ids"] + list(o.outputs[0].token_ids) for p, o in zip(prompts, plain)]
        engines = {}
        for k in (1, 3, 7, 12):
            llm = LLM(MODEL, device="cpu", memory_budget_bytes=64 << 20, speculative_config={
                "num_speculative_tokens": k, "off_when_slower": False})
            llm.engine.scheduler.speculation.drafter = Known(runs)
            engines[k] = llm
        for llm in (off, *engines.values()):
            run(llm, prompts, params)
        per = {k: [] for k in engines}
        for _ in range(args.repeats):
            t_off, _, s_off = run(off, prompts, params)
            for k, llm in engines.items():
                t, _, s = run(llm, prompts, params)
                per[k].append((t / s) / (t_off / s_off))
        out[batch] = {k: (statistics.median(v), min(v), max(v)) for k, v in per.items()}
    print("CPU time of a step verifying k drafted tokens / a plain decode step (median, min-max):")
    for batch, row in out.items():
        print(f"  batch {batch}: " + "; ".join(f"k={k} {m:.2f}x ({lo:.2f}-{hi:.2f})" for k, (m, lo, hi) in row.items()))
    return out


MTP_CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                  layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
                  num_experts=8, moe_intermediate_size=128, shared_expert_intermediate_size=256, mlp_only_layers=[])


class Steered:
    """Hands the MTP drafter the true token instead of each of the head's with probability p (`truth`:
    {prompt tuple: plain tokens}); p None keeps the head's own proposals."""

    def __init__(self, llm, truth, p):
        import random

        self.rng, self.p, self.llm, self.truth = random.Random(0), p, llm, truth
        drafter = llm.engine.scheduler.speculation.drafter
        self.record, drafter.record = drafter.record, self

    def __call__(self, drafts):
        out = {}
        for rid, (i, toks) in drafts.items():
            r = self.llm.manager.requests.get(rid)
            full = self.truth.get(tuple(r.token_ids[:r.num_prompt_tokens])) if r is not None else None
            if self.p is not None and full is not None:  # each chained token on its own
                toks = [full[i + j] if i + j < len(full) and self.rng.random() < self.p else t
                        for j, t in enumerate(toks)]
            out[rid] = (i, toks)
        self.record(out)


def mtp_costs(args, params) -> dict:
    """The MTP drafter at batch 1 on a random Qwen3-Next (MTP_CONFIG) with random MTP weights: CPU
    time per step with the head running and nothing drafted, against a plain step; generated
    tokens per CPU second against speculation off when a share p of the proposed tokens is right,
    one token a step (k = 1) and chained to k = 3."""
    import random
    import tempfile

    from hybridkv import LLM
    from hybridkv.models.tiny import add_tiny_mtp_weights, make_tiny_checkpoint

    path = add_tiny_mtp_weights(make_tiny_checkpoint("qwen3_next", tempfile.mkdtemp(), **MTP_CONFIG))
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 128) for _ in range(64)]]
    kw = dict(device="cpu", memory_budget_bytes=64 << 20)
    off = LLM(str(path), **kw)
    plain = off.generate(prompts, params, use_tqdm=False)
    truth = {tuple(p): list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, plain)}
    head_only = LLM(str(path), speculative_config={"method": "mtp", "off_when_slower": False,
                                                   "num_speculative_tokens": 1}, **kw)
    head_only.engine.scheduler.speculation.drafter.propose_many = lambda asks: [[] for _ in asks]
    engines = {"head, no drafts": head_only}
    for k, p in ((1, None), (1, 0.5), (1, 0.8), (1, 1.0), (3, None), (3, 0.8), (3, 1.0)):
        llm = LLM(str(path), speculative_config={"method": "mtp", "off_when_slower": False,
                                                 "num_speculative_tokens": k}, **kw)
        Steered(llm, truth, p)
        engines[f"k={k}, " + ("own proposals" if p is None else f"{p:.0%} right")] = llm
    for llm in (off, *engines.values()):
        run(llm, prompts, params)
    per = {name: [] for name in engines}
    steps = {name: [] for name in engines}
    for _ in range(args.repeats):
        t_off, n_off, s_off = run(off, prompts, params)
        for name, llm in engines.items():
            t, n, s = run(llm, prompts, params)
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == \
                [o.outputs[0].token_ids for o in plain], name
            per[name].append((n / t) / (n_off / t_off))
            steps[name].append((t / s) / (t_off / s_off))
    out = {}
    print("MTP drafter, batch 1, random Qwen3-Next (8 layers, hidden 256) with random mtp.* weights:")
    for name, llm in engines.items():
        s = llm.stats()
        acc = s["spec_accepted_tokens"] / s["spec_draft_tokens"] if s["spec_draft_tokens"] else 0.0
        out[name] = dict(ratio=statistics.median(per[name]), min=min(per[name]), max=max(per[name]),
                         step_ratio=statistics.median(steps[name]), acceptance=acc)
        r = out[name]
        print(f"  {name:20} tokens/s {r['ratio']:.2f}x ({r['min']:.2f}-{r['max']:.2f}) of speculation off; "
              f"a step {r['step_ratio']:.2f}x a plain step; acceptance {acc:.2f}")
    return out


def run(llm, prompts, params) -> tuple[float, int, int]:
    """(CPU seconds, generated tokens, engine steps) of one generate."""
    steps = llm.stats()["steps"]
    t = time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.process_time() - t, sum(len(o.outputs[0].token_ids) for o in outs), llm.stats()["steps"] - steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--json", default=None)
    ap.add_argument("--part", choices=["workloads", "costs", "mtp"], default="workloads")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from hybridkv import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    if args.part in ("costs", "mtp"):
        costs = verify_costs(args, params) if args.part == "costs" else mtp_costs(args, params)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(costs, f, indent=1)
        return 0
    off = LLM(MODEL, device="cpu", memory_budget_bytes=64 << 20)
    on = LLM(MODEL, device="cpu", memory_budget_bytes=64 << 20, speculative_config=SPEC)
    wrong = LLM(MODEL, device="cpu", memory_budget_bytes=64 << 20, speculative_config=SPEC)
    wrong.engine.scheduler.speculation.drafter = NeverRight()
    drafted = LLM(MODEL, device="cpu", memory_budget_bytes=64 << 20, speculative_config=DRAFT)
    for llm in (on, wrong, drafted):
        spec = llm.engine.scheduler.speculation
        spec.drafter = Timed(spec.drafter)
    workloads = {"copy (batch 1)": (copy_prompts(1), on), "wrong drafts (batch 1)": (copy_prompts(1), wrong),
                 "copy (batch 8)": (copy_prompts(8), on), "draft model (batch 1)": (copy_prompts(1), drafted)}
    rows = {}
    for name, (prompts, spec) in workloads.items():
        for llm in (off, spec):  # warm up: kernels built, prefix cache of the prompts filled alike
            run(llm, prompts, params)
        ratios, rates, same = [], [], True
        before = dict(spec.stats())
        timer = spec.engine.scheduler.speculation.drafter
        cost = {"plain": [0.0, 0], "spec": [0.0, 0], "draft": 0.0}
        for _ in range(args.repeats):
            t_off, n_off, s_off = run(off, prompts, params)
            d0 = timer.seconds
            t_on, n_on, s_on = run(spec, prompts, params)
            ratios.append((n_on / t_on) / (n_off / t_off))
            rates.append((n_off / t_off, n_on / t_on))
            cost["plain"][0] += t_off
            cost["plain"][1] += s_off
            cost["spec"][0] += t_on - (timer.seconds - d0)
            cost["spec"][1] += s_on
            cost["draft"] += timer.seconds - d0
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
                          mean_run=(accepted + runs) / runs if runs else 0.0, identical=same,
                          plain_step_ms=1e3 * cost["plain"][0] / max(1, cost["plain"][1]),
                          spec_step_ms=1e3 * cost["spec"][0] / max(1, cost["spec"][1]),
                          draft_ms_per_step=1e3 * cost["draft"] / max(1, cost["spec"][1]))
    print(f"{'workload':24} {'off tok/s':>10} {'on tok/s':>10} {'ratio (min-max)':>20} {'accept':>7} "
          f"{'tok/run':>7} {'plain ms':>9} {'spec ms':>8} {'draft ms':>9} identical")
    for name, r in rows.items():
        print(f"{name:24} {r['off_tok_s']:10.0f} {r['on_tok_s']:10.0f} {r['ratio']:8.2f}x ({r['min']:.2f}-{r['max']:.2f})"
              f" {r['acceptance']:7.2f} {r['mean_run']:7.2f} {r['plain_step_ms']:9.2f} {r['spec_step_ms']:8.2f}"
              f" {r['draft_ms_per_step']:9.2f} {r['identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["identical"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
