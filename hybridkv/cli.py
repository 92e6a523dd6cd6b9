"""The `hybridkv` command: `hybridkv demo` (a few seconds on the built-in code model) and
`hybridkv serve [CHECKPOINT]` (an OpenAI-compatible HTTP server). Also `python -m hybridkv`.
Both default to the built-in `hybridkv/tiny-code` (hybridkv/builtin_models/); `--random-tiny`
runs the tiny random-weight Bamba instead.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from typing import Optional

from hybridkv.cache_dtype import CACHE_DTYPES
from hybridkv.checkpoint_policy import DEFAULT_POLICY, POLICIES
from hybridkv.eviction import DEFAULT_EVICTION, EVICTION_RULES

DEFAULT_MODEL = "hybridkv/tiny-code"  # a built-in name (models/loader.py: builtin_models)
DEFAULT_NOTICE = ("hybridkv/tiny-code, a small Bamba (Mamba2 + attention) trained on the Python "
                  "standard library: a completion model for Python code")
TINY_FAMILY = "bamba"
TINY_NOTICE = ("built-in tiny Bamba (Mamba2 + attention), RANDOM weights: the text is noise; "
               "this shows the engine, not a model")


def build_tiny(directory: str) -> str:
    """Write the built-in tiny random Bamba (with a character-level tokenizer) to `directory`."""
    from transformers.utils import logging as hf_logging

    from hybridkv.models.tiny import make_tiny_checkpoint

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar for a 1 MB file
    return str(make_tiny_checkpoint(TINY_FAMILY, directory))


# ---- LLM options, shared by serve (and anything else that builds an LLM from flags) ----------
def add_llm_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("engine (the LLM(...) options)")
    g.add_argument("--device", default="auto", help="auto (cuda if available, else cpu) | cpu | cuda[:i] (default auto)")
    g.add_argument("--dtype", default="auto", help="auto (the checkpoint's dtype from config.json, float32 if it names none) | float32 | float16 | bfloat16 (default auto, as vLLM)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--memory-budget-mb", type=int, default=None,
                   help="MiB for KV blocks + state slots (default: 1024 on a CPU, measured on a GPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--preemption-mode", default="auto", choices=["auto", "recompute", "swap"])
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks sharing each forward over torch.distributed (gloo on CPU, NCCL on GPU; default 1)")
    g.add_argument("--checkpoint-policy", default=DEFAULT_POLICY, choices=list(POLICIES))
    g.add_argument("--checkpoint-every-n", type=int, default=4)
    g.add_argument("--checkpoint-eviction", default=DEFAULT_EVICTION, choices=list(EVICTION_RULES))
    g.add_argument("--checkpoint-share", type=float, default=None)
    g.add_argument("--host-cache-mb", type=int, default=0,
                   help="host memory (MiB) for state checkpoints evicted from the device pool (default 0: none)")
    g.add_argument("--disk-cache", default=None, metavar="DIR",
                   help="directory for a disk tier of KV blocks and state checkpoints that survives restarts "
                        "(default: none)")
    g.add_argument("--disk-cache-gb", type=float, default=16.0,
                   help="GiB the disk tier may keep in DIR for this model (default 16)")
    g.add_argument("--no-disk-read-ahead", dest="disk_read_ahead", action="store_false",
                   help="read a hit's disk files in its admission, on the step's thread (default: on a reader "
                        "thread while the request waits)")
    g.add_argument("--verify-cache-hits", type=float, default=0.0,
                   help="fraction of prefix hits recomputed cold in the background and compared (default 0: off)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(CACHE_DTYPES),
                   help="KV pages: auto (the model's dtype) | int8 | fp8_e4m3 (a byte a value, a scale per token and head)")
    g.add_argument("--state-cache-dtype", default="auto", choices=list(CACHE_DTYPES),
                   help="recurrent state slots: auto | int8 | fp8_e4m3 (a byte a value, a scale per state row)")
    g.add_argument("--quantize-stochastic", action="store_true",
                   help="round int8 cache codes stochastically (seeded by --seed) instead of to nearest")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="replay decode steps as CUDA graphs (GPU only; never run on a GPU yet, so off by default)")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding, JSON in vLLM\'s shape, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (default off)')


def llm_kwargs(args: argparse.Namespace) -> dict:
    """The LLM(...) keyword arguments that `add_llm_args` flags name."""
    budget = None if args.memory_budget_mb is None else args.memory_budget_mb << 20
    return dict(device=args.device, dtype=args.dtype, block_size=args.block_size,
                memory_budget_bytes=budget, gpu_memory_utilization=args.gpu_memory_utilization,
                enable_prefix_caching=args.enable_prefix_caching, preemption_mode=args.preemption_mode,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
                checkpoint_policy=args.checkpoint_policy, checkpoint_every_n=args.checkpoint_every_n,
                checkpoint_eviction=args.checkpoint_eviction, checkpoint_share=args.checkpoint_share,
                cuda_graphs=args.cuda_graphs, speculative_config=args.speculative_config,
                host_cache_bytes=args.host_cache_mb << 20, disk_cache_dir=args.disk_cache,
                disk_cache_bytes=int(args.disk_cache_gb * (1 << 30)), disk_read_ahead=args.disk_read_ahead,
                verify_cache_hits=args.verify_cache_hits,
                kv_cache_dtype=args.kv_cache_dtype, state_cache_dtype=args.state_cache_dtype,
                quantize_stochastic=args.quantize_stochastic)


# ---- hybridkv demo ---------------------------------------------------------------------------
# Every prompt starts with this module header; the follow-up's prefix hit covers it and more.
HEADER = '''"""Small helpers for numbers, sequences and text.

Each function is short, tested and documented.
"""
import math


'''


def _run(llm, requests: list[tuple[str, str, object]]) -> dict:
    """Add (request id, prompt, params) triples, step until all finish; returns id -> output."""
    for rid, prompt, params in requests:
        llm.add_request(prompt, params, request_id=rid)
    done = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _print_completion(tag: str, prompt: str, out, o) -> None:
    """A header line, then the prompt past HEADER and the completed text, each line behind '  | '."""
    print(f"[{tag}] prompt {len(out.prompt_token_ids)} tokens ({out.num_cached_tokens} from the prefix "
          f"cache) -> {len(o.token_ids)} tokens ({o.finish_reason}):")
    for line in (prompt[len(HEADER):] + o.text).rstrip().split("\n"):
        print(f"  | {line.rstrip()}")


def demo(max_tokens: int = 40, random_tiny: bool = False) -> int:
    """Complete a few Python prompts on the built-in code model (or the tiny random Bamba) and print
    the text and the engine's stats; returns 0."""
    from hybridkv import LLM, SamplingParams

    t0 = time.perf_counter()
    print(f"hybridkv demo: {TINY_NOTICE if random_tiny else DEFAULT_NOTICE}")
    with tempfile.TemporaryDirectory() as d:
        llm = LLM(build_tiny(d) if random_tiny else DEFAULT_MODEL, device="cpu", dtype="float32",
                  block_size=16, memory_budget_bytes=32 << 20)
        s = llm.stats()
        print(f"pools: {s['kv_blocks_total']} KV blocks of 16 tokens, {s['state_slots_total']} state slots")
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        first = HEADER + "def fibonacci(n):"  # no newline: the tokenizer joins it with the indent
        waves = [
            [("first", first, greedy)],
            # extends the first prompt (a docstring): its KV blocks and prompt-end state are reused
            [("follow-up", first + '\n    """Return the n-th Fibonacci number, counting from 0."""', greedy),
             ("n=2", HEADER + "class Stack:",
              SamplingParams(n=2, max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=7))],
        ]
        for wave in waves:
            done = _run(llm, wave)
            for rid, prompt, _ in wave:
                out = done[rid]
                for o in out.outputs:
                    _print_completion(rid if len(out.outputs) == 1 else f"{rid}[{o.index}]", prompt, out, o)
        s = llm.stats()
    print("stats:")
    print(f"  KV blocks used {s['kv_blocks_used']}, cached {s['kv_blocks_cached']}, total {s['kv_blocks_total']}")
    print(f"  state slots live {s['state_slots_live']}, checkpoints {s['state_slots_checkpoint']}, "
          f"total {s['state_slots_total']}")
    print(f"  prefix hits: {s['prefix_hit_tokens']} of {s['prefix_query_tokens']} prompt tokens "
          f"({s['prefix_hit_rate']:.0%}); misses {json.dumps(s['prefix_misses'])}")
    print(f"  preemptions {json.dumps(s['preemptions'])}, forks {s['forks']}")
    print(f"  {s['generated_tokens']} tokens generated, {s['tokens_per_second']:.0f} tokens/s computed")
    print(f"done in {time.perf_counter() - t0:.1f} s. Serve it over HTTP: hybridkv serve")
    return 0


# ---- hybridkv serve --------------------------------------------------------------------------
def serve(args: argparse.Namespace) -> int:
    from hybridkv import LLM
    from hybridkv.server.app import run_server
    from hybridkv.server.request_body import HTTPLimits

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("hybridkv.serve")
    with tempfile.TemporaryDirectory() as d:
        if args.random_tiny:
            if args.checkpoint is not None:
                log.error("--random-tiny serves the tiny random Bamba; drop it or the checkpoint %r", args.checkpoint)
                return 2
            log.warning("--random-tiny: serving the %s", TINY_NOTICE)
            path, default_name = build_tiny(d), f"tiny-{TINY_FAMILY}-random"
        elif args.checkpoint is None:
            log.info("no checkpoint given: serving the built-in %s", DEFAULT_NOTICE)
            path = default_name = DEFAULT_MODEL
        else:
            path = default_name = args.checkpoint
        name = args.served_model_name or default_name
        try:
            limits = HTTPLimits(int(args.max_body_mb * (1 << 20)), args.max_prompts_per_request)
        except ValueError as e:
            log.error("--max-body-mb / --max-prompts-per-request: %s", e)
            return 2
        http = dict(host=args.host, port=args.port, api_key=args.api_key, limits=limits,
                    log_stats_interval=args.log_stats_interval, shutdown_timeout=args.shutdown_timeout)
        if args.data_parallel_size != 1:  # N engine processes behind this server (server/replicas.py)
            from hybridkv.server.replicas import run_replicas_server

            return run_replicas_server(path, name, args.data_parallel_size, llm_kwargs(args), **http)
        try:
            llm = LLM(path, **llm_kwargs(args))
        except (ValueError, OSError) as e:  # a bad option or checkpoint: say what, not a traceback
            log.error("cannot serve %s: %s", path, e)
            return 2
        return run_server(llm, name, **http)


def parser() -> argparse.ArgumentParser:
    from hybridkv import __version__
    from hybridkv.server.request_body import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PROMPTS

    ap = argparse.ArgumentParser(prog="hybridkv", description="Serve hybrid language models.")
    ap.add_argument("--version", action="version", version=f"hybridkv {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help=f"a few Python prompts completed by the built-in {DEFAULT_MODEL}; "
                                    "prints the text and the engine's stats")
    d.add_argument("--max-tokens", type=int, default=40)
    d.add_argument("--random-tiny", action="store_true", help="the tiny random-weight Bamba instead (noise)")
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    s.add_argument("checkpoint", nargs="?", default=None,
                   help=f"a checkpoint directory, a cached model id or a built-in name (default {DEFAULT_MODEL})")
    s.add_argument("--random-tiny", action="store_true",
                   help="serve the tiny random-weight Bamba instead (for tests: its text is noise)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: the path)")
    s.add_argument("--log-level", default="info")
    s.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between engine stats lines")
    s.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / (1 << 20),
                   help="largest request body in MiB; a bigger one gets a 413 (default %(default)g)")
    s.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS,
                   help="most prompts in one /v1/completions request; more get a 400 (default %(default)d)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running requests get to finish after SIGTERM / SIGINT before they end "
                        "with finish_reason 'abort' (a second signal aborts at once; default %(default)g)")
    s.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine processes (replicas) behind this server, with prefix-aware routing (default 1)")
    add_llm_args(s)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "demo":
        return demo(args.max_tokens, random_tiny=args.random_tiny)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
