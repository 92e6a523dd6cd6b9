"""The HTTP server under load: requests/s, output tokens/s, time to first token and inter-token
latency (p50 / p99) at several concurrencies, tiny Bamba beside tiny Llama.

    python benchmarks/bench_server.py            # concurrency 1, 8, 32, 64; both models
    python benchmarks/bench_server.py --quick    # concurrency 1 and 4, 8 requests each (a smoke run)

For each model a `hybridkv serve` subprocess on 127.0.0.1 (a free port) serves a tiny random
checkpoint; this process is the client (httpx, streaming, `return_token_ids`). At concurrency c,
max(16, 2c) requests (each 64 random prompt tokens, 32 new tokens, greedy, EOS ignored) run with
at most c in flight. TTFT: request sent -> first token; ITL: gap between streamed tokens (a chunk of
k tokens counts as k gaps of its gap / k); tokens/s: output tokens over the level's wall time.
The client shares the CPU with the server, so on a small machine its own cost is in the numbers.
Writes a table to stdout and the plot `benchmarks/figures/server_latency.png`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN, MAX_TOKENS = 64, 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(path: str, port: int, device: str = "cpu") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv", "serve", path, "--port", str(port),
                             "--device", device, "--served-model-name", "m", "--memory-budget-mb", "128", "--max-num-seqs", "64",
                             "--log-level", "warning"], cwd=ROOT, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited at start-up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start in 120 s")


async def one(client: httpx.AsyncClient, prompt: list[int]) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    first, last, gaps, n = None, None, [], 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            k = len(json.loads(line[6:])["choices"][0].get("token_ids", []))
            if not k:
                continue
            now = time.perf_counter()
            if first is None:
                first = now  # the first chunk has a TTFT, not a gap
            else:
                gaps += [(now - last) / k] * k
            last, n = now, n + k
    return {"ttft": first - t0, "gaps": gaps, "tokens": n, "e2e": last - t0}


async def level(url: str, c: int, num: int, vocab: int, rng: random.Random) -> dict:
    prompts = [[rng.randrange(4, vocab) for _ in range(PROMPT_LEN)] for _ in range(num)]
    sem = asyncio.Semaphore(c)
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async def run(p):
            async with sem:
                return await one(client, p)

        t0 = time.perf_counter()
        res = await asyncio.wait_for(asyncio.gather(*(run(p) for p in prompts)), 900)
        wall = time.perf_counter() - t0
    ttft = sorted(r["ttft"] for r in res)
    itl = sorted(g for r in res for g in r["gaps"])
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    return {"concurrency": c, "requests": num, "wall_s": wall, "req_per_s": num / wall,
            "out_tok_per_s": sum(r["tokens"] for r in res) / wall,
            "ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p99_ms": 1e3 * q(ttft, 0.99),
            "itl_p50_ms": 1e3 * statistics.median(itl), "itl_p99_ms": 1e3 * q(itl, 0.99)}


def bench(family: str, levels: list[int], min_requests: int, device: str = "cpu") -> list[dict]:
    from hybridkv.models.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_checkpoint(family, d)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        port = _free_port()
        proc = start_server(str(path), port, device)
        try:
            rng = random.Random(0)
            out = []
            for c in levels:
                r = asyncio.run(level(f"http://127.0.0.1:{port}", c, max(min_requests, 2 * c), vocab, rng))
                out.append({"model": family, **r})
                print(f"{family:6s} c={c:3d}  {r['req_per_s']:7.2f} req/s  {r['out_tok_per_s']:8.1f} tok/s  "
                      f"TTFT p50 {r['ttft_p50_ms']:7.1f} ms p99 {r['ttft_p99_ms']:7.1f} ms  "
                      f"ITL p50 {r['itl_p50_ms']:6.1f} ms p99 {r['itl_p99_ms']:7.1f} ms", flush=True)
            return out
        finally:
            proc.terminate()
            proc.wait(30)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for family in sorted({r["model"] for r in rows}):
        rs = [r for r in rows if r["model"] == family]
        cs = [r["concurrency"] for r in rs]
        for ax, key in zip(axes, ["ttft", "itl"]):
            ax.plot(cs, [r[f"{key}_p50_ms"] for r in rs], "o-", label=f"{family} p50")
            ax.plot(cs, [r[f"{key}_p99_ms"] for r in rs], "x--", label=f"{family} p99")
    for ax, title in zip(axes, ["time to first token", "inter-token latency"]):
        ax.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms", title=title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 4, 8 requests each (a smoke run)")
    ap.add_argument("--models", default="bamba,llama")
    ap.add_argument("--device", default="cpu", help="the server's --device (the BENCHMARKS.md table: cpu)")
    ap.add_argument("--plot", default=str(ROOT / "benchmarks" / "figures" / "server_latency.png"))
    args = ap.parse_args(argv)
    levels, min_req = ([1, 4], 8) if args.quick else ([1, 8, 32, 64], 16)
    print(f"machine: {platform.machine()}, {platform.processor() or '?'}; python {platform.python_version()}; "
          f"server device {args.device}")
    rows = [r for family in args.models.split(",") for r in bench(family, levels, min_req, args.device)]
    if args.plot:
        plot(rows, Path(args.plot))
        print(f"plot: {args.plot}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
