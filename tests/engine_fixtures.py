"""Shared pieces of the engine tests: tiny checkpoints, their transformers oracle, budgets."""
from __future__ import annotations

import random

import torch

from hybridkv import LLM, SamplingParams
from hybridkv.plan import kv_bytes_per_block, state_bytes_per_slot


def ragged_prompts(n: int, vocab: int, seed: int = 0, block: int = 16) -> list[list[int]]:
    """n prompts of ragged lengths (1, block-1, block, block+1, 3 blocks + 5, and random ones)."""
    rng = random.Random(seed)
    lengths = [1, block - 1, block, block + 1, 3 * block + 5]
    lengths += [rng.randint(2, 70) for _ in range(n - len(lengths))]
    return [[rng.randrange(4, vocab) for _ in range(L)] for L in lengths[:n]]


def tight_budget(llm_specs: dict, block_size: int, blocks: int, slots: int) -> int:
    """Bytes for exactly `blocks` KV blocks and `slots` state slots (null slot included)."""
    return kv_bytes_per_block(llm_specs, block_size) * blocks + state_bytes_per_slot(llm_specs) * slots


def greedy(max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def assert_no_leaks(llm: LLM) -> None:
    s = llm.stats()
    assert s["kv_blocks_used"] == 0, s
    assert s["state_slots_live"] == 0, s
    assert s["running"] == s["waiting"] == s["swapped"] == 0, s


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
