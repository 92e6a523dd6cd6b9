"""Scale-out on the CPU: throughput and time to first token per configuration, one table row each.

    python benchmarks/bench_scale.py              # 5 repeats, 16 requests of 64 prompt + 32 new tokens
    python benchmarks/bench_scale.py --quick      # 2 repeats, 4 requests (a smoke run; not a result)

Data-parallel rows: one engine in this process (AsyncLLM, the baseline), and DataParallelLLM with
1 and 2 replica processes (server/replicas.py), all over the same tiny random Bamba, built once;
then in each repeat every configuration runs the same fresh prompts (no prefix hits across
repeats), configurations alternating. Each request: random prompt tokens, greedy, EOS ignored,
all submitted at once. Reported per configuration: median [min-max] over repeats of
- output tokens/s: generated tokens over the repeat's wall time;
- CPU ms per output token: time.process_time of this process plus the replicas' own CPU time
  (utime + stime from /proc/<pid>/stat), so the pipes, pickling and router are counted;
- TTFT: submit -> first delta, median over the repeat's requests (wall time).
Tensor-parallel row: the same in-process engine with tensor_parallel_size=2 (rank 1 a spawned
process, gloo all-reduces; hybridkv/parallel/), so the "1 engine" row is its TP=1 baseline; its CPU
time includes rank 1's. Communication bytes per decode step per rank: all-reduce + broadcast bytes
counted by the process group over 8 steps where every request decodes (CPU tensors; on NCCL the
all-reduce bytes are the same, the broadcast of rank 0's decisions stays on gloo).
torch runs 1 thread in every process. On a 2-core machine two replicas share the cores with each
other and the client: this measures the overhead of processes, pipes and routing, not a speed-up.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT_LEN, MAX_TOKENS, VOCAB_LOW, VOCAB_HIGH = 64, 32, 3, 120
KW = dict(device="cpu", dtype="float32", block_size=16, memory_budget_bytes=64 << 20, max_num_seqs=64)


def _proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class Config:
    def __init__(self, name: str, replicas: int, engine, pids: list[int]):
        self.name, self.replicas, self.engine, self.pids = name, replicas, engine, pids
        self.tok_s: list[float] = []
        self.cpu_ms: list[float] = []
        self.ttft_ms: list[float] = []
        self.comm: str = "-"  # tensor parallel: bytes per decode step per rank

    def cpu(self) -> float:
        return time.process_time() + sum(_proc_cpu_seconds(p) for p in self.pids)


async def _one(engine, ids, params, rid) -> tuple[float, int]:
    t0, first, n = time.perf_counter(), None, 0
    async for d in engine.generate(ids, params, rid):
        if first is None and d.token_ids:
            first = time.perf_counter() - t0
        n += len(d.token_ids)
    return first, n


def run_once(cfg: Config, prompts: list[list[int]], tag: str) -> None:
    from hybridkv import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def all_of_them():
        return await asyncio.gather(*(_one(cfg.engine, ids, params, f"{tag}-{i}") for i, ids in enumerate(prompts)))

    c0, w0 = cfg.cpu(), time.perf_counter()
    got = asyncio.run(all_of_them())
    wall, cpu = time.perf_counter() - w0, cfg.cpu() - c0
    tokens = sum(n for _, n in got)
    assert tokens == len(prompts) * MAX_TOKENS, tokens
    cfg.tok_s.append(tokens / wall)
    cfg.cpu_ms.append(1e3 * cpu / tokens)
    cfg.ttft_ms.append(1e3 * statistics.median(f for f, _ in got))


def decode_bytes_per_step(llm, requests: int = 8, steps: int = 8) -> str:
    """all-reduce + broadcast bytes per step on rank 0 while `requests` sequences all decode."""
    from hybridkv import SamplingParams

    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        llm.add_request(list(range(VOCAB_LOW, VOCAB_LOW + PROMPT_LEN)), params, request_id=f"comm-{i}")
    while any(s.num_output_tokens == 0 for s in llm.engine.scheduler.running) or llm.engine.scheduler.waiting:
        llm.step()
    before = llm.tensor_parallel.communication_bytes()
    for _ in range(steps):
        llm.step()
    after = llm.tensor_parallel.communication_bytes()
    for i in range(requests):
        llm.abort(f"comm-{i}")
    ar = (after["all_reduce"] - before["all_reduce"]) / steps
    bc = (after["broadcast"] - before["broadcast"]) / steps
    return f"{ar / 1024:.1f} KiB all-reduce + {bc / 1024:.1f} KiB broadcast"


def _fmt(xs: list[float], digits: int = 1) -> str:
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.requests = 2, 4
    torch.set_num_threads(1)
    os.environ.setdefault("HYBRIDKV_CPU_THREADS", "1")  # the replicas too

    from hybridkv.llm import LLM
    from hybridkv.models.tiny import make_tiny_checkpoint
    from hybridkv.server.async_llm import AsyncLLM
    from hybridkv.server.replicas import DataParallelLLM

    with tempfile.TemporaryDirectory() as d:
        path = str(make_tiny_checkpoint("bamba", Path(d) / "bamba"))
        configs = [Config("1 engine, in process (AsyncLLM)", 1, AsyncLLM(LLM(path, **KW), log_stats_interval=0), [])]
        for n in (1, 2):
            dp = DataParallelLLM(path, n, log_stats_interval=0, **KW)
            configs.append(Config(f"data-parallel, {n} replica process{'es' if n > 1 else ''}", n, dp,
                                  [f.pid for f in dp.facts]))
        tp = LLM(path, tensor_parallel_size=2, **KW)
        configs.append(Config("tensor-parallel 2, in process + 1 rank process", 1, AsyncLLM(tp, log_stats_interval=0),
                              [p.pid for p in tp.tensor_parallel.procs]))
        configs[-1].comm = decode_bytes_per_step(tp)
        try:
            for r in range(args.repeats):
                rng = random.Random(r)
                prompts = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(PROMPT_LEN)]
                           for _ in range(args.requests)]
                for cfg in configs:
                    run_once(cfg, prompts, f"r{r}")
        finally:
            for cfg in configs:
                cfg.engine.close()
            tp.close()

    print(f"# bench_scale: {args.requests} requests x ({PROMPT_LEN} prompt + {MAX_TOKENS} new tokens), tiny Bamba, "
          f"greedy; {args.repeats} repeats, median [min-max]; {platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, 1 thread per process")
    print("| configuration | processes | output tokens/s | CPU ms / output token | TTFT ms | comm / decode step / rank |")
    print("|---|---|---|---|---|---|")
    for cfg in configs:
        procs = 1 + len(cfg.pids)
        print(f"| {cfg.name} | {procs} | {_fmt(cfg.tok_s, 0)} | {_fmt(cfg.cpu_ms, 2)} | {_fmt(cfg.ttft_ms, 0)} | {cfg.comm} |")


if __name__ == "__main__":
    main()
