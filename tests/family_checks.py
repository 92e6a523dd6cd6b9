"""The checks every model family passes against transformers' model of the same tiny checkpoint.

Each family test file keeps its own test functions (so every test id stays) and calls these with
its models and the few numbers where the family differs (chunk sizes, tolerances, prompt lengths).
Not collected by pytest: the module name does not start with `test_`.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine_fixtures import assert_no_leaks
from hybridkv import LLM, SamplingParams
from hybridkv.models import load_model
from model_harness import Harness, assert_close_rel, assert_greedy_matches_hf, hf_logits

BS = 16
RAGGED_LENGTHS = (1, BS - 1, BS, BS + 1, 3 * BS + 5)  # one token, around a block edge, several blocks


def prompt(n: int, seed: int) -> list[int]:
    """n token ids in [4, 128) drawn from `seed` (ids 0-3 are left to special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 128, (n,), generator=g).tolist()


def load_pair(path):
    """(our model, transformers' float32 model in eval mode), both from checkpoint dir `path`."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load_model(path), hf


def check_prompt_logits(ours, hf, n: int = 3 * BS + 5, seed: int = 0) -> torch.Tensor:
    """One n-token prompt in one pass: logits [n, vocab] within 1e-4 x max|ref| of transformers'.
    Returns our logits for family-specific checks."""
    h = Harness(ours, block_size=BS)
    tokens = prompt(n, seed)
    logits = h.step([(h.add(tokens), len(tokens))], return_all_logits=True)
    assert_close_rel(logits, hf_logits(hf, tokens))
    return logits


def check_ragged_batch_greedy(ours, hf, lengths=RAGGED_LENGTHS, steps: int = 20):
    """Prompts of `lengths` prefilled in ONE ragged batch, then `steps` greedy decodes together:
    every token is transformers' greedy choice, with no ties allowed."""
    h = Harness(ours, block_size=BS)
    prompts = [prompt(n, 10 + n) for n in lengths]
    seqs = [h.add(p) for p in prompts]
    h.prefill(seqs)
    generated = h.decode(seqs, steps)
    for p, g in zip(prompts, generated):
        assert assert_greedy_matches_hf(hf, p, g) == 0


def check_uneven_chunks_equal_one_pass(ours, chunks=(5, 16, 7, 1, 16), tol: float = 1e-4):
    """A prompt of sum(chunks) tokens prefilled in those uneven chunks (a one-token chunk takes the
    decode path), while another request rides along (first prefilling, then decoding), gives
    the logits of one pass over the whole prompt within rtol = atol = `tol`."""
    tokens = prompt(sum(chunks), 3)
    one = Harness(ours, block_size=BS, seed=1)
    ref = one.step([(one.add(tokens), len(tokens))], return_all_logits=True)
    h = Harness(ours, block_size=BS, seed=2)
    seq, other = h.add(tokens), h.add(prompt(9, 4))
    got = []
    for n in chunks:
        # each chunk resumes from the slot's state and the KV blocks written so far
        work = [(seq, n)] + ([(other, len(other.tokens) - other.num_computed)]
                             if other.num_computed < len(other.tokens) else [])
        got.append(h.step(work, return_all_logits=True)[:n])
        if other.num_computed == len(other.tokens):
            other.tokens.append(7)
    assert sum(t.shape[0] for t in got) == len(tokens) == seq.num_computed
    torch.testing.assert_close(torch.cat(got), ref, rtol=tol, atol=tol)


def check_state_checkpoint_at_block_boundary(ours, hf):
    """A state checkpoint taken at a block boundary, copied into a fresh slot after the original
    went on, continues exactly like the uninterrupted run, which is transformers' greedy output."""
    h = Harness(ours, block_size=BS)
    tokens = prompt(2 * BS + 6, 5)
    full = h.add(tokens)
    h.prefill([full])
    full_prompt_logits = full.last_logits.clone()
    want = h.decode([full], 12)[0]
    assert assert_greedy_matches_hf(hf, tokens, want) == 0

    base = h.add(tokens)
    h.step([(base, 2 * BS)])  # stop exactly at a block boundary
    ckpt = h.checkpoint(base)  # state copied into a fresh slot, full blocks shared
    h.prefill([base])  # the original goes on; the checkpoint copy must not change
    h.decode([base], 3)
    fork = h.checkpoint(ckpt)  # copy-on-hit: continue from a copy of the checkpoint
    fork.tokens += tokens[2 * BS:]
    h.prefill([fork])
    # logits too, not only greedy tokens: a wrong state can leave short greedy runs unchanged
    torch.testing.assert_close(fork.last_logits, full_prompt_logits, rtol=1e-4, atol=1e-4)
    assert h.decode([fork], 12)[0] == want


def check_engine_generate(path, hf, lengths=(1, BS - 1, BS + 1, 3 * BS + 5), seed: int = 40,
                          max_tokens: int = 12):
    """`LLM(path).generate` of prompts of `lengths` (seeds `seed + n`): `max_tokens` greedy tokens
    each, all transformers' greedy choices; afterwards no KV block, slot or request is left."""
    prompts = [prompt(n, seed + n) for n in lengths]
    llm = LLM(str(path), memory_budget_bytes=16 << 20)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert len(o.outputs[0].token_ids) == max_tokens
        assert assert_greedy_matches_hf(hf, p, list(o.outputs[0].token_ids)) == 0
    assert_no_leaks(llm)


def check_transformers_names_load_the_same(ours, hf, path: Path, tmp_path: Path, published: str,
                                           stacked_suffix: str):
    """The checkpoint at `path` holds the published tensor name `published`; a copy re-saved with
    transformers' in-memory state dict (which has a key ending in `stacked_suffix`, e.g. stacked
    experts) loads into a model whose logits equal `ours` bit for bit."""
    assert published in load_file(str(path / "model.safetensors"))
    shutil.copytree(path, tmp_path / "ckpt")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith(stacked_suffix) for k in state)
    save_file(state, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    again = load_model(tmp_path / "ckpt")
    tokens = prompt(BS + 3, 9)
    a, b = Harness(ours), Harness(again)
    torch.testing.assert_close(a.step([(a.add(tokens), len(tokens))], return_all_logits=True),
                               b.step([(b.add(tokens), len(tokens))], return_all_logits=True),
                               rtol=0, atol=0)
