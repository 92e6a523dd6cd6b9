"""A model with full AND sliding-window attention layers (tiny GPT-OSS: two KV groups, each with its
own pool and tables) through the whole engine, against transformers: preemption (recompute and
swap) under a tight budget, a prefix hit every group accepts, migration to another block size."""
import pytest

from hybridkv import LLM
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.scheduler.snapshot_io import snapshot_from_bytes, snapshot_to_bytes

from engine_fixtures import assert_no_leaks, greedy, hf_model, ragged_prompts, tight_budget
from model_harness import assert_greedy_matches_hf

WINDOW, BS = 24, 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), seed=5)
    return str(path), hf_model(path)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_goes_through_both_groups(ckpt, mode):
    path, hf = ckpt
    specs = LLM(path, memory_budget_bytes=1 << 20).model.cache_specs()
    llm = LLM(path, memory_budget_bytes=tight_budget(specs, BS, blocks=9, slots=0), max_num_seqs=4,
              max_num_batched_tokens=24, preemption_mode=mode)
    assert len(llm.manager.attention_groups) == 2
    ps = ragged_prompts(4, 128, seed=2)[1:] + [list(range(4, 60))]
    outs = llm.generate(ps, greedy(30), use_tqdm=False)
    for p, o in zip(ps, outs):
        assert_greedy_matches_hf(hf, p, o.outputs[0].token_ids)
    assert llm.stats()["preemptions"][mode] > 0
    assert_no_leaks(llm)


def test_prefix_hit_every_group_accepts(ckpt):
    path, hf = ckpt
    llm = LLM(path, memory_budget_bytes=4 << 20)
    base = list(range(5, 75))  # 70 tokens: full layers need blocks 0-3, sliding ones blocks 2-3
    first = llm.generate([base], greedy(4), use_tqdm=False)[0]
    again = llm.generate([base + [9, 9]], greedy(8), use_tqdm=False)[0]
    assert again.num_cached_tokens == 64
    assert_greedy_matches_hf(hf, base, first.outputs[0].token_ids)
    assert_greedy_matches_hf(hf, base + [9, 9], again.outputs[0].token_ids)
    assert_no_leaks(llm)


def test_migration_mid_decode_to_another_block_size(ckpt):
    path, hf = ckpt
    src = LLM(path, memory_budget_bytes=4 << 20, max_num_batched_tokens=32)
    dst = LLM(path, memory_budget_bytes=4 << 20, block_size=8)
    p = list(range(10, 70))
    rid = src.add_request(p, greedy(40))
    for _ in range(12):  # prefill in two chunks, then decodes past the window
        src.step()
    snap = snapshot_from_bytes(snapshot_to_bytes(src.export_request(rid)))
    # the sliding layers export only their window, the full layers every token
    assert snap.num_computed_tokens > len(p) and set(snap.kv_start) == {0, 2} and min(snap.kv_start.values()) > 0
    dst.import_request(snap)
    out = None
    while dst.has_unfinished_requests():
        out = next((o for o in dst.step() if o.finished), out)
    assert_greedy_matches_hf(hf, p, out.outputs[0].token_ids)
    assert_no_leaks(src)
    assert_no_leaks(dst)
