"""The prefix-hit guard (scheduler/hit_guard.py, `verify_cache_hits=p`): a host-tier entry made
wrong but consistent (its bytes changed and its CRC-32 taken again, so the tier's check passes) is
caught at p = 1 by the cold recompute, counted, and invalidated, after which outputs are the
one-tier engine's again (the oracle); at p = 0 nothing extra runs; at p = 1 outputs of correct
hits are unchanged and the shadows report nothing."""
import argparse
import random

import pytest

from engine_fixtures import assert_no_leaks, greedy, tight_budget
from hybridkv import LLM
from hybridkv.memory.host_tier import checksum
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.plan import state_bytes_per_slot
from hybridkv.scheduler.config import EngineConfig
from hybridkv.scheduler.hit_guard import HitGuard
from hybridkv.specs import with_cache_dtypes


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    return make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"))


def tiered_kw(bamba, cache: str = "auto") -> dict:
    """2 live and 2 device checkpoint slots, a host tier of 16 states, KV for every prefix; KV and
    state kept in `cache`."""
    specs = with_cache_dtypes(LLM(str(bamba), memory_budget_bytes=16 << 20).model.cache_specs(), cache, cache)
    return dict(max_num_seqs=2, checkpoint_share=0.1, host_cache_bytes=16 * state_bytes_per_slot(specs),
                memory_budget_bytes=tight_budget(specs, 16, blocks=64, slots=1 + 2 + 2),
                kv_cache_dtype=cache, state_cache_dtype=cache)


def passes(prefixes, n: int, seed: int = 1) -> list[list[list[int]]]:
    """n passes of prompts: each prefix with a new 8-token suffix per pass."""
    rng = random.Random(seed)
    return [[p + [rng.randrange(4, 128) for _ in range(8)] for p in prefixes] for _ in range(n)]


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(4), use_tqdm=False)]


@pytest.mark.parametrize("cache", ["auto", "int8"])
def test_a_wrong_but_consistent_host_entry_is_caught_and_invalidated(bamba, cache):
    """Also with int8 KV and state, where hits legitimately differ from the cold run by rounding
    (the guard's tolerance widens; a wrong state still shows)."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(4, 128) for _ in range(48)] for _ in range(6 if cache == "auto" else 8)]
    first, second, third = passes(prefixes, 3)
    kw = tiered_kw(bamba, cache)
    oracle = LLM(str(bamba), **{**kw, "host_cache_bytes": 0})  # one tier: recomputes what it lost
    want = [tokens(oracle, p) for p in (first, second, third)]
    llm = LLM(str(bamba), verify_cache_hits=1.0, **kw)
    assert tokens(llm, first) == want[0]
    host = llm.manager.recurrent.host
    bad = set(host.entries)
    assert len(bad) >= 4
    layouts = {i: spec.ssm_layout for i, spec in llm.manager.recurrent.layers.items()}
    for e in host.entries.values():  # wrong state, consistent entry: the CRC check cannot see it
        for i, t in e.ssm.items():
            if layouts[i] is None:
                t.add_(1.0)
            else:  # the values one higher, kept as the pool keeps them
                t.copy_(layouts[i].encode(layouts[i].decode(t[None]) + 1.0)[0])
        e.crc = checksum(e.conv, e.ssm)
    before = llm.stats()
    tokens(llm, second)  # served from the wrong states: what it returns is not checked here
    s = llm.stats()
    host_hits = s["checkpoint_tiers"]["host"]["hits"] - before["checkpoint_tiers"]["host"]["hits"]
    assert host_hits >= 4 and s["checkpoint_tiers"]["host"]["refused_corrupt"] == 0, s["checkpoint_tiers"]
    # every host hit was on a wrong entry and checked (p = 1): each is a mismatch, and gone
    assert s["cache_hit_mismatches"] - before["cache_hit_mismatches"] == host_hits, s
    assert s["cache_hit_checks"] > before["cache_hit_checks"]
    used = bad - set(host.entries)
    assert len(used) >= host_hits and not (used & set(llm.manager.recurrent.checkpoints))
    # the next pass recomputes those prefixes: the oracle's tokens, no new mismatch
    assert tokens(llm, third) == want[2]
    assert llm.stats()["cache_hit_mismatches"] == s["cache_hit_mismatches"]
    assert_no_leaks(llm)
    assert not llm.engine.groups  # the shadows ended and reported nothing


@pytest.mark.parametrize("cache", ["auto", "int8", "fp8_e4m3"])
def test_correct_hits_pass_and_nothing_runs_at_p_0(bamba, cache):
    """Also under quantized caches, whose hits differ from the cold run by rounding only."""
    rng = random.Random(3)
    prefixes = [[rng.randrange(4, 128) for _ in range(48)] for _ in range(3)]
    prompts = [p for one_pass in passes(prefixes, 2) for p in one_pass]
    runs = {}
    for p in (None, 0.0, 1.0):
        llm = LLM(str(bamba), memory_budget_bytes=16 << 20, kv_cache_dtype=cache, state_cache_dtype=cache,
                  **({} if p is None else {"verify_cache_hits": p}))
        outs = llm.generate(prompts, greedy(4), use_tqdm=False)
        assert len(outs) == len(prompts)  # no shadow output among them
        runs[p] = ([o.outputs[0].token_ids for o in outs], llm.stats(), llm.engine.counters["processed_tokens"])
        assert_no_leaks(llm)
    (base, s_base, n_base), (off, s_off, n_off), (on, s_on, n_on) = runs[None], runs[0.0], runs[1.0]
    assert off == base == on  # outputs unchanged by the guard
    assert n_off == n_base and s_off["cache_hit_checks"] == 0 and s_off["prefix_hit_tokens"] == s_base["prefix_hit_tokens"]
    assert s_on["cache_hit_checks"] >= 3 and s_on["cache_hit_mismatches"] == 0, s_on
    assert n_on > n_off  # the shadows computed their prompts cold
    assert s_on["prefix_hit_tokens"] == s_off["prefix_hit_tokens"]  # a shadow never hits


def test_sampling_is_seeded_and_the_fraction_checked():
    class Seq:
        def __init__(self, i):
            self.request_id, self.token_ids, self.cache_salt = f"r{i}", [1] * 32, None
            self.adapter_id, self.mm_hashes, self.block_hashes = None, (), [b"a", b"b"]

    def sampled(seed):
        g = HitGuard(0.3, seed, lambda key: None)
        return [g.on_hit(Seq(i), 32, 16) is not None for i in range(200)]

    assert sampled(5) == sampled(5) and 30 <= sum(sampled(5)) <= 90
    for p in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="verify_cache_hits"):
            HitGuard(p, 0, lambda key: None)
    with pytest.raises(ValueError, match="verify_cache_hits"):  # refused before any model loads
        EngineConfig(verify_cache_hits=2.0)


def test_the_cli_flag_and_metrics_carry_the_guard(bamba):
    from hybridkv.cli import add_llm_args, llm_kwargs
    from hybridkv.server.metrics import ServerMetrics

    ap = argparse.ArgumentParser()
    add_llm_args(ap)
    assert llm_kwargs(ap.parse_args(["--verify-cache-hits", "0.01"]))["verify_cache_hits"] == 0.01
    llm = LLM(str(bamba), memory_budget_bytes=16 << 20, verify_cache_hits=1.0)
    rng = random.Random(4)
    prefix = [rng.randrange(4, 128) for _ in range(32)]
    tokens(llm, [p for one_pass in passes([prefix], 2) for p in one_pass])
    s = llm.stats()
    assert s["cache_hit_checks"] >= 1
    text = ServerMetrics("m").render(s).decode()
    for name in ("cache_hit_checks", "cache_hit_mismatches"):
        assert f'hybridkv:{name}_total{{model_name="m"}} {float(s[name])}' in text, name
