"""Memory-manager bookkeeping cost: one engine step of 256 decodes at 4k context, and
admit+finish cycles per second with and without prefix caching.

    python benchmarks/bench_manager.py

The pools use tiny head sizes: the numbers measure the manager's Python work (block tables,
refcounts, hashing, slot bookkeeping), not tensor copies.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.request import Request
from hybridkv.specs import AttentionSpec, RecurrentSpec


def hybrid_specs(layers: int = 32, attn_every: int = 8) -> dict:
    attn = AttentionSpec(1, 8, torch.float16)
    rec = RecurrentSpec((4, 3), (2, 4), torch.float16, torch.float32)
    return {i: attn if i % attn_every == attn_every // 2 else rec for i in range(layers)}


def bench_decode_step(num_reqs: int, ctx: int, steps: int, block_size: int, caching: bool, aligned: bool) -> dict:
    """aligned: every context is exactly ctx, so all requests fill a block (and hash it) on the same
    step, the worst case; otherwise contexts are ctx + r % block_size, as in a real mix."""
    blocks = num_reqs * (-(-(ctx + block_size + steps) // block_size)) + 16
    m = HybridCacheManager(hybrid_specs(), block_size, blocks, num_reqs + 2, enable_prefix_caching=caching,
                           fingerprint="bench")
    for r in range(num_reqs):
        n = ctx if aligned else ctx + r % block_size
        m.admit(Request(r, [r * 7 + 1] + list(range(n - 1))))
        m.allocate(r, n)
        m.commit(r, n)
    ids = list(range(num_reqs))
    alloc_commit, with_table = [], []
    for s in range(steps):
        for r in ids:
            m.append_tokens(r, [s])
        t0 = time.perf_counter()
        for r in ids:
            m.allocate(r, 1)
        for r in ids:
            m.commit(r, 1)
        t1 = time.perf_counter()
        m.block_table(ids)
        t2 = time.perf_counter()
        alloc_commit.append(t1 - t0)
        with_table.append(t2 - t0)
    return {"median": 1e3 * statistics.median(alloc_commit), "mean": 1e3 * statistics.mean(alloc_commit),
            "max": 1e3 * max(alloc_commit), "with_table": 1e3 * statistics.median(with_table)}


def bench_cycles(prompt_len: int, shared: int, cycles: int, block_size: int, caching: bool) -> float:
    m = HybridCacheManager(hybrid_specs(), block_size, 4 * (prompt_len // block_size + 1), 8,
                           enable_prefix_caching=caching, checkpoint_policy="prompt_end", fingerprint="bench")
    system = list(range(shared))
    t0 = time.perf_counter()
    for c in range(cycles):
        prompt = system + [(c * 31 + j) % 50_000 for j in range(prompt_len - shared)]
        hit = m.admit(Request(c, prompt))
        end = len(prompt)
        due = m.prefix_cache.checkpoint_due(c, hit, end)
        for stop in ([due] if due else []) + [end]:
            n = stop - m.request(c).num_computed_tokens
            m.allocate(c, n)
            m.commit(c, n)
            if stop == due:
                m.prefix_cache.checkpoint(c)
        m.finish(c)
    return cycles / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reqs", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cycles", type=int, default=2000)
    a = ap.parse_args()
    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    for caching, aligned in ((True, False), (False, False), (True, True)):
        d = bench_decode_step(a.reqs, a.ctx, a.steps, a.block_size, caching, aligned)
        print(f"decode step, {a.reqs} requests x {a.ctx} tokens ({'aligned' if aligned else 'spread'}), prefix "
              f"caching {'on ' if caching else 'off'}: allocate+commit median {d['median']:.3f} ms, mean "
              f"{d['mean']:.3f}, max {d['max']:.3f}; with block_table [{a.reqs}, ~{a.ctx // a.block_size + 1}] "
              f"median {d['with_table']:.3f} ms")
    for caching in (True, False):
        for plen, shared in ((512, 384), (4096, 3072)):
            n = a.cycles if plen <= 512 else max(1, a.cycles // 8)
            cps = bench_cycles(plen, shared, n, a.block_size, caching)
            print(f"admit+prefill+finish, {plen}-token prompts ({shared} shared), prefix caching "
                  f"{'on ' if caching else 'off'}: {cps:,.0f} cycles/s")


if __name__ == "__main__":
    main()
