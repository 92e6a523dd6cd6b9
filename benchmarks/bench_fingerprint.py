"""Start-up cost of the checkpoint fingerprint: every weight byte hashed (before) against the
safetensors headers + sizes + sampled chunks (`CheckpointTensors.identity`, now).

    python benchmarks/bench_fingerprint.py [--gib 1.0] [--shards 4] [--repeats 5]

Writes a random float32 checkpoint of about --gib GiB (sharded, with an index) in a temporary
directory under /tmp, deleted at the end. Both run alternating in one process, one thread, timed
with time.process_time (the hash's CPU time; the files sit in the page cache after the first
read, so this is the warm-start cost); median of --repeats with min-max.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridkv.models.checkpoint import CheckpointTensors


def write_checkpoint(directory: Path, gib: float, shards: int) -> int:
    """Random float32 shards of ~gib GiB in all + model.safetensors.index.json; returns bytes written."""
    per_shard = int(gib * (1 << 30) / shards / 4)
    weight_map, total = {}, 0
    g = torch.Generator().manual_seed(0)
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {f"layers.{i}.w{j}": torch.randn(per_shard // 4, generator=g) for j in range(4)}
        save_file(tensors, directory / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += (directory / name).stat().st_size
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def hash_every_byte(ckpt: CheckpointTensors) -> str:
    """The fingerprint's weight part before: blake2b over every byte of every file."""
    h = hashlib.blake2b(digest_size=16)
    for f in ckpt.files():
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        size = write_checkpoint(Path(d), args.gib, args.shards)
        ckpt = CheckpointTensors(d)
        times = {"every byte (before)": [], "headers + samples (now)": []}
        fns = dict(zip(times, (hash_every_byte, lambda c: c.identity())))
        for _ in range(args.repeats):
            for name, fn in fns.items():  # alternating
                t0 = time.process_time()
                fn(ckpt)
                times[name].append(time.process_time() - t0)
        print(f"checkpoint: {size / (1 << 30):.2f} GiB in {args.shards} shards; {args.repeats} repeats, "
              f"1 thread, process_time")
        for name, ts in times.items():
            print(f"{name:>24}: median {statistics.median(ts) * 1e3:9.2f} ms "
                  f"(min {min(ts) * 1e3:.2f}, max {max(ts) * 1e3:.2f})")


if __name__ == "__main__":
    main()
