"""Mistral with a sliding window through the whole engine, against transformers: prompts shorter
and longer than the window, chunked prefill, preemption (recompute and swap), prefix hits,
migration, and at most ceil(window / block_size) + 1 blocks held by a long generation."""
import pytest

from hybridkv import LLM
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.scheduler.snapshot_io import snapshot_from_bytes, snapshot_to_bytes

from engine_fixtures import assert_no_leaks, greedy, hf_model, ragged_prompts, tight_budget
from model_harness import assert_greedy_matches_hf

WINDOW, BS = 24, 16  # the tiny Mistral's window spans one and a half blocks


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint("mistral", tmp_path_factory.mktemp("mistral"), seed=3)
    return str(path), hf_model(path)


def prompts(vocab, seed=0):
    ps = ragged_prompts(5, vocab, seed=seed)  # 1, 15, 16, 17, 53 tokens
    return ps + [p * 3 for p in ragged_prompts(2, vocab, seed=seed + 1)[1:]] + [list(range(4, 84))]


def held_blocks(llm):
    mem = llm.manager.attention
    return {rid: len(mem.held_blocks(rid)) for rid in llm.manager.requests}


def test_window_is_sliding_window_memory(ckpt):
    llm = LLM(ckpt[0], memory_budget_bytes=4 << 20)
    assert llm.manager.attention.name == f"sliding_window_{WINDOW}"


def test_chunked_prefill_and_long_generation_hold_only_the_window(ckpt):
    path, hf = ckpt
    llm = LLM(path, memory_budget_bytes=4 << 20, max_num_batched_tokens=20)
    ps = prompts(128)
    assert max(len(p) for p in ps) > 3 * WINDOW and min(len(p) for p in ps) < WINDOW
    ids = [llm.add_request(p, greedy(60)) for p in ps]
    done, peak = {}, 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        for rid, n in held_blocks(llm).items():
            r = llm.manager.request(rid)
            if r.num_computed_tokens > r.num_prompt_tokens:  # decoding: only the window is held
                peak = max(peak, n)
                assert n <= -(-WINDOW // BS) + 1, (rid, n, r.num_computed_tokens)
    assert peak == -(-WINDOW // BS) + 1
    for p, rid in zip(ps, ids):
        assert_greedy_matches_hf(hf, p, done[rid])
    assert_no_leaks(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(ckpt, mode):
    path, hf = ckpt
    specs = LLM(path, memory_budget_bytes=4 << 20).model.cache_specs()
    llm = LLM(path, memory_budget_bytes=tight_budget(specs, BS, blocks=9, slots=0), max_num_seqs=4,
              max_num_batched_tokens=24, preemption_mode=mode)
    ps = prompts(128, seed=2)
    outs = llm.generate(ps, greedy(30), use_tqdm=False)
    for p, o in zip(ps, outs):
        assert_greedy_matches_hf(hf, p, o.outputs[0].token_ids)
    assert llm.stats()["preemptions"][mode] > 0
    assert_no_leaks(llm)


def test_prefix_hit_past_the_window(ckpt):
    path, hf = ckpt
    llm = LLM(path, memory_budget_bytes=4 << 20)
    base = list(range(5, 75))  # 70 tokens: the hit at 64 needs only blocks 2 and 3
    first = llm.generate([base], greedy(4), use_tqdm=False)[0]
    again = llm.generate([base + [9, 9]], greedy(8), use_tqdm=False)[0]
    assert again.num_cached_tokens == 64
    assert_greedy_matches_hf(hf, base, first.outputs[0].token_ids)
    assert_greedy_matches_hf(hf, base + [9, 9], again.outputs[0].token_ids)


def test_migration_mid_decode_to_another_block_size(ckpt):
    path, hf = ckpt
    src = LLM(path, memory_budget_bytes=4 << 20, max_num_batched_tokens=32)
    dst = LLM(path, memory_budget_bytes=4 << 20, block_size=8)
    p = list(range(10, 70))
    rid = src.add_request(p, greedy(40))
    for _ in range(12):  # prefill in two chunks, then decodes past the window
        src.step()
    snap = snapshot_from_bytes(snapshot_to_bytes(src.export_request(rid)))
    assert snap.num_computed_tokens > len(p) and min(snap.kv_start.values()) > 0  # only the window moves
    dst.import_request(snap)
    out = None
    while dst.has_unfinished_requests():
        out = next((o for o in dst.step() if o.finished), out)
    assert_greedy_matches_hf(hf, p, out.outputs[0].token_ids)
    assert_no_leaks(src)
    assert_no_leaks(dst)
