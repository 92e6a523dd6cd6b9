"""Serve a hybrid checkpoint from Python: a batch through `generate`, then a request-level loop.

    python examples/serve_hybrid.py path/to/checkpoint
    python examples/serve_hybrid.py --tiny            # builds a tiny random Bamba in a temp dir

Prompts are strings, tokenized with the checkpoint's tokenizer. The first part runs them through
`LLM.generate` (continuous batching over the paged KV pool and the state slots); the second
serves the same prompts the way a server does (`add_request` + `step` until done) behind a shared
system prompt, in three waves: the second cuts a state checkpoint where its KV match ends, and
the third hits the prefix cache (KV blocks + that checkpoint). `llm.stats()` is printed at
the end: blocks and slots in use, prefix hits (and why misses missed), preemptions, tokens/s.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

from hybridkv import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Hybrid models mix attention with",
    "Once upon a time, in a small village,",
]
SYSTEM = "You are a concise assistant. Answer in one short sentence, please. "


def build_tiny(directory: str) -> str:
    """Write a tiny random Bamba (Mamba2 + attention) with a character tokenizer; return its dir."""
    from hybridkv.models.tiny import make_tiny_checkpoint

    return str(make_tiny_checkpoint("bamba", directory))


def serve(path: str, max_tokens: int, budget_mb: int) -> dict:
    # branch_points: a state checkpoint is cut where a new prompt's KV match ends (the shared prefix)
    llm = LLM(path, device="cpu", dtype="float32", memory_budget_bytes=budget_mb << 20,
              checkpoint_policy="branch_points")
    print(f"model: {path}")
    print(f"pools: {llm.stats()['kv_blocks_total']} KV blocks of {llm.config.block_size} tokens, "
          f"{llm.stats()['state_slots_total']} state slots")

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    print("\n== generate (greedy) ==")
    for out in llm.generate(PROMPTS, greedy, use_tqdm=False):
        o = out.outputs[0]
        print(f"[{out.request_id}] {out.prompt!r} -> {o.text!r} ({len(o.token_ids)} tokens, {o.finish_reason})")

    print("\n== add_request / step (shared system prefix, seeded sampling, n=2 on the last) ==")
    ids, done = [], {}
    # wave 2 cuts a checkpoint where its KV match of wave 1 ends (the system prompt); wave 3 hits it
    for wave in (PROMPTS[:1], PROMPTS[1:2], PROMPTS[2:]):
        for p in wave:
            i = PROMPTS.index(p)
            n = 2 if i == len(PROMPTS) - 1 else 1
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=i, n=n)
            ids.append(llm.add_request(SYSTEM + p, params, request_id=f"chat-{i}"))
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.finished:
                    done[out.request_id] = out
    for rid in ids:
        out = done[rid]
        for o in out.outputs:
            print(f"[{rid}.{o.index}] cached {out.num_cached_tokens} prompt tokens -> {o.text!r}")

    stats = llm.stats()
    print("\n== stats ==")
    print(json.dumps(stats, indent=1, default=str))
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Serve prompts from a hybrid checkpoint and print stats.")
    ap.add_argument("checkpoint", nargs="?", help="checkpoint directory (config.json, safetensors, tokenizer)")
    ap.add_argument("--tiny", action="store_true", help="build and serve a tiny random Bamba instead")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--budget-mb", type=int, default=64, help="bytes for KV blocks + state slots, in MiB")
    args = ap.parse_args(argv)
    if args.tiny == bool(args.checkpoint):
        ap.error("give a checkpoint directory or --tiny (exactly one)")
    if args.tiny:
        with tempfile.TemporaryDirectory() as d:
            stats = serve(build_tiny(d), args.max_tokens, args.budget_mb)
    else:
        stats = serve(args.checkpoint, args.max_tokens, args.budget_mb)
    leaked = stats["kv_blocks_used"] or stats["state_slots_live"]
    print("leak check:", "FAILED" if leaked else "ok (0 KV blocks used, 0 live state slots)")
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main())
