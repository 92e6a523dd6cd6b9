"""Serve a hybrid checkpoint from Python (a batch through `generate`, then a request-level loop),
then over HTTP: `hybridkv serve` in a subprocess, called with the openai client.

    python examples/serve_hybrid.py path/to/checkpoint
    python examples/serve_hybrid.py --tiny            # builds a tiny random Bamba in a temp dir
    python examples/serve_hybrid.py --tiny --no-server   # the Python API only

Prompts are strings, tokenized with the checkpoint's tokenizer. The first part runs them through
`LLM.generate` (continuous batching over the paged KV pool and the state slots); the second
serves the same prompts the way a server does (`add_request` + `step` until done) behind a shared
system prompt, in three waves: the second cuts a state checkpoint where its KV match ends, and
the third hits the prefix cache (KV blocks + that checkpoint). `llm.stats()` is printed at
the end: blocks and slots in use, prefix hits (and why misses missed), preemptions, tokens/s.
The last part starts `hybridkv serve` on a free 127.0.0.1 port, asks it for the first prompt's
greedy completion (plain and streamed) with the official `openai` client, checks both equal the
Python API's text, and stops the server.
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

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
    texts = []
    for out in llm.generate(PROMPTS, greedy, use_tqdm=False):
        o = out.outputs[0]
        texts.append(o.text)
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
    return stats, texts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call_server(path: str, max_tokens: int, budget_mb: int, expected: str) -> bool:
    """Start `hybridkv serve path` on a free local port, ask it for PROMPTS[0] (greedy, plain and
    streamed) with the openai client, stop it; True when both texts equal `expected`."""
    from openai import OpenAI  # pip install openai (the test extra has it)

    port = _free_port()
    cmd = [sys.executable, "-m", "hybridkv", "serve", path, "--port", str(port), "--device", "cpu",
           "--dtype", "float32", "--memory-budget-mb", str(budget_mb), "--served-model-name", "hybrid",
           "--log-level", "warning"]
    print("\n== HTTP server ==")
    print("$ hybridkv serve", path, "--port", port, "...")
    server = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 120
        while True:  # wait for /health
            if server.poll() is not None:
                raise RuntimeError(f"hybridkv serve exited with {server.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("hybridkv serve did not answer /health in 120 s")
            time.sleep(0.2)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model="hybrid", prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0)
        print(f"completions: {PROMPTS[0]!r} -> {r.choices[0].text!r} ({r.usage.completion_tokens} tokens, "
              f"{r.choices[0].finish_reason})")
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="hybrid", prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0, stream=True))
        print(f"streamed:    {PROMPTS[0]!r} -> {streamed!r}")
        same = r.choices[0].text == streamed == expected
        print("server == Python API:", "yes" if same else "NO")
        return same
    finally:
        server.send_signal(signal.SIGINT)  # what Ctrl-C does: a clean shutdown
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        print("server stopped")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Serve prompts from a hybrid checkpoint and print stats.")
    ap.add_argument("checkpoint", nargs="?", help="checkpoint directory (config.json, safetensors, tokenizer)")
    ap.add_argument("--tiny", action="store_true", help="build and serve a tiny random Bamba instead")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--budget-mb", type=int, default=64, help="bytes for KV blocks + state slots, in MiB")
    ap.add_argument("--no-server", action="store_true", help="skip the HTTP part (the Python API only)")
    args = ap.parse_args(argv)
    if args.tiny == bool(args.checkpoint):
        ap.error("give a checkpoint directory or --tiny (exactly one)")
    with tempfile.TemporaryDirectory() as d:
        path = build_tiny(d) if args.tiny else args.checkpoint
        stats, texts = serve(path, args.max_tokens, args.budget_mb)
        leaked = stats["kv_blocks_used"] or stats["state_slots_live"]
        print("leak check:", "FAILED" if leaked else "ok (0 KV blocks used, 0 live state slots)")
        same = args.no_server or call_server(path, args.max_tokens, args.budget_mb, texts[0])
    return 1 if leaked or not same else 0


if __name__ == "__main__":
    sys.exit(main())
