"""How many torch threads a CPU engine runs on, and how to override it.

Measured (benchmarks/bench_engine.py --threads, 2-core x86_64 VM, 2026-12-01): the tiny models'
ops are small, and torch's default of one OpenMP thread per core spins at every parallel region,
so 2 threads ran the engine workloads several times slower than 1 (issue 12: 4.8x); transformers
suffers the same. Hence the default: 1 thread on machines with at most `SMALL_MACHINE_CORES`
cores; on bigger machines torch's own default is kept (not measured here).
Override with the environment variable HYBRIDKV_CPU_THREADS=N (N >= 1), read when an LLM is built.
"""
from __future__ import annotations

import os

import torch

ENV_VAR = "HYBRIDKV_CPU_THREADS"
SMALL_MACHINE_CORES = 4


def default_cpu_threads(cores: int | None = None) -> int | None:
    """1 on machines with at most SMALL_MACHINE_CORES cores; None (keep torch's) above that."""
    cores = os.cpu_count() if cores is None else cores
    return 1 if cores is not None and cores <= SMALL_MACHINE_CORES else None


def requested_cpu_threads(env: dict | None = None) -> int | None:
    """HYBRIDKV_CPU_THREADS as a positive int, None when unset or empty; ValueError otherwise."""
    raw = (os.environ if env is None else env).get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV_VAR}={raw!r} is not a thread count; use an integer >= 1 "
                         f"(or unset it for the default)")
    return n


def configure_cpu_threads(device) -> int:
    """Set torch's intra-op threads for an engine on `device` (CPU only; other devices untouched).

    The env override wins, else the measured default; returns torch's thread count afterwards.
    """
    if str(device).split(":")[0] == "cpu":
        n = requested_cpu_threads()
        n = default_cpu_threads() if n is None else n
        if n is not None and n != torch.get_num_threads():
            torch.set_num_threads(n)
    return torch.get_num_threads()
