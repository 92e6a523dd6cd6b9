"""What the time-to-first-token benchmarks of the memory tiers share (bench_tier_ttft.py,
bench_disk_ttft.py): their command line (prefix lengths, repeats), one torch thread, and a
median (min-max) in milliseconds."""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from hybridkv.cpu_threads import ENV_VAR

BLOCK = 16  # the benchmarks' block size: prefix lengths are whole blocks


def parse(argv, description: str) -> tuple[list[int], int]:
    """(prefix lengths, repeats) from --lengths / --repeats; sets one torch thread for LLM too."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--lengths", default="1024,2048", help="comma-separated prefix lengths (multiples of 16)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(n <= 0 or n % BLOCK for n in lengths) or args.repeats < 1:
        ap.error(f"--lengths must be positive multiples of {BLOCK} and --repeats >= 1: {args.lengths}, {args.repeats}")
    os.environ[ENV_VAR] = "1"  # LLM sets its threads from it (hybridkv/cpu_threads.py)
    torch.set_num_threads(1)
    return lengths, args.repeats


def ms(xs) -> str:
    """`median ms (min-max)` of times in seconds."""
    return f"{1e3 * statistics.median(xs):.2f} ms ({1e3 * min(xs):.2f}-{1e3 * max(xs):.2f})"
