"""The engine against transformers: 20 ragged requests at once, with prefix caching on and off,
and under a budget tight enough to preempt, in each preemption mode."""
import pytest

from hybridkv import LLM
from hybridkv.models.tiny import make_tiny_checkpoint

from engine_fixtures import assert_no_leaks, greedy, hf_model, ragged_prompts, tight_budget
from model_harness import assert_greedy_matches_hf


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    path = make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"))
    return path, hf_model(path)


@pytest.fixture(scope="module")
def reference(bamba):
    """Roomy run with prefix caching on; checked token for token against transformers."""
    path, hf = bamba
    prompts = ragged_prompts(20, 128)
    llm = LLM(str(path), memory_budget_bytes=64 << 20, max_num_batched_tokens=64)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    for p, t in zip(prompts, tokens):
        assert len(t) == 20
        assert_greedy_matches_hf(hf, p, t)
    assert_no_leaks(llm)
    return prompts, tokens


def test_roomy_run_matches_transformers(reference):
    prompts, tokens = reference
    assert len(tokens) == 20


def test_prefix_caching_off_gives_same_tokens(bamba, reference):
    prompts, tokens = reference
    llm = LLM(str(bamba[0]), memory_budget_bytes=64 << 20, enable_prefix_caching=False,
              max_num_batched_tokens=48)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tokens
    assert llm.stats()["prefix_misses"]["caching_off"] == 20
    assert_no_leaks(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_tight_budget_preempts_and_matches(bamba, reference, mode):
    prompts, tokens = reference
    probe = LLM(str(bamba[0]), memory_budget_bytes=8 << 20)
    budget = tight_budget(probe.model.cache_specs(), 16, blocks=14, slots=1 + 6 + 2)
    llm = LLM(str(bamba[0]), memory_budget_bytes=budget, max_num_seqs=6, preemption_mode=mode,
              max_num_batched_tokens=64, checkpoint_share=0.0)
    if mode == "auto":  # make both choices happen: a swap is cheap for short, dear for long victims
        llm.engine.scheduler.policy.profile = type(llm.profile)(
            prefill_seconds_per_token=1e-3, peak_activation_bytes=0,
            host_bytes_per_second=llm.engine.scheduler.policy.block_bytes * 2 / 1e-3 / 3)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tokens
    pre = llm.stats()["preemptions"]
    assert sum(pre.values()) > 0, pre
    if mode != "auto":
        assert pre[mode] > 0 and pre[{"recompute": "swap", "swap": "recompute"}[mode]] == 0, pre
    else:
        assert pre["recompute"] > 0 and pre["swap"] > 0, pre
    assert_no_leaks(llm)


def test_swap_under_a_host_budget_turns_recompute_when_it_does_not_fit(bamba, reference):
    """Swap preemption uses the host tier's budget (memory/host_tier.py): with room for about one
    short victim, some swaps are refused and preempt by recompute instead; tokens are the roomy
    run's, and every swapped byte is let go by the end."""
    prompts, tokens = reference
    specs = LLM(str(bamba[0]), memory_budget_bytes=8 << 20).model.cache_specs()
    budget = tight_budget(specs, 16, blocks=14, slots=1 + 6 + 2)
    host = tight_budget(specs, 16, blocks=3, slots=1)
    llm = LLM(str(bamba[0]), memory_budget_bytes=budget, max_num_seqs=6, preemption_mode="swap",
              max_num_batched_tokens=64, checkpoint_share=0.0, host_cache_bytes=host)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tokens
    s = llm.stats()
    tier = s["checkpoint_tiers"]["host"]
    assert s["preemptions"]["swap"] > 0 and s["preemptions"]["recompute"] == tier["swaps_refused"] > 0, (s["preemptions"], tier)
    assert tier["swap_bytes"] == 0 and tier["bytes"] + tier["swap_bytes"] <= tier["budget_bytes"]
    assert_no_leaks(llm)
