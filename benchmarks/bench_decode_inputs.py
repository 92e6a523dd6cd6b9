"""Host cost of preparing one decode step's inputs: the eager BatchBuilder against the CUDA-graph
path (DecodeInputs.from_chunks + copying into DecodeGraphs' persistent buffers, only changed
block-table rows), on the same scheduled decode chunks of a running engine.

    python benchmarks/bench_decode_inputs.py [--batches 1 64 --context 1000 --repeats 7]

CPU only (the device copies are CPU copies here; on a GPU both paths add their H2D copies: one
for the builder, two plus the changed rows for the graphs). One thread, time.process_time, both
paths alternating in one process, median (min-max) of the repeats, each repeat 200 calls.
The graph path's steady state: no row changes between calls, as in most decode steps.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # DecodeGraphs' dry-run mode on the CPU

import torch  # noqa: E402

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.models.tiny import make_tiny_checkpoint  # noqa: E402
from hybridkv.scheduler.decode_graphs import DecodeGraphs, DecodeInputs  # noqa: E402

CALLS = 200


def decode_chunks(path: str, batch: int, context: int):
    """An engine with `batch` requests of `context` prompt tokens, past prefill, and the chunks
    of its next (decode) step."""
    llm = LLM(path, device="cpu", max_num_seqs=batch, max_num_batched_tokens=max(2048, context),
              max_model_len=4096, memory_budget_bytes=256 << 20, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for r in range(batch):
        llm.add_request([4 + (r * 7 + i) % 120 for i in range(context)], params)
    engine = llm.engine
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        llm.step()
    chunks = engine.scheduler.schedule().all_chunks()
    assert all(c.num_tokens == 1 for c in chunks) and len(chunks) == batch
    return engine, chunks


def per_call_us(fn) -> float:
    t0 = time.process_time()
    for _ in range(CALLS):
        fn()
    return (time.process_time() - t0) / CALLS * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{platform.machine()} {platform.processor() or ''} | torch {torch.__version__} | load "
          f"{os.getloadavg()[0]:.1f} | context {args.context} | {CALLS} calls per repeat")
    print(f"{'batch':>5} {'eager BatchBuilder us':>28} {'graph inputs + fill us':>28}")
    with tempfile.TemporaryDirectory() as d:
        path = str(make_tiny_checkpoint("llama", d, max_position_embeddings=4096))
        for batch in args.batches:
            engine, chunks = decode_chunks(path, batch, args.context)
            graphs = DecodeGraphs(engine.runner.model, engine.runner.caches, batch, engine.max_model_len,
                                  engine.mgr.block_size, mode="dry_run")
            bucket = graphs.bucket_for(batch)
            mgr = engine.mgr

            def eager():
                engine.runner.batch_builder.build(chunks, None)

            def graph():
                graphs._fill(DecodeInputs.from_chunks(chunks, mgr), bucket)

            graph()  # the first fill moves every row; later ones move none (steady decode)
            times = {"eager": [], "graph": []}
            for _ in range(args.repeats):
                times["eager"].append(per_call_us(eager))
                times["graph"].append(per_call_us(graph))
            cells = [f"{statistics.median(v):8.1f} ({min(v):.1f}-{max(v):.1f})" for v in times.values()]
            print(f"{batch:>5} {cells[0]:>28} {cells[1]:>28}")


if __name__ == "__main__":
    main()
