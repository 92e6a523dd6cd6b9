"""Pinned turns (SamplingParams.cache_pin_ttl_s, the server's `cache_pin: {"ttl_s": ...}`): a
pinned turn's KV blocks and states stay findable after it ends while other requests churn the
pools, so its next turn hits where an unpinned one finds nothing; when running requests need the
memory, pins give way (counted) and nothing is refused. Tokens always equal caching off."""
import random

import pytest

from engine_fixtures import assert_no_leaks, tight_budget
from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.plan import kv_bytes_per_block, state_bytes_per_slot


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    path = str(make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba")))
    specs = LLM(path, memory_budget_bytes=16 << 20).model.cache_specs()
    # 24 KV blocks, null + 2 live + 2 checkpoint slots: six other 52-token requests evict everything
    kw = dict(max_num_seqs=2, checkpoint_share=0.1, memory_budget_bytes=tight_budget(specs, 16, blocks=24, slots=5))
    return path, kw, specs


def params(pin=None):
    return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, cache_pin_ttl_s=pin)


def test_a_pinned_turn_is_found_after_others_churned_the_pools(bamba):
    path, kw, _ = bamba
    rng = random.Random(0)
    first = [rng.randrange(4, 128) for _ in range(40)]
    others = [[rng.randrange(4, 128) for _ in range(40)] for _ in range(6)]
    cold = LLM(path, enable_prefix_caching=False, **kw)
    answer = cold.generate([first], params(), use_tqdm=False)[0].outputs[0].token_ids
    follow = first + list(answer) + [rng.randrange(4, 128) for _ in range(10)]
    want = cold.generate([follow], params(), use_tqdm=False)[0].outputs[0].token_ids
    cached = {}
    for pin in (None, 600.0):
        llm = LLM(path, **kw)
        assert llm.generate([first], params(pin), use_tqdm=False)[0].outputs[0].token_ids == answer
        llm.generate(others, params(), use_tqdm=False)
        out = llm.generate([follow], params(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want
        cached[pin] = out.num_cached_tokens
        pins = llm.stats()["cache_pins"]
        assert_no_leaks(llm)
    # the rolling output state at 48 (prompt 40 + 11 computed output tokens) and its 3 blocks
    assert cached == {None: 0, 600.0: 48}, cached
    assert pins["turns"] == 1 and pins["states"] >= 1 and pins["blocks"] >= 3, pins


def test_pins_give_way_when_running_requests_need_the_memory(bamba):
    path, kw, _ = bamba
    rng = random.Random(1)
    prompts = [[rng.randrange(4, 128) for _ in range(40)] for _ in range(8)]
    kw = dict(kw, memory_budget_bytes=kw["memory_budget_bytes"] * 2 // 3)  # fewer blocks than 8 turns pin
    llm = LLM(path, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params(600.0), use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in LLM(path, enable_prefix_caching=False, **kw).generate(
        prompts, params(), use_tqdm=False)]
    assert got == want  # every request ran: a pin never refuses one
    pins = llm.stats()["cache_pins"]
    assert pins["turns"] == 8 and pins["reclaimed_blocks"] > 0, pins  # (states: tests/memory/test_recurrent.py)
    assert_no_leaks(llm)


def test_a_pinned_state_pushed_off_the_device_is_hit_from_the_host(bamba):
    """The pinned turn keeps states at its prompt end (32) and its answer (48); two other requests
    running together need two of the three slots, so a pinned state leaves the device for a live
    slot: it is demoted to the host tier WITH its pin, and a next turn that resumes there hits it
    on the host before the TTL, tokens equal caching off."""
    path, kw, specs = bamba
    kw = dict(kw, memory_budget_bytes=tight_budget(specs, 16, blocks=24, slots=3),
              host_cache_bytes=2 * state_bytes_per_slot(specs) + 4 * kv_bytes_per_block(specs, 16))
    rng = random.Random(2)
    first = [rng.randrange(4, 128) for _ in range(40)]
    others = [[rng.randrange(4, 128) for _ in range(40)] for _ in range(4)]
    cold = LLM(path, enable_prefix_caching=False, **kw)
    answer = cold.generate([first], params(), use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(path, **kw)
    assert llm.generate([first], params(600.0), use_tqdm=False)[0].outputs[0].token_ids == answer
    assert llm.generate(others, params(), use_tqdm=False)  # two at a time
    pins, host = llm.stats()["cache_pins"], llm.stats()["checkpoint_tiers"]["host"]
    assert host["pinned_demotions"] >= 1 and pins["states_on_host"] >= 1 and pins["reclaimed_states"] == 0, (pins, host)
    rec = llm.manager.recurrent  # the next turn resumes at the deepest pinned state the host holds
    at = max(e.position for h, e in rec.host.entries.items() if h in rec.pins.until)
    follow = (first + list(answer))[:at] + [rng.randrange(4, 128) for _ in range(10)]
    want = cold.generate([follow], params(), use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate([follow], params(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == at and at in (32, 48)
    assert llm.stats()["checkpoint_tiers"]["host"]["hits"] == 1
    assert_no_leaks(llm)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-5.0, ValueError), (float("inf"), ValueError),
                                        (True, TypeError), ("60", TypeError)])
def test_a_bad_ttl_is_refused(bad, error):
    with pytest.raises(error, match="cache_pin_ttl_s"):
        SamplingParams(cache_pin_ttl_s=bad)
