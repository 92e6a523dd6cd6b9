"""The host tier of state checkpoints through the engine (hybridkv/memory/host_tier.py): on a tiny
Bamba with two device checkpoint slots, a second pass over six prefixes hits states demoted to the
host, and every output is token for token the one-tier engine's (the oracle: the same engine
without the tier, which recomputes those prefixes) — also when every host state was corrupted
between the passes (each is refused, its prefix recomputed)."""
import random
from types import SimpleNamespace

import pytest

from engine_fixtures import assert_no_leaks, greedy, tight_budget
from hybridkv import LLM
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.plan import state_bytes_per_slot


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    return make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"))


@pytest.fixture(scope="module")
def tiers(bamba):
    """The engine settings (null + 2 live + 2 checkpoint slots; KV for every prefix), the six
    prefixes, the host tier's bytes, and the one-tier engine's tokens and stats over two passes."""
    specs = LLM(str(bamba), memory_budget_bytes=16 << 20).model.cache_specs()
    kw = dict(max_num_seqs=2, checkpoint_share=0.1,
              memory_budget_bytes=tight_budget(specs, 16, blocks=64, slots=1 + 2 + 2))
    rng = random.Random(0)
    prefixes = [[rng.randrange(4, 128) for _ in range(48)] for _ in range(6)]
    one_tier = LLM(str(bamba), **kw)
    assert one_tier.manager.num_slots == 5
    want = two_passes(one_tier, prefixes)
    return SimpleNamespace(kw=kw, prefixes=prefixes, host_bytes=8 * 2 * state_bytes_per_slot(specs),
                           want=want, base=one_tier.stats())


def two_passes(llm, prefixes, between=lambda: None, rng_seed=1):
    """Each prefix with one suffix, then each again with another: token lists of both passes.
    between(): called after the first pass."""
    rng = random.Random(rng_seed)
    outs = []
    for i in range(2):
        if i:
            between()
        prompts = [p + [rng.randrange(4, 128) for _ in range(8)] for p in prefixes]
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(4), use_tqdm=False)]
    return outs


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "corrupted"])
def test_hits_from_the_host_tier_give_the_one_tier_tokens(bamba, tiers, corrupt):
    """corrupted: one value of every host state is changed between the passes; a corrupted
    entry is never used."""
    llm = LLM(str(bamba), host_cache_bytes=tiers.host_bytes, **tiers.kw)
    host = llm.manager.recurrent.host
    corrupted = []

    def corrupt_every_host_state():
        corrupted.extend(host.entries)
        for entry in host.entries.values():
            t = next(iter(entry.ssm.values())).view(-1)
            t[0] = t[0] + 1.0
    got = two_passes(llm, tiers.prefixes, corrupt_every_host_state if corrupt else lambda: None)
    assert got == tiers.want
    s = llm.stats()
    tier = s["checkpoint_tiers"]["host"]
    if corrupt:
        assert len(corrupted) >= 4
        # a corrupted state was refused when its prefix came back (the tokens above: recomputed),
        # unless evicted unread first (trail states of a prompt, below the state its prefix used);
        # what else the host holds now are fresh states of the recomputed prefixes, passing the check
        assert len(tiers.prefixes) <= tier["refused_corrupt"] <= len(corrupted), tier
        assert all(host.usable(k, e.position) for k, e in list(host.entries.items()) if k not in corrupted)
    else:
        assert tier["demotions"] >= 4 and tier["hits"] >= 4 and tier["refused_corrupt"] == 0, tier
        assert tier["bytes"] <= tiers.host_bytes
        # the host hits are prefixes the one-tier engine computed again
        assert s["prefix_hit_tokens"] >= tiers.base["prefix_hit_tokens"] + 4 * 48
        assert "host" not in tiers.base["checkpoint_tiers"]
    assert_no_leaks(llm)


def test_the_cli_flag_and_metrics_carry_the_tiers(bamba, tiers):
    """`--host-cache-mb` reaches LLM(...); `/metrics` renders every tier's stats as
    `checkpoint_tier_*{tier=...}`, each value the one in `stats()["checkpoint_tiers"]`."""
    import argparse

    from hybridkv.cli import add_llm_args, llm_kwargs
    from hybridkv.server.metrics import ServerMetrics

    ap = argparse.ArgumentParser()
    add_llm_args(ap)
    assert llm_kwargs(ap.parse_args(["--host-cache-mb", "3"]))["host_cache_bytes"] == 3 << 20
    llm = LLM(str(bamba), host_cache_bytes=tiers.host_bytes, **tiers.kw)
    two_passes(llm, tiers.prefixes)
    s = llm.stats()
    text = ServerMetrics("m").render(s).decode()
    by_tier = s["checkpoint_tiers"]
    assert by_tier["host"]["promotions"] >= 4 and by_tier["host"]["promotion_seconds"] > 0, by_tier
    for tier, st in by_tier.items():
        for key, v in st.items():
            gauge = key in ("entries", "bytes", "budget_bytes", "swap_bytes", "kv_entries", "kv_bytes", "pinned_entries",
                            "kv_pinned_entries")
            name = f"checkpoint_tier_{key}" + ("" if gauge else "_total")
            assert f'hybridkv:{name}{{model_name="m",tier="{tier}"}} {float(v)}' in text, (name, tier, v)
    assert 'hybridkv:checkpoint_tier_demotions_total{model_name="m",tier="device"}' not in text


def test_a_fresh_prompts_trail_serves_a_request_that_branches_inside_it(bamba, tiers):
    """With a host tier, 'junctions' leaves states along a fresh prompt (checkpoint_policy's
    trail): a later request that shares 70 of its tokens resumes from the state at 64 instead
    of from nothing (no junction was known when the first ran). Tokens equal caching off."""
    rng = random.Random(7)
    first = [rng.randrange(4, 128) for _ in range(100)]  # prompt end 96; trail at 32 and 64
    second = first[:70] + [rng.randrange(4, 128) for _ in range(30)]
    cold = LLM(str(bamba), enable_prefix_caching=False, **tiers.kw)
    want = [o.outputs[0].token_ids for o in cold.generate([first, second], greedy(4), use_tqdm=False)]
    hits = {}
    for host in (0, tiers.host_bytes):
        llm = LLM(str(bamba), host_cache_bytes=host, **tiers.kw)
        got = [llm.generate([p], greedy(4), use_tqdm=False)[0] for p in (first, second)]
        assert [o.outputs[0].token_ids for o in got] == want
        hits[host] = got[1].num_cached_tokens
        assert_no_leaks(llm)
    assert hits == {0: 0, tiers.host_bytes: 64}


@pytest.mark.parametrize("family", ["bamba", "llama"])
def test_kv_blocks_evicted_to_the_host_serve_the_second_pass(tmp_path, family):
    """KV blocks in the host tier (memory/host_kv_tier.py): with KV for about two prompts on the
    device, the second pass over six prefixes finds the evicted blocks on the host (and, on the
    hybrid, the states on the device or the host): more cached tokens, and tokens equal to the
    engine without a host tier. (Also the case a promotion once missed: a second request admitted
    in the same step as the first must fit its hit plus its chunk, never more than its tokens.)"""
    path = str(make_tiny_checkpoint(family, tmp_path))
    specs = LLM(path, memory_budget_bytes=16 << 20).model.cache_specs()
    slots = 1 + 2 + 8 if family == "bamba" else 0
    kw = dict(max_num_seqs=2, checkpoint_share=0.5 if slots else 0.0,
              memory_budget_bytes=tight_budget(specs, 16, blocks=10, slots=slots))
    rng = random.Random(3)
    prefixes = [[rng.randrange(4, 128) for _ in range(48)] for _ in range(6)]
    plain = LLM(path, **kw)
    want = two_passes(plain, prefixes)
    host_bytes = 64 * (tight_budget(specs, 16, blocks=1, slots=0) + (state_bytes_per_slot(specs) if slots else 0))
    llm = LLM(path, host_cache_bytes=host_bytes, **kw)
    assert two_passes(llm, prefixes) == want
    s, base = llm.stats(), plain.stats()
    host = s["checkpoint_tiers"]["host"]
    assert host["kv_demotions"] > 0 and host["kv_promotions"] >= 6 * 3 // 2, host
    # every prompt of the second pass resumes after its whole 48-token prefix; without the tier few do
    assert s["prefix_hit_tokens"] == 6 * 48 > base["prefix_hit_tokens"], (s["prefix_hit_tokens"], base["prefix_hit_tokens"])
    assert_no_leaks(llm)
