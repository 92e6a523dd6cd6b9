"""Through the engine: promotions from the host tiers written layer by layer (hybridkv/layer_loads.py)
give the tokens of the immediate copy (HYBRIDKV_IMMEDIATE_LOADS=1) and, unquantized, of caching off;
on the CPU a reader that missed a layer's wait would read the slot's or block's stale bytes."""
import random

import pytest

from engine_fixtures import assert_no_leaks, tight_budget
from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.plan import state_bytes_per_slot


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    return make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"))


VARIANTS = {
    "plain": ({}, 1),
    "int8": (dict(kv_cache_dtype="int8", state_cache_dtype="int8"), 1),
    "n2": ({}, 2),  # forks copy the promoted slot
    "ngram": (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), 1),
}


def two_passes(llm, n: int) -> list:
    """Six 48-token prefixes with a suffix each, then again with another (the second pass hits the
    host tiers: 2 checkpoint slots, 64 KV blocks on the device); every sequence's tokens."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(4, 128) for _ in range(48)] for _ in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=n)
    outs = []
    for _ in range(2):
        prompts = [p + [rng.randrange(4, 128) for _ in range(8)] for p in prefixes]
        outs += [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    return outs


def engine(bamba, extra: dict, **kw) -> LLM:
    dtypes = {k: v for k, v in extra.items() if k.endswith("cache_dtype")}
    specs = LLM(str(bamba), memory_budget_bytes=16 << 20, **dtypes).manager.specs  # (as the cache keeps them)
    return LLM(str(bamba), max_num_seqs=2, checkpoint_share=0.1,
               memory_budget_bytes=tight_budget(specs, 16, blocks=64, slots=1 + 2 + 2), **extra, **kw)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layer_wise_promotions_give_the_immediate_copys_tokens(bamba, variant, monkeypatch):
    extra, n = VARIANTS[variant]
    specs = LLM(str(bamba), memory_budget_bytes=16 << 20).model.cache_specs()
    host_bytes = 8 * 2 * state_bytes_per_slot(specs) + (64 << 10)  # states and some KV blocks
    got = []
    for immediate in ("1", ""):
        monkeypatch.setenv("HYBRIDKV_IMMEDIATE_LOADS", immediate)
        llm = engine(bamba, extra, host_cache_bytes=host_bytes)
        assert llm.manager.loads.immediate == (immediate == "1")
        got.append(two_passes(llm, n))
        host = llm.stats()["tiers"]["host"] if "tiers" in llm.stats() else llm.manager.recurrent.host.stats()
        assert host["promotions"] > 0, host  # the second pass hit the host tier
        assert not llm.manager.loads.pending  # nothing stays pending across steps
        assert_no_leaks(llm)
    assert got[1] == got[0]
    if not extra.get("kv_cache_dtype"):  # (quantized tokens depend on the hits: not caching off's)
        monkeypatch.setenv("HYBRIDKV_IMMEDIATE_LOADS", "")
        assert got[1] == two_passes(engine(bamba, extra, enable_prefix_caching=False), n)


def test_a_promoted_request_swapped_out_in_its_first_step_keeps_its_state(bamba):
    """Swap-out right after the admission that promoted (before any forward): to_host settles the
    pending loads, so the swapped copy is the promoted state, not the slot's stale bytes."""
    specs = LLM(str(bamba), memory_budget_bytes=16 << 20).model.cache_specs()
    llm = engine(bamba, {}, host_cache_bytes=8 * 2 * state_bytes_per_slot(specs))
    want = two_passes(engine(bamba, {}, enable_prefix_caching=False), 1)
    two_passes(llm, 1)  # the host tier holds the prefixes' states now
    rec = llm.manager.recurrent
    swapped = []
    admit = rec.admit

    def admit_then_swap_round_trip(rid, hashes, hit):
        admit(rid, hashes, hit)
        if rec.states.loads.pending:  # a host-tier hit: its writes wait for the layers
            copy = rec.swap_out(rid, 0)
            rec.swap_in(rid, copy, hashes, 0)
            swapped.append(rid)
    rec.admit = admit_then_swap_round_trip
    assert two_passes(llm, 1) == want
    assert swapped
