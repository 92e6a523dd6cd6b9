"""Quantized caches (issue 27): what int8 / fp8_e4m3 KV pages and state slots cost in quality and speed,
against the same engine with the model's dtype (float32), measured in one run.

Parts (`--part`, default all):
- quality: the built-in trained model (hybridkv/tiny-code, a small Bamba: Mamba2 + 2 attention layers).
  * held-out bits per byte: the first `--windows` windows of 512 tokens of its held-out standard-library
    files (examples/train_tiny.py), scored through the engine (prompt_logprobs) ONE TOKEN A STEP
    (max_num_batched_tokens=1), so every position reads the KV and the state through the pools, as
    decoding does (a one-chunk prefill would keep the chunk's own keys and states at full precision).
  * greedy agreement: 16 held-out prompts of 64 tokens, 256 greedy tokens each; the share of
    positions where the quantized engine's token equals the unquantized one's (compared position by
    position, so one early divergence costs the rest), and the mean position of the first divergence.
- kl: every family of the family table (random tiny checkpoints, tests/family_checks.py): a prompt of
  24 tokens and its 40-token greedy continuation fed one token a step; mean KL(unquantized ||
  quantized) of the next-token distributions over those positions, in nats.
- scales: the KV row (a scale per token and head, or per block and head), measured on tiny-code's pages.
- speed: generated tokens per CPU second of tiny-code (8 prompts x 128 tokens), quantized / unquantized,
  1 thread, alternating, median of `--repeats` with min-max; then the same for a tiny random Qwen3-Next
  of tiny-code's width (GDN_MODEL: the GDN layers' decode reads its quantized slots in place too).

    python benchmarks/bench_quantized.py --windows 8 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MODEL = "hybridkv/tiny-code"
CONFIGS = {"int8 KV + int8 state": ("int8", "int8"), "fp8 KV + fp8 state": ("fp8_e4m3", "fp8_e4m3"),
           "int8 KV only": ("int8", "auto"), "int8 state only": ("auto", "int8")}
CONTEXT = 512


def llm(kv="auto", state="auto", **kw):
    from hybridkv import LLM

    return LLM(kw.pop("model", MODEL), kv_cache_dtype=kv, state_cache_dtype=state, memory_budget_bytes=64 << 20, **kw)


def held_out_texts() -> list[str]:
    sys.path.insert(0, str(ROOT / "examples"))
    import train_tiny

    _, _, held = train_tiny.stdlib_files()
    return [train_tiny.read(p) for p in held]


def held_out_windows(tokenizer, n: int) -> list[list[int]]:
    stream = []
    for text in held_out_texts():
        stream += tokenizer.encode(text) + [tokenizer.eos_token_id]
    return [stream[i:i + CONTEXT + 1] for i in range(0, CONTEXT * n, CONTEXT)]


def bits_per_byte(engine, windows: list[list[int]]) -> float:
    """Summed -log2 p of every token after a window's first, over the UTF-8 bytes of those tokens."""
    from hybridkv import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    nats = nbytes = 0
    for w in windows:
        out = engine.generate([{"prompt_token_ids": w}], params, use_tqdm=False)[0]
        for tok, pos in zip(w[1:], out.prompt_logprobs[1:]):
            nats -= pos[tok].logprob
        nbytes += len(engine.tokenizer.decode(w[1:]).encode("utf-8"))
    return nats / math.log(2) / nbytes


def greedy_agreement(engines: dict, tokenizer, n_prompts=16, prompt_len=64, gen=256) -> dict:
    from hybridkv import SamplingParams

    prompts = [{"prompt_token_ids": tokenizer.encode(t)[:prompt_len]} for t in held_out_texts()[:n_prompts]]
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    runs = {name: [o.outputs[0].token_ids for o in e.generate(prompts, params, use_tqdm=False)]
            for name, e in engines.items()}
    base = runs.pop("float32")
    out = {}
    for name, toks in runs.items():
        same = sum(a == b for x, y in zip(base, toks) for a, b in zip(x, y))
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), gen) for x, y in zip(base, toks)]
        out[name] = {"agreement": same / sum(len(x) for x in base), "mean_first_divergence": statistics.mean(first)}
    return out


def part_quality(windows: int) -> dict:
    engines = {"float32": llm(max_num_batched_tokens=1)}
    engines.update({name: llm(kv, st, max_num_batched_tokens=1) for name, (kv, st) in CONFIGS.items()})
    tok = engines["float32"].tokenizer
    wins = held_out_windows(tok, windows)
    bpb = {name: bits_per_byte(e, wins) for name, e in engines.items()}
    agree = greedy_agreement({n: llm(*CONFIGS[n]) if n in CONFIGS else llm() for n in engines}, tok)
    return {"windows": windows, "bits_per_byte": bpb,
            "bpb_ratio": {n: bpb[n] / bpb["float32"] for n in CONFIGS}, "greedy": agree}


class _Logits:
    """Wraps a runner's model: records every logits row the forward returns."""

    def __init__(self, model):
        self.model, self.rows = model, []

    def __call__(self, batch, caches):
        out = self.model(batch, caches)
        self.rows.append(out.float().clone())
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def family_kl(name: str, root: Path) -> float:
    sys.path.insert(0, str(ROOT / "tests"))
    from family_checks import FAMILIES, prompt
    from hybridkv import SamplingParams

    fam = FAMILIES[name]
    path = str(fam.make(fam.name, root / name, seed=fam.seed, **fam.overrides))
    p = prompt(24, 5)
    cont = llm(model=path).generate([p], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0].token_ids
    rows = []
    for kv, st in (("auto", "auto"), ("int8", "int8")):
        e = llm(kv, st, model=path, max_num_batched_tokens=1)
        rec = e.engine.runner.model = _Logits(e.engine.runner.model)
        e.generate([{"prompt_token_ids": p + list(cont)}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                   use_tqdm=False)
        rows.append(torch.cat(rec.rows)[len(p) - 1:])  # the positions that read the continuation's caches
    ref, q = (torch.log_softmax(r, dim=-1) for r in rows)
    return float((ref.exp() * (ref - q)).sum(-1).mean())


def part_kl() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from family_checks import FAMILIES

    with tempfile.TemporaryDirectory() as tmp:
        return {name: family_kl(name, Path(tmp)) for name in FAMILIES if not FAMILIES[name].builtin}


def part_scales() -> dict:
    """The KV row choice: tiny-code's KV pages after 4 held-out windows (float32 engine), quantized to
    int8 with a scale per token and head (what the pools keep) and with one per block and head (16
    tokens x head_dim): relative RMS error of the keys and values, and bytes per value."""
    from hybridkv import SamplingParams
    from hybridkv.cache_dtype import QuantLayout

    e = llm(max_num_batched_tokens=512)
    wins = held_out_windows(e.tokenizer, 4)
    rid_blocks = []
    for w in wins:
        rid = e.add_request({"prompt_token_ids": w[:CONTEXT]}, SamplingParams(max_tokens=1))
        e.step()
        rid_blocks += e.manager.attention.block_table([rid]).flatten().tolist()[:CONTEXT // 16]
        while e.has_unfinished_requests():
            e.step()
    out = {}
    for layer, pages in e.manager.kv_caches.items():
        x = pages[torch.tensor(rid_blocks)]  # [n, 2, 16, heads, D]
        D = x.shape[-1]
        per_token = QuantLayout("int8", (D,), 0)
        blockwise = x.permute(0, 1, 3, 2, 4)  # [n, 2, heads, 16, D]: one scale per block, part and head
        flat = blockwise.reshape(*blockwise.shape[:3], 16 * D)
        one = QuantLayout("int8", (16 * D,), 0)
        for name, got in (("per token and head", per_token.decode(per_token.encode(x))),
                          ("per block and head", one.decode(one.encode(flat)).reshape(blockwise.shape).permute(0, 1, 3, 2, 4))):
            for part, label in ((0, "keys"), (1, "values")):
                err = float((got[:, part] - x[:, part]).pow(2).mean().sqrt() / x[:, part].pow(2).mean().sqrt())
                out.setdefault(name, {}).setdefault(label, []).append(err)
        out["bytes_per_value"] = {"per token and head": per_token.nbytes / D, "per block and head": one.nbytes / (16 * D)}
    return {k: ({kk: statistics.mean(vv) for kk, vv in v.items()} if k != "bytes_per_value" else v) for k, v in out.items()}


def part_speed(repeats: int) -> dict:
    """tiny-code: the float32 engine, int8 KV + int8 state, int8 state only, alternating."""
    engines = {"float32": llm(), "int8 KV + int8 state": llm("int8", "int8"), "int8 state only": llm("auto", "int8")}
    tok = engines["float32"].tokenizer
    return timed_generation(engines, [{"prompt_token_ids": tok.encode(t)[:64]} for t in held_out_texts()[:8]], repeats)


# a tiny random Qwen3-Next (models/tiny.py) at tiny-code's width: GDN layers of 2 key heads and 4 value heads
# of 64 (conv window 384 x 3, state 4 x 64 x 64) and 2 attention layers, dense MLPs
GDN_MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=64, linear_value_head_dim=64, num_experts=0, vocab_size=4096,
                 layer_types=["linear_attention", "linear_attention", "full_attention"] * 2)


def part_speed_gdn(repeats: int) -> dict:
    """The GDN path: a tiny Qwen3-Next (GDN_MODEL), float32 against int8 KV + int8 state, alternating."""
    from hybridkv.models.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_checkpoint("qwen3_next", Path(tmp), seed=3, **GDN_MODEL))
        engines = {"float32": llm(model=path), "int8 KV + int8 state": llm("int8", "int8", model=path)}
        g = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(4, 4096, (64,), generator=g).tolist()} for _ in range(8)]
        return timed_generation(engines, prompts, repeats)


def timed_generation(engines: dict, prompts: list, repeats: int) -> dict:
    """Generated tokens per CPU second of each engine (8 prompts x 128 greedy tokens), alternating; the
    time ratio to "float32" per repeat: median and min-max."""
    from hybridkv import SamplingParams

    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    times = {n: [] for n in engines}
    for e in engines.values():  # warm-up
        e.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)
    for _ in range(repeats):
        for name, e in engines.items():
            c0 = time.process_time()
            e.generate(prompts, params, use_tqdm=False)
            times[name].append(time.process_time() - c0)
    tokens = len(prompts) * params.max_tokens
    out = {"tokens": tokens, "cpu_s": times}
    for name in engines:
        ratios = [t / b for t, b in zip(times[name], times["float32"])]
        out[name] = {"tok_per_cpu_s": tokens / statistics.median(times[name]),
                     "time_ratio_median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def print_speed(title: str, s: dict, repeats: int) -> None:
    print(f"{title}, 8 prompts x 128 tokens, 1 thread, CPU time, median of {repeats} (min-max):")
    for name in s["cpu_s"]:
        v = s[name]
        print(f"  {name:22s} {v['tok_per_cpu_s']:.0f} tok/CPU-s; time {v['time_ratio_median']:.2f}x float32 "
              f"({v['min']:.2f}-{v['max']:.2f})")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["quality", "kl", "scales", "speed", "all"], default="all")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows of 512 tokens scored (quality)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {}
    if a.part in ("quality", "all"):
        q = res["quality"] = part_quality(a.windows)
        print(f"held-out bits per byte, {a.windows} windows of {CONTEXT} tokens, one token a step:")
        for name, v in q["bits_per_byte"].items():
            ratio = f"  ({q['bpb_ratio'][name]:.4f}x, {100 * (q['bpb_ratio'][name] - 1):+.2f}%)" if name in CONFIGS else ""
            print(f"  {name:22s} {v:.4f}{ratio}")
        print("greedy agreement with float32 caches, 16 held-out prompts x 256 tokens:")
        for name, v in q["greedy"].items():
            print(f"  {name:22s} {v['agreement']:.3f} of tokens; first divergence at token {v['mean_first_divergence']:.0f} on average")
    if a.part in ("kl", "all"):
        kl = res["kl"] = part_kl()
        print("mean KL(float32 || int8 KV + int8 state) of next-token distributions, nats, per family:")
        for name, v in kl.items():
            print(f"  {name:22s} {v:.2e}")
    if a.part in ("scales", "all"):
        sc = res["scales"] = part_scales()
        print("KV rows, tiny-code pages after 4 held-out windows, int8: relative RMS error (keys / values), bytes a value:")
        for name in ("per token and head", "per block and head"):
            print(f"  {name:20s} {sc[name]['keys']:.4f} / {sc[name]['values']:.4f}; {sc['bytes_per_value'][name]:.3f} B")
    if a.part in ("speed", "all"):
        res["speed"], res["speed_gdn"] = part_speed(a.repeats), part_speed_gdn(a.repeats)
        print_speed("tiny-code", res["speed"], a.repeats)
        print_speed("tiny Qwen3-Next (GDN)", res["speed_gdn"], a.repeats)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
