"""Peak resident memory of ONE tensor-parallel rank while it loads its shard: the whole checkpoint
loaded then cut (how ranks loaded before) vs only its rows read (ShardLoad: cut on meta, then
safetensors get_slice).

Each (way, rank) loads in a fresh spawned process, which reports its peak RSS
(resource.getrusage(RUSAGE_SELF).ru_maxrss) and its RSS right after the imports; the difference is
what loading cost (each process first loads a tiny Bamba both ways, so that every import a load
makes happens before). The checkpoint is the tiny Bamba widened (hidden 1024, 4 layers, float32).

    python benchmarks/bench_shard_load.py [--size 2] [--hidden 1024]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import tempfile
from pathlib import Path


def _rss_mib(field: str = "VmRSS") -> float:
    """Resident MiB now: VmRSS (all), RssAnon (allocated memory), RssFile (mapped file pages)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _load(path: str, warm_path: str, way: str, rank: int, size: int, out) -> None:
    import torch

    from hybridkv.models import load_model
    from hybridkv.parallel.shard_loading import ShardLoad
    from hybridkv.parallel.sharding import shard_model

    torch.set_num_threads(1)
    load_model(warm_path, shard=ShardLoad(rank, size, lambda t: t))  # every import a load makes, tiny weights
    load_model(warm_path)
    base, anon, file = _rss_mib(), _rss_mib("RssAnon"), _rss_mib("RssFile")
    if way == "whole then cut":
        model = load_model(path)
        shard_model(model, rank, size, lambda t: t)
    else:
        model = load_model(path, shard=ShardLoad(rank, size, lambda t: t))
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    out.put((way, rank, base, peak, params, _rss_mib("RssAnon") - anon, _rss_mib("RssFile") - file))


def _make_checkpoints(tmp: str, h: int) -> None:
    from hybridkv.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint("bamba", Path(tmp) / "bamba", hidden_size=h, intermediate_size=4 * h,
                         num_attention_heads=16, num_key_value_heads=4, mamba_n_heads=32, mamba_d_head=2 * h // 32)
    make_tiny_checkpoint("bamba", Path(tmp) / "warm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        # built in a child: a spawned process starts with its parent's peak RSS as its own
        # (ru_maxrss survives fork + exec), so this process must stay small (no torch here)
        maker = ctx.Process(target=_make_checkpoints, args=(tmp, args.hidden))
        maker.start()
        maker.join()
        path, warm = str(Path(tmp) / "bamba"), str(Path(tmp) / "warm")
        ckpt_mib = sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 2**20
        print(f"checkpoint: {ckpt_mib:.0f} MiB of safetensors; tensor_parallel_size={args.size}")
        print("| way | rank | shard params MiB | RSS before the load MiB | peak RSS MiB | peak - before MiB "
              "| after the load: + anon MiB | + file-mapped MiB |")
        print("|---|---|---|---|---|---|---|---|")
        for way in ("whole then cut", "shard only"):
            for rank in range(args.size):
                q = ctx.Queue()
                p = ctx.Process(target=_load, args=(path, warm, way, rank, args.size, q))
                p.start()
                way_, rank_, base, peak, params, anon, file = q.get(timeout=600)
                p.join()
                print(f"| {way_} | {rank_} | {params:.0f} | {base:.0f} | {peak:.0f} | {peak - base:.0f} "
                      f"| {anon:.0f} | {file:.0f} |")


if __name__ == "__main__":
    main()
