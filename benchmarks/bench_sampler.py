"""The batched sampler against the row loop it replaced: one step of R rows over a V vocabulary,
greedy / temperature / top-p (and top-p with penalties, which the old one did not have).

    python benchmarks/bench_sampler.py [--rows 32 --vocab 131072 --repeats 7]

One thread (torch.set_num_threads(1)), CPU time (time.process_time), both samplers alternating
in one process on the same logits, median (min-max) of the repeats. `row_loop_sampler` is the old
scheduler/sampler.py (Python loop over rows, the whole [R, V] logits copied to the host), kept
here only as the baseline.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.sampler import SampleRow, Sampler


def _old_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p
        drop[0] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def row_loop_sampler(logits: torch.Tensor, params: list[SamplingParams], gen: torch.Generator) -> list[int]:
    """The old sampler: argmax for all, then per sampled row on the host: filter, softmax, draw."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        host = logits[sampled].cpu()
        for j, i in enumerate(sampled):
            p = params[i]
            row = _old_filter(host[j] / p.temperature, p.top_k, p.top_p)
            tokens[i] = int(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=gen).item())
    return tokens


# name -> (params, logits scale). Scale 4: a peaked row whose 0.9 nucleus lies within the top
# 1024 tokens; scale 0.5: a flat row whose nucleus is wider (the new sampler then sorts it fully).
CASES = {
    "greedy": (SamplingParams(temperature=0.0), 4.0),
    "temperature": (SamplingParams(temperature=0.8), 4.0),
    "top-p": (SamplingParams(temperature=0.8, top_p=0.9), 4.0),
    "top-p, flat logits (wide nucleus)": (SamplingParams(temperature=0.8, top_p=0.9), 0.5),
    "top-p + penalties": (SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1,
                                         presence_penalty=0.5, frequency_penalty=0.3), 4.0),
}


def measure(rows: int, vocab: int, repeats: int, context: int = 512) -> list[dict]:
    """Per case: old and new CPU seconds per step (median, min, max over `repeats`)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(rows, vocab, generator=g)
    ids = torch.randint(0, vocab, (rows, context), generator=g).tolist()
    out = []
    for name, (p, scale) in CASES.items():
        logits = base * scale
        params = [p] * rows
        sample_rows = [SampleRow(p, 0, context // 2, ids[r], context // 2) for r in range(rows)]
        sampler, gen = Sampler(seed=0), torch.Generator().manual_seed(0)
        times = {"old": [], "new": []}
        for _ in range(repeats):  # alternate: any drift of the machine hits both alike
            if name != "top-p + penalties":
                t0 = time.process_time()
                row_loop_sampler(logits, params, gen)
                times["old"].append(time.process_time() - t0)
            t0 = time.process_time()
            sampler(logits, sample_rows)
            times["new"].append(time.process_time() - t0)
        row = {"case": name}
        for k, v in times.items():
            if v:
                row[k] = (statistics.median(v), min(v), max(v))
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    print(f"# {a.rows} rows x {a.vocab} vocab, 1 thread, CPU ms per step, median (min-max) of {a.repeats}; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    print("| case | row loop (old) | batched (new) | speed-up |")
    print("|---|---|---|---|")
    for r in measure(a.rows, a.vocab, a.repeats):
        new = r["new"]
        old = r.get("old")
        fmt = lambda m: f"{m[0] * 1e3:.1f} ({m[1] * 1e3:.1f}-{m[2] * 1e3:.1f})"  # noqa: E731
        print(f"| {r['case']} | {fmt(old) if old else 'n/a'} | {fmt(new)} | "
              f"{f'{old[0] / new[0]:.1f}x' if old else '-'} |")


if __name__ == "__main__":
    main()
