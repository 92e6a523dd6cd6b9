"""LFM3 (short conv + sliding-window + full attention) against transformers' model of the same tiny
checkpoint: the planner's specs, three kinds of memory in one model, a long generation whose
sliding layers hold only their window, and a prefix hit that every kind accepts. The shared checks
run from tests/family_checks.py."""
import pytest
import torch

from hybridkv import LLM
from hybridkv.config_specs import load_specs
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import RecurrentSpec

from engine_fixtures import assert_no_leaks, greedy, hf_model
from family_checks import generate_holding_the_window
from model_harness import assert_greedy_matches_hf

WINDOW, BS = 24, 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint("lfm3", tmp_path_factory.mktemp("lfm3"), seed=15)
    return str(path), hf_model(path)


def test_planner_specs_equal_the_model(ckpt):
    path, _ = ckpt
    specs = LLM(path, memory_budget_bytes=1 << 20).model.cache_specs()
    assert load_specs(f"{path}/config.json", torch.float32) == specs
    kinds = ["conv" if isinstance(s, RecurrentSpec) else s.sliding_window for s in specs.values()]
    assert kinds == ["conv", WINDOW, None] * 2


def test_long_generation_and_prefix_hit_through_three_kinds(ckpt):
    path, hf = ckpt
    llm = LLM(path, memory_budget_bytes=4 << 20, max_num_batched_tokens=20)
    base = list(range(4, 4 + 70))
    out = generate_holding_the_window(llm, base, 60)
    assert_greedy_matches_hf(hf, base, out.outputs[0].token_ids)
    again = llm.generate([base + [9, 9]], greedy(8), use_tqdm=False)[0]
    assert again.num_cached_tokens == 64  # KV of both groups and a conv checkpoint at 64
    assert_greedy_matches_hf(hf, base + [9, 9], again.outputs[0].token_ids)
    assert_no_leaks(llm)
