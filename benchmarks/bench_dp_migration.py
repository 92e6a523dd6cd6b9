"""A running request moved between two data-parallel replicas: bytes and time per move, the snapshot
in the pipe message ("pipe") vs its tensors rank to rank over the replicas' gloo group ("gloo").

    python benchmarks/bench_dp_migration.py            # 7 repeats per transport and prompt length
    python benchmarks/bench_dp_migration.py --quick    # 2 repeats, the short prompt only (a smoke run)

One DataParallelLLM of 2 replica processes (balancer off) over a random Bamba built here (hidden 512,
8 KV heads of 64, 2 attention + 2 Mamba2 layers of 32 heads x 32 x state 64: ~8 KiB of KV per token
and 0.5 MiB of SSM state). Per prompt length, one greedy request decodes (EOS ignored) while it is
moved from its replica to the other and back; transports alternate move by move in one process.
Reported per transport: median [min-max] over repeats of
- pipe bytes: the pickled export answer (what crossed the pipe), and gloo bytes (tensor payload);
- wall ms per move: DataParallelLLM._migrate (export, transfer, import, settle) as the balancer runs it;
- CPU ms per move: time.process_time of this process + both replicas' utime + stime (/proc), so
  serialising, hashing, pickling and the socket copies on every side are counted.
torch runs 1 thread in every process. Moves run between decode steps of the same request, so the
replicas also decode during a move; both transports see that alike.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KW = dict(device="cpu", dtype="float32", block_size=16, memory_budget_bytes=256 << 20, max_num_seqs=4)
CONFIG = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8,
              mamba_n_heads=32, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=64, max_position_embeddings=4096)


def _proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _fmt(xs: list[float], unit: str = "") -> str:
    return f"{statistics.median(xs):.1f}{unit} [{min(xs):.1f}-{max(xs):.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeats, lengths = (2, [64]) if args.quick else (args.repeats, [64, 1536])

    import torch

    from hybridkv import SamplingParams
    from hybridkv.models.tiny import make_tiny_checkpoint
    from hybridkv.server.replicas import DataParallelLLM

    torch.set_num_threads(1)
    ckpt = make_tiny_checkpoint("bamba", Path(tempfile.mkdtemp()) / "bamba", **CONFIG)
    dp = DataParallelLLM(str(ckpt), 2, log_stats_interval=0, balance_interval=0, startup_timeout=600,
                         call_timeout=120, **KW)
    pids = [f.pid for f in dp.facts]
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    exported: list[object] = []  # the export answers, pickled as the pipe carried them
    call = dp.replicas.call

    def recording_call(i, verb, *a):
        fut = call(i, verb, *a)
        if verb == "export":
            fut.add_done_callback(lambda f: exported.append(f.result()) if f.exception() is None else None)
        return fut

    dp.replicas.call = recording_call
    rows = []
    try:
        for n in lengths:
            ids = [3 + (7 * k) % 117 for k in range(n)]
            params = SamplingParams(max_tokens=4096 - n - 8, temperature=0.0, ignore_eos=True)
            rid = f"bench-{n}"

            async def drain():
                async for _ in dp.generate(ids, params, rid):
                    pass

            task = asyncio.run_coroutine_threadsafe(drain(), loop)
            while dp.router.replica_of(rid) is None or asyncio.run_coroutine_threadsafe(dp.stats(), loop).result(
                    60)["generated_tokens"] < 2:
                time.sleep(0.05)
            got = {t: {"pipe_b": [], "gloo_b": [], "wall": [], "cpu": []} for t in ("pipe", "gloo")}
            for r in range(repeats):
                for t in (("pipe", "gloo") if r % 2 == 0 else ("gloo", "pipe")):
                    dp.transport = t
                    a = dp.router.replica_of(rid)
                    exported.clear()
                    c0, w0 = time.process_time() + sum(map(_proc_cpu_seconds, pids)), time.perf_counter()
                    moved = dp._migrate(a, 1 - a, 1)
                    w1, c1 = time.perf_counter(), time.process_time() + sum(map(_proc_cpu_seconds, pids))
                    assert moved == 1 and dp.router.replica_of(rid) == 1 - a, (moved, dp.router.replica_of(rid))
                    m = exported[0][0]
                    got[t]["pipe_b"].append(len(pickle.dumps(exported[0])))
                    got[t]["gloo_b"].append(getattr(m.snapshot, "nbytes", 0))
                    got[t]["wall"].append((w1 - w0) * 1e3)
                    got[t]["cpu"].append((c1 - c0) * 1e3)
            dp.abort(rid)
            task.cancel()
            for t in ("pipe", "gloo"):
                g = got[t]
                rows.append(f"| {n} | {t} | {_fmt([b / 1024 for b in g['pipe_b']])} | "
                            f"{_fmt([b / 1024 for b in g['gloo_b']])} | {_fmt(g['wall'])} | {_fmt(g['cpu'])} |")
    finally:
        dp.close()
        loop.call_soon_threadsafe(loop.stop)
    print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()}, "
          f"torch {torch.__version__}, {repeats} repeats per cell (moves alternate pipe/gloo)")
    print("| prompt tokens | transport | pipe KiB | gloo KiB | wall ms / move | CPU ms / move |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
