"""RecurrentGemma's own checks: its specs (window on the attention layers, a float32 RG-LRU state),
transformers' details that the oracle comparison would miss if the tiny model hid them, and the
engine's prefix hit, migration mid-decode and the window held while decoding. The shared checks
(the engine under memory pressure among them) are its row in test_families.py."""
import json

import pytest
import torch

from engine_fixtures import assert_no_leaks, greedy
from family_checks import BS, WINDOW, prompt
from hybridkv import LLM
from hybridkv.config_specs import specs_from_config
from hybridkv.models.loader import build_model
from hybridkv.models.registry import family_module
from hybridkv.scheduler.snapshot_io import snapshot_from_bytes, snapshot_to_bytes
from hybridkv.specs import AttentionSpec, RecurrentSpec
from model_harness import Harness, assert_close_rel, assert_greedy_matches_hf, hf_logits

NAME = "recurrent_gemma"


def _run(llm, ids):
    done = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    return [done[i] for i in ids]


def test_specs_window_on_attention_and_float32_lru_state(family_models):
    path, ours, _ = family_models(NAME)
    lru = RecurrentSpec((80, 3), (80,), torch.float32)
    want = {0: lru, 1: lru, 2: AttentionSpec(1, 16, torch.float32, WINDOW), 3: lru}
    assert ours.cache_specs() == want
    cfg = json.loads((path / "config.json").read_text())
    assert specs_from_config(cfg, torch.float32) == want
    bf16 = specs_from_config(cfg, torch.bfloat16)  # the state stays float32, as in transformers
    assert bf16[0] == RecurrentSpec((80, 3), (80,), torch.bfloat16, torch.float32)


def test_max_model_len_without_max_position_embeddings(family_models):
    """Published configs have no max_position_embeddings (nothing bounds the length); the engine
    still gets a positive length, and LLM(max_model_len=...) lowers it."""
    path, ours, _ = family_models(NAME)
    assert "max_position_embeddings" not in json.loads((path / "config.json").read_text())
    assert ours.max_model_len >= 1 << 20
    assert LLM(str(path), memory_budget_bytes=4 << 20, max_model_len=100).model.max_model_len == 100


def test_embedding_scale_soft_cap_and_window_each_change_the_logits(family_models):
    """Each of transformers' details moves the logits beyond the family check's tolerance, so
    that check does see them: the bf16-rounded sqrt(80) (8.9375, not 8.9443), the soft cap, the window."""
    _, ours, hf = family_models(NAME)
    tokens = prompt(3 * WINDOW + 5, 0)
    ref = hf_logits(hf, tokens)
    attn = ours.model.layers[2].self_attn

    def logits():
        h = Harness(ours)
        return h.step([(h.add(tokens), len(tokens))], return_all_logits=True)

    assert_close_rel(logits(), ref)
    for obj, field, wrong in [(ours, "embed_scale", 80 ** 0.5), (ours, "soft_cap", 1e9),
                              (attn, "sliding_window", None)]:
        right = getattr(obj, field)
        setattr(obj, field, wrong)
        try:
            got = logits()
        finally:
            setattr(obj, field, right)
        # the family check allows 1e-4 x max|ref|; the rounding alone moves them 5e-4 x max|ref|
        assert (got - ref).abs().max() > 3e-4 * ref.abs().max(), field


@pytest.mark.parametrize("overrides, message", [
    (dict(block_types=["recurrent", "mlp"]), "block_types\\[1\\] is 'mlp'"),
    (dict(hidden_activation="relu"), "hidden_activation='relu'"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "rope_type='linear'"),
    (dict(lru_width=82), "lru_width=82 is not a multiple of num_attention_heads=5"),
])
def test_configs_this_code_would_run_wrongly_are_refused(overrides, message):
    config = family_module(NAME).tiny_config(**overrides)
    with pytest.raises(ValueError, match=message):
        build_model(config)


def test_prefix_hit_and_long_decode_holds_only_the_window(family_models):
    """A prompt sharing 70 tokens with an earlier one resumes at 64 from the RG-LRU checkpoint and
    the window's KV blocks; while decoding, a request holds at most ceil(24 / 16) + 1 blocks."""
    path, _, hf = family_models(NAME)
    llm = LLM(str(path), memory_budget_bytes=4 << 20, checkpoint_policy="prompt_end",
              max_num_batched_tokens=20)
    shared = prompt(70, 61)
    first, second = shared + prompt(3, 62), shared + prompt(6, 63)
    a = llm.generate([first], greedy(40), use_tqdm=False)[0]
    rid = llm.add_request(second, greedy(40))
    peak, out = 0, None
    while llm.has_unfinished_requests():
        out = next((o for o in llm.step() if o.finished), out)
        for r in llm.manager.requests:
            held = len(llm.manager.attention.held_blocks(r))
            if llm.manager.request(r).num_computed_tokens > len(second):
                peak = max(peak, held)
    assert out.request_id == rid and out.num_cached_tokens == 4 * BS
    assert peak == -(-WINDOW // BS) + 1
    for p, o in ((first, a), (second, out)):
        assert assert_greedy_matches_hf(hf, p, o.outputs[0].token_ids) == 0
    assert_no_leaks(llm)


def test_migration_mid_decode(family_models):
    path, _, hf = family_models(NAME)
    src = LLM(str(path), memory_budget_bytes=4 << 20, max_num_batched_tokens=32)
    dst = LLM(str(path), memory_budget_bytes=4 << 20, block_size=8)  # another block size
    prompts = [prompt(n, 80 + n) for n in (BS + 1, 3 * WINDOW + 5)]
    ids = [src.add_request(p, greedy(20)) for p in prompts]
    for _ in range(8):  # prefill (the long prompt in chunks), then decodes past the window
        src.step()
    snap = snapshot_from_bytes(snapshot_to_bytes(src.export_request(ids[1])))
    assert snap.num_computed_tokens > snap.num_prompt_tokens and min(snap.kv_start.values()) > 0
    dst.import_request(snap)
    got = _run(src, ids[:1]) + _run(dst, ids[1:])
    for p, t in zip(prompts, got):
        assert assert_greedy_matches_hf(hf, p, t) == 0
    assert_no_leaks(src)
    assert_no_leaks(dst)


@pytest.mark.parametrize("changes, message", [
    (dict(logits_soft_cap=0.0), "logits_soft_cap=0.0; it must be a positive number"),
    (dict(attention_window_size=0), "attention_window_size=0; it must be a positive integer"),
    (dict(lru_width=-80), "lru_width=-80; it must be a positive integer"),
    (dict(block_types=["recurrent", "local"]), "block_types\\[1\\] is 'local'"),
])
def test_loading_refuses_a_config_it_would_run_wrongly(changes, message, family_models, tmp_path):
    """At load, before any weight is read: a CheckpointError naming config.json and the option."""
    import shutil

    from hybridkv.models import CheckpointError, load_model

    path, _, _ = family_models(NAME)
    shutil.copytree(path, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"config.json.*{message}"):
        load_model(tmp_path / "ckpt")


@pytest.mark.slow  # interpreted Triton
def test_triton_rg_lru_step_decodes_like_transformers(family_models, monkeypatch):
    """The RG-LRU decode step through its Triton kernel (interpreted on CPU; the other kernels
    stay torch, their Triton paths have their own tests): a ragged prefill then 8 greedy decodes,
    the long request past the window, are transformers' tokens."""
    from hybridkv.kernels import ops

    calls = []
    monkeypatch.setattr(ops.rg_lru_state_update, "backend",
                        lambda t, plan_cache=None: calls.append(t.shape) or "triton")
    _, ours, hf = family_models(NAME)
    h = Harness(ours)
    prompts = [prompt(n, 90 + n) for n in (2, WINDOW + 5)]
    seqs = [h.add(p) for p in prompts]
    h.prefill(seqs)
    for p, g in zip(prompts, h.decode(seqs, 8)):
        assert assert_greedy_matches_hf(hf, p, g) == 0
    assert len(calls) == 7 * 3  # 7 decode steps (the 8th token needs none) x 3 recurrent layers
