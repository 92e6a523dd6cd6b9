"""Time to first token of a long prompt served from the disk tier after a restart vs a cold
prefill, on the built-in hybridkv/tiny-code (a tiny Bamba), CPU, 1 torch thread.

    python benchmarks/bench_disk_ttft.py                         # 1024- and 2048-token prefixes, 5 repeats
    python benchmarks/bench_disk_ttft.py --lengths 256 --repeats 3

Phase 1: an engine with a disk tier in a fresh directory answers P_i + 16 tokens for repeats + 1
random prefixes P_i per length (so each P_i's state at its end and its KV are written through),
then is closed (every write done); its writer's time per entry is printed, and the phase's wall
time beside that of an engine without a disk tier answering the same prompts (alternating), the
write-through's cost on the step (the copies to the host; the files are the writer thread's). Phase 2: a
NEW engine on the same directory (a restart: nothing on its device) answers, alternating which
goes first, P_i + 16 other tokens twice, one token each: "cold" under a cache_salt of its own
(no hit: the whole prompt is prefilled) and "disk" (the state and KV of P_i are read from disk,
checked and promoted; only the 16 new tokens are computed). The script checks that each disk
request hit the disk tier with len(P_i) cached tokens and that both give the same first token.
Time to first token is `generate`'s wall time (reading files is I/O, not CPU); the promotion's
own time (read, check, copy in) is the disk tier's `promotion_seconds`. Printed: median and
min-max of each (the first prefix is a warm-up), and the ratio disk / cold.
"""
from __future__ import annotations

import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridkv import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ttft_cli.py beside this file
import ttft_cli  # noqa: E402

MODEL = str(Path(__file__).resolve().parents[1] / "hybridkv" / "builtin_models" / "tiny-code")
BLOCK = ttft_cli.BLOCK
SUFFIX = 16
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def make_llm(max_len: int, cache_dir) -> LLM:
    return LLM(MODEL, max_num_seqs=1, max_model_len=max_len + 2 * SUFFIX, memory_budget_bytes=256 << 20,
               disk_cache_dir=cache_dir)


def _first(llm: LLM, prompt) -> tuple[float, int, int]:
    """(wall seconds, token, cached tokens) of one greedy token for `prompt`."""
    t0 = time.perf_counter()
    out = llm.generate([prompt], ONE, use_tqdm=False)[0]
    return time.perf_counter() - t0, out.outputs[0].token_ids[0], out.num_cached_tokens


def _disk(llm: LLM) -> dict:
    return llm.stats()["checkpoint_tiers"]["disk"]


def measure(lengths: list[int], repeats: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(4, 500) for _ in range(n)]  # noqa: E731
    prefixes = {n: [tok(n) for _ in range(repeats + 1)] for n in lengths}
    with tempfile.TemporaryDirectory(prefix="bench-disk-") as d:
        first, plain = make_llm(max(lengths), d), make_llm(max(lengths), None)
        write_through, no_disk = [], []  # phase 1's prompts on each engine, in alternating order
        for n in lengths:
            for i, p in enumerate(prefixes[n]):
                prompt = p + tok(SUFFIX)
                for llm in ((first, plain) if i % 2 == 0 else (plain, first)):
                    (write_through if llm is first else no_disk).append(_first(llm, prompt)[0])
        t0 = time.perf_counter()
        first.close()
        wrote = dict(_disk(first), close_s=time.perf_counter() - t0, with_disk_s=sum(write_through),
                     without_disk_s=sum(no_disk))
        llm = make_llm(max(lengths), d)  # the restart
        out = []
        for n in lengths:
            cold, disk, promo = [], [], []
            for i, p in enumerate(prefixes[n]):
                prompt = p + tok(SUFFIX)
                runs = {}
                before = _disk(llm)
                for which in (("cold", "disk") if i % 2 == 0 else ("disk", "cold")):
                    q = {"prompt_token_ids": prompt, "cache_salt": f"cold-{n}-{i}"} if which == "cold" else prompt
                    runs[which] = _first(llm, q)
                after = _disk(llm)
                if after["hits"] - before["hits"] != 1 or runs["disk"][2] != n or runs["cold"][2] != 0:
                    raise RuntimeError(f"the disk request did not hit {n} tokens from disk: {runs}, {before} -> {after}")
                if runs["cold"][1] != runs["disk"][1]:
                    raise RuntimeError(f"first tokens differ: cold {runs['cold'][1]}, disk {runs['disk'][1]}")
                if i:  # the first prefix warms up
                    cold.append(runs["cold"][0]), disk.append(runs["disk"][0])
                    promo.append(after["promotion_seconds"] - before["promotion_seconds"])
            out.append({"length": n, "repeats": repeats, "cold_s": cold, "disk_s": disk, "promotion_s": promo,
                        "ratio": statistics.median(disk) / statistics.median(cold)})
        llm.close()
        out.append({"wrote": wrote, "files": sum(len(f) for _, _, f in os.walk(d))})
    return out


def report(r: dict) -> str:
    ms = ttft_cli.ms
    return (f"prefix {r['length']} + {SUFFIX} tokens, {r['repeats']} alternating repeats, median (min-max):\n"
            f"  cold prefill, time to first token:         {ms(r['cold_s'])}\n"
            f"  disk hit after restart, time to first token: {ms(r['disk_s'])}\n"
            f"    of which the promotion (read, check, copy in): {ms(r['promotion_s'])}\n"
            f"  ratio disk / cold: {r['ratio']:.3f}")


def main(argv=None) -> list[dict]:
    lengths, repeats = ttft_cli.parse(argv, __doc__.split("\n")[0])
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch thread, torch {torch.__version__}, "
          f"model hybridkv/tiny-code, disk: {tempfile.gettempdir()}")
    out = measure(lengths, repeats)
    for r in out[:-1]:
        print(report(r), flush=True)
    w = out[-1]["wrote"]
    n = w["demotions"] + w["kv_demotions"]
    print(f"phase 1 wrote {w['demotions']} states + {w['kv_demotions']} KV blocks ({w['bytes'] / 2**20:.1f} MiB) "
          f"in {w['write_seconds']:.3f} s of the writer thread ({1e3 * w['write_seconds'] / max(1, n):.2f} ms "
          f"an entry, fsync included); its prompts took {w['with_disk_s']:.3f} s with the disk tier, "
          f"{w['without_disk_s']:.3f} s on the same engine without one ({w['with_disk_s'] / w['without_disk_s']:.3f}x), "
          f"close() then waited {1e3 * w['close_s']:.1f} ms for queued writes")
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
