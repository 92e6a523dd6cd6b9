"""Train the built-in models: a small Bamba code model and its draft, on the interpreter's stdlib.

    python examples/train_tiny.py --out hybridkv/builtin_models        # both, ~60 min on 2 cores
    python examples/train_tiny.py --only draft --steps 50 --out /tmp/x  # a quick look

Data: every `.py` file of the running interpreter's standard library
(`sysconfig.get_paths()["stdlib"]`; no `test/`, `tests/`, `idle_test/`, `site-packages`), PSF
licensed. The files in HELD_OUT never reach the tokenizer or the models: they measure the
held-out loss in bits per byte (UTF-8 bytes of the held-out text, so tokenizers compare).

Tokenizer: byte-level BPE (`tokenizers`), VOCAB_SIZE ids, one special `<|endoftext|>` that ends
every file. Models: transformers' own `BambaForCausalLM` (Mamba2 + attention), so each saved
folder is a plain HF checkpoint and transformers is its oracle. Fixed seed, fixed step count:
the same command on the same Python gives the same weights (up to torch's CPU float order).

Each folder gets config.json, generation_config.json, model.safetensors (bf16), tokenizer.json
and a model card (README.md) with the figures this run printed, measured on the bf16 weights.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

VOCAB_SIZE = 4096
EOT = "<|endoftext|>"
SEED = 0
# Held-out modules, named once: ~330 KB of varied code (text processing, numbers, data, I/O).
HELD_OUT = ("textwrap.py", "shlex.py", "fractions.py", "heapq.py", "bisect.py", "difflib.py",
            "json/decoder.py", "calendar.py", "statistics.py", "csv.py", "string.py",
            "email/_parseaddr.py", "sched.py", "colorsys.py", "graphlib.py")

TARGET = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, attn_layer_indices=[2, 5],
              num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=64,
              mamba_n_groups=1, mamba_d_state=32, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=64)
DRAFT = dict(hidden_size=128, intermediate_size=320, num_hidden_layers=2, attn_layer_indices=[1],
             num_attention_heads=2, num_key_value_heads=1, mamba_n_heads=4, mamba_d_head=64,
             mamba_n_groups=1, mamba_d_state=32, mamba_d_conv=4, mamba_expand=2,
             mamba_chunk_size=64)
# steps x batch x context: ~40 min (target) and ~8 min (draft) on one core of the 2-core VM.
RECIPES = {"target": dict(config=TARGET, steps=520, batch=8, lr=2e-3, name="tiny-code"),
           "draft": dict(config=DRAFT, steps=600, batch=8, lr=3e-3, name="tiny-code-draft")}
QUICK_WINDOWS = 8  # the first windows of the held-out stream: the figure a test re-measures
CONTEXT = 512


def stdlib_files() -> tuple[Path, list[Path], list[Path]]:
    """(stdlib root, training files, held-out files), each list sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages"}
    every = sorted(p for p in root.rglob("*.py")
                   if not skip.intersection(p.relative_to(root).parts[:-1]))
    held = [root / name for name in HELD_OUT]
    missing = [str(p) for p in held if not p.is_file()]
    if missing:
        raise SystemExit(f"held-out files missing from this interpreter's stdlib: {missing}")
    held_set = set(held)
    return root, [p for p in every if p not in held_set], held


def read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(texts: list[str]):
    """A byte-level BPE PreTrainedTokenizerFast of VOCAB_SIZE ids trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token=EOT,
                                   pad_token=EOT, unk_token=None, clean_up_tokenization_spaces=False)


def encode_stream(tokenizer, texts: list[str]) -> np.ndarray:
    """Every text's ids followed by EOT, concatenated (uint16)."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        ids.append(eot)
    return np.asarray(ids, dtype=np.uint16)


def bamba_config(shape: dict, tokenizer):
    from transformers import BambaConfig

    eot = tokenizer.convert_tokens_to_ids(EOT)
    return BambaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       initializer_range=0.02, pad_token_id=eot, bos_token_id=eot,
                       eos_token_id=eot, tie_word_embeddings=True, use_mamba_kernels=False,
                       architectures=["BambaForCausalLM"], **shape)


@torch.no_grad()
def held_out_nats(model, stream: np.ndarray, windows: int | None = None) -> float:
    """Summed next-token NLL (nats) over `stream` (or its first `windows` windows), cut into
    CONTEXT+1-token windows overlapping by one."""
    model.eval()
    total = 0.0
    for start in list(range(0, len(stream) - 1, CONTEXT))[:windows]:
        chunk = torch.from_numpy(stream[start:start + CONTEXT + 1].astype(np.int64))[None]
        logits = model(chunk[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
    model.train()
    return total


def ngram_baselines(train: np.ndarray, held: np.ndarray) -> tuple[float, float]:
    """Held-out nats of add-one unigram and interpolated (0.9 / 0.1) bigram models of `train`."""
    v = VOCAB_SIZE
    uni = np.bincount(train, minlength=v).astype(np.float64) + 1.0
    uni /= uni.sum()
    nxt, prev = held[1:].astype(np.int64), held[:-1].astype(np.int64)
    uni_nats = float(-np.log(uni[nxt]).sum())
    pairs = train[:-1].astype(np.int64) * v + train[1:].astype(np.int64)
    big = np.bincount(pairs, minlength=v * v).reshape(v, v).astype(np.float64)
    rows = big.sum(axis=1, keepdims=True)
    cond = np.divide(big, rows, out=np.zeros_like(big), where=rows > 0)
    p = 0.9 * cond[prev, nxt] + 0.1 * uni[nxt]
    return uni_nats, float(-np.log(p).sum())


def train_model(kind: str, tokenizer, train: np.ndarray, steps: int | None, log_every: int):
    from transformers import BambaForCausalLM

    recipe = RECIPES[kind]
    steps = steps or recipe["steps"]
    torch.manual_seed(SEED)
    model = BambaForCausalLM(bamba_config(recipe["config"], tokenizer))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{kind}] {n_params / 1e6:.2f} M parameters, {steps} steps x {recipe['batch']} x {CONTEXT} tokens",
          flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=recipe["lr"], betas=(0.9, 0.95))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    rng = np.random.default_rng(SEED)
    t0 = time.process_time()
    for step in range(steps):
        starts = rng.integers(0, len(train) - CONTEXT - 1, size=recipe["batch"])
        batch = torch.from_numpy(np.stack([train[s:s + CONTEXT + 1] for s in starts]).astype(np.int64))
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"[{kind}] step {step}/{steps} loss {loss.item():.3f} "
                  f"({time.process_time() - t0:.0f} s CPU)", flush=True)
    return model, n_params, steps, time.process_time() - t0


@torch.no_grad()
def draft_agreement(target, draft, tokenizer, held_texts: list[str], n_prompts: int = 16,
                    prompt_tokens: int = 64, new_tokens: int = 64) -> float:
    """Fraction of the target's greedy tokens that the draft's greedy choice equals, given the
    target's own prefix (what chain speculation accepts), over held-out prompts."""
    target.eval(), draft.eval()
    hits = total = 0
    for text in held_texts[:n_prompts]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:prompt_tokens]
        seq = torch.tensor([ids])
        for _ in range(new_tokens):  # greedy, recomputed each step: no cache semantics involved
            seq = torch.cat([seq, target(seq).logits[:, -1:].argmax(-1)], dim=1)
        guess = draft(seq).logits[0, len(ids) - 1:-1].argmax(-1)
        hits += int((guess == seq[0, len(ids):]).sum())
        total += new_tokens
    return hits / total


def save(kind: str, model, tokenizer, out: Path, card: dict) -> Path:
    folder = out / RECIPES[kind]["name"]
    folder.mkdir(parents=True, exist_ok=True)
    model.config.use_mamba_kernels = False
    model.to(torch.bfloat16).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    eot = tokenizer.convert_tokens_to_ids(EOT)
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.95, "max_new_tokens": 128,
         "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}, indent=2) + "\n")
    for leftover in ("special_tokens_map.json",):
        (folder / leftover).unlink(missing_ok=True)
    (folder / "README.md").write_text(model_card(kind, card))
    (folder / "training.json").write_text(json.dumps(card, indent=2) + "\n")
    return folder


def model_card(kind: str, c: dict) -> str:
    role = ("the built-in target of `hybridkv demo` / `hybridkv serve`" if kind == "target"
            else "the draft model of `hybridkv/tiny-code` (same tokenizer) for speculative decoding")
    return f"""# hybridkv/{RECIPES[kind]['name']}

A {c['parameters_m']:.2f} M-parameter `BambaForCausalLM` (Mamba2 + attention at layers
{RECIPES[kind]['config']['attn_layer_indices']}), {role}. A completion model for Python code;
it has no chat template and no instruction tuning.

- **Data**: the `.py` files of the CPython {c['python']} standard library (no `test/`, `tests/`,
  `idle_test/`, `site-packages`): {c['train_files']} files, {c['train_bytes'] / 1e6:.1f} MB, {c['train_tokens'] / 1e6:.2f} M tokens.
  Licence of the data: Python Software Foundation License (PSF-2.0).
- **Held out**: {len(HELD_OUT)} files ({c['held_bytes'] / 1e3:.0f} KB, {c['held_tokens']} tokens): {', '.join(HELD_OUT)}.
- **Tokenizer**: byte-level BPE, {VOCAB_SIZE} ids, `{EOT}` ends each file (and is bos / eos / pad).
- **Training**: {c['steps']} steps x {c['batch']} x {CONTEXT} tokens ({c['tokens_seen'] / 1e6:.1f} M tokens),
  AdamW, seed {SEED}, {c['cpu_minutes']:.0f} CPU minutes on one core of a 2-core x86 VM.
  Command: `python examples/train_tiny.py --out hybridkv/builtin_models`.
- **Weights**: bf16 safetensors; every figure below is measured on them.

| held-out bits per byte | |
| --- | --- |
| this model | **{c['held_out_bits_per_byte']:.4f}** |
| unigram baseline (same tokens) | {c['unigram_bits_per_byte']:.4f} |
| bigram baseline (same tokens) | {c['bigram_bits_per_byte']:.4f} |
""" + (f"\nDraft greedy agreement with the target: {c['draft_agreement']:.3f} (of the target's greedy "
       "tokens on 16 held-out prompts, 64 each).\n" if "draft_agreement" in c else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("hybridkv/builtin_models"))
    ap.add_argument("--only", choices=["target", "draft"], default=None)
    ap.add_argument("--steps", type=int, default=None, help="override each recipe's step count")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    root, train_paths, held_paths = stdlib_files()
    train_texts, held_texts = [read(p) for p in train_paths], [read(p) for p in held_paths]
    tokenizer = train_tokenizer(train_texts)
    train, held = encode_stream(tokenizer, train_texts), encode_stream(tokenizer, held_texts)
    held_bytes = sum(len(t.encode("utf-8")) for t in held_texts)
    uni, big = ngram_baselines(train, held)
    to_bpb = lambda nats: nats / math.log(2) / held_bytes  # noqa: E731
    base = dict(python=sys.version.split()[0], train_files=len(train_paths),
                train_bytes=sum(len(t.encode("utf-8")) for t in train_texts),
                train_tokens=len(train), held_bytes=held_bytes, held_tokens=len(held),
                held_out_sha256={p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                                 for p in held_paths},
                unigram_bits_per_byte=to_bpb(uni), bigram_bits_per_byte=to_bpb(big))
    print(f"data: {base['train_files']} training files, {len(train)} tokens; held out {len(held)} tokens "
          f"({held_bytes} bytes); unigram {base['unigram_bits_per_byte']:.3f} bits/byte, "
          f"bigram {base['bigram_bits_per_byte']:.3f} bits/byte", flush=True)
    trained = {}
    for kind in ([args.only] if args.only else ["target", "draft"]):
        model, n_params, steps, cpu = train_model(kind, tokenizer, train, args.steps, args.log_every)
        model = model.to(torch.bfloat16).float()  # measure what is shipped
        bpb = to_bpb(held_out_nats(model, held))
        quick_stream = held[:QUICK_WINDOWS * CONTEXT + 1]
        quick_bytes = len(tokenizer.decode(quick_stream[1:].tolist()).encode("utf-8"))
        quick = held_out_nats(model, held, QUICK_WINDOWS) / math.log(2) / quick_bytes
        print(f"[{kind}] held-out {bpb:.4f} bits/byte (unigram {base['unigram_bits_per_byte']:.3f}, "
              f"bigram {base['bigram_bits_per_byte']:.3f}); {cpu / 60:.1f} CPU min", flush=True)
        card = dict(base, parameters_m=n_params / 1e6, steps=steps, batch=RECIPES[kind]["batch"],
                    context=CONTEXT, tokens_seen=steps * RECIPES[kind]["batch"] * CONTEXT,
                    cpu_minutes=cpu / 60, held_out_bits_per_byte=bpb,
                    quick_windows=QUICK_WINDOWS, quick_bits_per_byte=quick, quick_bytes=quick_bytes,
                    quick_token_ids=quick_stream.tolist())
        trained[kind] = (model, card)
    if len(trained) == 2:
        agree = draft_agreement(trained["target"][0], trained["draft"][0], tokenizer, held_texts)
        print(f"draft/target greedy agreement on held-out prompts: {agree:.3f}", flush=True)
        for _, card in trained.values():
            card["draft_agreement"] = agree
    for kind, (model, card) in trained.items():
        print(f"saved {save(kind, model, tokenizer, args.out, card)}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
