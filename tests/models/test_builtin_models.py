"""The shipped built-in models (hybridkv/builtin_models, made by examples/train_tiny.py): they load by
name, hold only the checkpoint files, and the target's weights are the ones its training.json
describes (its held-out bits per byte, re-measured). Token identity with transformers through the
engine: their rows in the family table (tests/family_checks.py)."""
import hashlib
import importlib.util
import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

import hybridkv
from hybridkv.models.loader import builtin_models, resolve_checkpoint

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("hybridkv/tiny-code", "hybridkv/tiny-code-draft")
FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "README.md", "training.json"}


def train_tiny():
    """examples/train_tiny.py as a module (its functions measure what the model card states)."""
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "examples" / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_builtin_names_resolve_to_the_shipped_folders_holding_only_the_checkpoint():
    assert tuple(builtin_models()) == NAMES
    for name in NAMES:
        folder = resolve_checkpoint(name)
        assert folder == Path(hybridkv.__file__).resolve().parent / "builtin_models" / name.split("/")[1]
        assert {p.name for p in folder.iterdir()} == FILES  # no optimizer state, no logs
    same = [(resolve_checkpoint(n) / "tokenizer.json").read_bytes() for n in NAMES]
    assert same[0] == same[1]  # the draft speaks the target's tokens


def test_an_unknown_builtin_name_lists_the_builtin_ones():
    with pytest.raises(FileNotFoundError, match=r"'hybridkv/tiny-cod' is not a built-in model; the built-in "
                                                r"names are hybridkv/tiny-code, hybridkv/tiny-code-draft"):
        resolve_checkpoint("hybridkv/tiny-cod")


def test_llm_loads_the_builtin_target_by_name_and_completes_code():
    from hybridkv import LLM, SamplingParams

    llm = LLM("hybridkv/tiny-code", device="cpu", memory_budget_bytes=16 << 20)
    assert llm.model.vocab_size == 4096 and llm.model.tokenizer is not None
    out = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=24, temperature=0),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 24 or out.finish_reason == "stop"
    assert out.text and all(c.isprintable() or c in "\n\t" for c in out.text), out.text


@pytest.mark.slow  # ~2.5 s (transformers scores the held-out windows): a check of the shipped files, not of an edit
def test_the_shipped_target_measures_the_held_out_bits_per_byte_of_its_model_card():
    """The first `quick_windows` windows of the held-out stream, encoded by the shipped tokenizer and
    scored by transformers' model of the shipped bf16 weights, exactly as train_tiny.py measured
    `quick_bits_per_byte`: within 0.5%. The held-out files are the running interpreter's stdlib,
    and where they are the bytes training.json hashed, the shipped tokenizer must encode them to the
    stored tokens; on another Python the stored tokens are scored alone."""
    from transformers import AutoTokenizer, BambaForCausalLM

    tt = train_tiny()
    folder = resolve_checkpoint("hybridkv/tiny-code")
    card = json.loads((folder / "training.json").read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    held = [root / name for name in tt.HELD_OUT]
    assert list(card["held_out_sha256"]) == list(tt.HELD_OUT)
    differ = [name for name, p in zip(tt.HELD_OUT, held)
              if not p.is_file() or hashlib.sha256(p.read_bytes()).hexdigest() != card["held_out_sha256"][name]]
    windows = card["quick_windows"]
    ids = card["quick_token_ids"]
    if not differ:  # this interpreter's held-out files are the ones trained on: re-encode them too
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        stream = tt.encode_stream(tokenizer, [tt.read(p) for p in held])
        assert len(stream) == card["held_tokens"]
        assert stream[:windows * tt.CONTEXT + 1].tolist() == ids, "the shipped tokenizer encodes differently"
        assert len(tokenizer.decode(ids[1:]).encode("utf-8")) == card["quick_bytes"]
    # else another Python's stdlib: the weights are still measured on the stored held-out tokens
    stream = np.asarray(ids, dtype=np.uint16)
    torch.manual_seed(0)
    model = BambaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    bits = tt.held_out_nats(model, stream, windows) / math.log(2) / card["quick_bytes"]
    assert bits == pytest.approx(card["quick_bits_per_byte"], rel=5e-3), (bits, card["quick_bits_per_byte"])
    assert card["quick_bits_per_byte"] < card["bigram_bits_per_byte"]
