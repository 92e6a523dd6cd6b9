"""Every family through the whole engine (scheduler, manager, chunked prefill, preemption),
greedy tokens checked against transformers' model of the same checkpoint."""
import pytest

from hybridkv import LLM
from hybridkv.models.tiny import make_tiny_checkpoint

from engine_fixtures import assert_no_leaks, greedy, hf_model, ragged_prompts, tight_budget
from model_harness import assert_greedy_matches_hf


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("family", ["llama"] + [  # long: llama in the fast tier
    pytest.param(f, marks=pytest.mark.slow) for f in ["jamba", "qwen3_next", "falcon_h1", "zamba2", "nemotron_h"]])
def test_family_through_engine_under_pressure(family, mode, tmp_path):
    path = make_tiny_checkpoint(family, tmp_path)
    hf = hf_model(path)
    probe = LLM(str(path), memory_budget_bytes=8 << 20)
    specs = probe.model.cache_specs()
    prompts = ragged_prompts(6, probe.model.vocab_size, seed=5)
    llm = LLM(str(path), memory_budget_bytes=tight_budget(specs, 16, blocks=6, slots=1 + 3),
              max_num_seqs=3, max_num_batched_tokens=24, preemption_mode=mode, checkpoint_share=0.0)
    outs = llm.generate(prompts, greedy(12), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert_greedy_matches_hf(hf, p, o.outputs[0].token_ids)
    assert llm.stats()["preemptions"][mode] > 0
    assert_no_leaks(llm)
