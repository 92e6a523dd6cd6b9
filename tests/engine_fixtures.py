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


def three_block_prompts(n: int = 3, length: int = 52, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` tokens: 3 full blocks of 16 before the last one."""
    rng = random.Random(seed)
    return [[rng.randrange(4, 128) for _ in range(length)] for _ in range(n)]


def tokens_and_cached(llm: LLM, prompts: list[list[int]], max_tokens: int = 6) -> tuple[list, list]:
    """Greedy outputs of `prompts` and each one's cached prompt tokens."""
    outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


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


def steer_mtp_drafts(llm, truth: dict, p_right: float, seed: int = 0) -> dict:
    """Record every proposal the runner hands the drafter ({(request id, index of its first token):
    its tokens}, returned), and hand the drafter the true token instead of each of its tokens
    (truth: {prompt tuple: the plain engine's tokens}) with probability p_right, so that
    verification runs are accepted too (random MTP weights propose the right token about once in 100)."""
    seen, rng, drafter = {}, random.Random(seed), llm.engine.scheduler.speculation.drafter
    record = drafter.record

    def record_steered(drafts):
        out = {}
        for rid, (i, toks) in drafts.items():
            r = llm.manager.requests.get(rid)
            full = truth.get(tuple(r.token_ids[:r.num_prompt_tokens])) if r is not None else None
            seen[(rid, i)] = list(toks)
            steered = []
            for j, tok in enumerate(toks):  # each chained token steered on its own
                if full is not None and i + j < len(full) and rng.random() < p_right:
                    tok = full[i + j]
                steered.append(tok)
            out[rid] = (i, steered)
        record(out)

    drafter.record = record_steered
    return seen


def plain_truth(path, prompts, params, **kw) -> tuple[list, dict]:
    """The engine without speculation: (its outputs, {prompt: prompt + output tokens})."""
    kw.setdefault("memory_budget_bytes", 32 << 20)
    outs = LLM(str(path), **kw).generate(prompts, params, use_tqdm=False)
    return outs, {tuple(p): list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)}
