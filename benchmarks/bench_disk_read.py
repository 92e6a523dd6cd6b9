"""A running decode stream's step time while another request's disk hit is admitted: the disk files
read ahead on the reader thread (the default) vs in the admission, on the step's thread
(`disk_read_ahead=False`, the old path), on the built-in hybridkv/tiny-code (a tiny Bamba), CPU,
1 torch thread, both engines in one process, alternating which goes first.

    python benchmarks/bench_disk_read.py                     # 1024- and 2048-token prefixes, 5 repeats
    python benchmarks/bench_disk_read.py --lengths 4096 --repeats 7   (ttft_cli.py: one torch thread)

Phase 1: an engine with a disk tier in a fresh directory answers P_i + 16 tokens for repeats + 1
random prefixes P_i (each P_i's state and KV are written through), then is closed. Phase 2: two
NEW engines on that directory, one per mode. Per repeat and mode: a decode stream (a 32-token
prompt, greedy) runs until it decodes, then P_i + 16 other tokens is added (one token); every step
from then until that request's first token is timed. Printed per mode, median (min-max) over the
repeats (the first prefix warms up): the slowest step of the stream in that window (the stall a
synchronous read puts on every running request), the window's mean step, the hit's time to first
token, and the reads on each thread. The script checks that each hit took len(P_i) tokens from
disk and that both modes give the same first token.
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
SUFFIX = 16
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
STREAM = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
MODES = {"read_ahead": True, "on_the_step": False}


def make_llm(max_len: int, cache_dir, read_ahead: bool = True) -> LLM:
    return LLM(MODEL, max_num_seqs=2, max_model_len=max_len + 2 * SUFFIX, memory_budget_bytes=256 << 20,
               disk_cache_dir=cache_dir, disk_read_ahead=read_ahead)


def window(llm: LLM, prompt, stream_prompt) -> dict:
    """Start a decode stream, then add `prompt`: the steps until its first token (seconds each), its
    time to first token, its first token and cached tokens. The stream is aborted after."""
    llm.add_request(stream_prompt, STREAM, request_id="stream")
    while not any(o.request_id == "stream" and o.outputs[0].token_ids for o in llm.step()):
        pass
    llm.step()  # the stream decodes
    steps, t0 = [], time.perf_counter()
    llm.add_request(prompt, ONE, request_id="hit")
    done = None
    while done is None:
        s = time.perf_counter()
        outs = llm.step()
        steps.append(time.perf_counter() - s)
        done = next((o for o in outs if o.request_id == "hit" and o.finished), None)
    ttft = time.perf_counter() - t0
    llm.abort("stream")
    llm.step()
    return {"steps": steps, "ttft": ttft, "token": done.outputs[0].token_ids[0], "cached": done.num_cached_tokens}


def measure(length: int, repeats: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(4, 500) for _ in range(n)]  # noqa: E731
    prefixes = [tok(length) for _ in range(repeats + 1)]
    out = {m: {"max_step": [], "mean_step": [], "ttft": [], "steps": []} for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-disk-read-") as d:
        first = make_llm(length, d)
        first.generate([p + tok(SUFFIX) for p in prefixes], ONE, use_tqdm=False)
        first.close()
        llms = {m: make_llm(length, d, flag) for m, flag in MODES.items()}
        for i, p in enumerate(prefixes):
            prompt, stream = p + tok(SUFFIX), tok(32)
            got = {}
            for m in (list(MODES) if i % 2 == 0 else list(MODES)[::-1]):
                got[m] = window(llms[m], prompt, stream)
                if got[m]["cached"] != length:
                    raise RuntimeError(f"{m}: the hit took {got[m]['cached']} tokens from cache, not {length}")
            if len({g["token"] for g in got.values()}) != 1:
                raise RuntimeError(f"first tokens differ: {got}")
            if i:  # the first prefix warms up
                for m, g in got.items():
                    out[m]["max_step"].append(max(g["steps"]))
                    out[m]["mean_step"].append(statistics.mean(g["steps"]))
                    out[m]["ttft"].append(g["ttft"])
                    out[m]["steps"].append(len(g["steps"]))
        for m, llm in llms.items():
            disk = llm.stats()["checkpoint_tiers"]["disk"]
            out[m]["reads"] = (disk["background_reads"], disk["sync_reads"], disk["read_wait_seconds"])
            llm.close()
    return out


def main(argv=None) -> dict:
    lengths, repeats = ttft_cli.parse(argv, __doc__.split("\n")[0])
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread, "
          f"torch {torch.__version__}, model hybridkv/tiny-code, disk: {tempfile.gettempdir()}")
    ms = ttft_cli.ms
    results = {}
    for n in lengths:
        r = results[n] = measure(n, repeats)
        print(f"prefix {n} + {SUFFIX} tokens hit from disk while a decode stream runs; {repeats} alternating "
              f"repeats, median (min-max):")
        for m in MODES:
            x = r[m]
            bg, sync, wait = x["reads"]
            print(f"  {m:12s} slowest stream step {ms(x['max_step'])}, mean step {ms(x['mean_step'])}, "
                  f"hit TTFT {ms(x['ttft'])}, steps {statistics.median(x['steps']):.0f}; "
                  f"files read on the reader thread {bg}, on the step {sync}, held {1e3 * wait:.1f} ms in all")
        ratio = statistics.median(r["on_the_step"]["max_step"]) / statistics.median(r["read_ahead"]["max_step"])
        print(f"  slowest stream step, on the step / read ahead: {ratio:.2f}x")
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
