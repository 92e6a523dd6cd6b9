"""The host tier of state checkpoints through the engine (hybridkv/memory/host_tier.py): on a tiny
Bamba with two device checkpoint slots, a second pass over six prefixes hits states demoted to the
host, and every output is token for token the one-tier engine's (the oracle: the same engine
without the tier, which recomputes those prefixes)."""
import random

import pytest

from engine_fixtures import assert_no_leaks, greedy, tight_budget
from hybridkv import LLM
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.plan import state_bytes_per_slot


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    return make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"))


def two_passes(llm, prefixes, rng_seed=1):
    """Each prefix with one suffix, then each again with another: token lists of both passes."""
    rng = random.Random(rng_seed)
    outs = []
    for _ in range(2):
        prompts = [p + [rng.randrange(4, 128) for _ in range(8)] for p in prefixes]
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(4), use_tqdm=False)]
    return outs


def test_hits_from_the_host_tier_give_the_one_tier_tokens(bamba):
    specs = LLM(str(bamba), memory_budget_bytes=16 << 20).model.cache_specs()
    # null + 2 live + 2 checkpoint slots; KV for every prefix
    kw = dict(max_num_seqs=2, checkpoint_share=0.1,
              memory_budget_bytes=tight_budget(specs, 16, blocks=64, slots=1 + 2 + 2))
    rng = random.Random(0)
    prefixes = [[rng.randrange(4, 128) for _ in range(48)] for _ in range(6)]
    one_tier = LLM(str(bamba), **kw)
    assert one_tier.manager.num_slots == 5
    want = two_passes(one_tier, prefixes)
    host_bytes = 8 * 2 * state_bytes_per_slot(specs)
    tiered = LLM(str(bamba), host_cache_bytes=host_bytes, **kw)
    got = two_passes(tiered, prefixes)
    assert got == want
    s, base = tiered.stats(), one_tier.stats()
    host = s["checkpoint_tiers"]["host"]
    assert host["demotions"] >= 4 and host["hits"] >= 4 and host["refused_corrupt"] == 0, host
    assert host["bytes"] <= host_bytes
    # the host hits are prefixes the one-tier engine computed again
    assert s["prefix_hit_tokens"] >= base["prefix_hit_tokens"] + 4 * 48
    assert "host" not in base["checkpoint_tiers"]
    assert_no_leaks(tiered)


def test_a_corrupted_host_entry_is_never_used(bamba):
    specs = LLM(str(bamba), memory_budget_bytes=16 << 20).model.cache_specs()
    kw = dict(max_num_seqs=2, checkpoint_share=0.1,
              memory_budget_bytes=tight_budget(specs, 16, blocks=64, slots=1 + 2 + 2))
    rng = random.Random(0)
    prefixes = [[rng.randrange(4, 128) for _ in range(48)] for _ in range(6)]
    want = two_passes(LLM(str(bamba), **kw), prefixes)
    llm = LLM(str(bamba), host_cache_bytes=8 * 2 * state_bytes_per_slot(specs), **kw)
    suffixes = random.Random(1)
    first = [p + [suffixes.randrange(4, 128) for _ in range(8)] for p in prefixes]
    assert [o.outputs[0].token_ids for o in llm.generate(first, greedy(4), use_tqdm=False)] == want[:6]
    host = llm.manager.recurrent.host
    corrupted = list(host.entries)
    assert len(corrupted) >= 4
    for entry in host.entries.values():  # change one value of every host state
        t = next(iter(entry.ssm.values())).view(-1)
        t[0] = t[0] + 1.0
    second = [p + [suffixes.randrange(4, 128) for _ in range(8)] for p in prefixes]
    assert [o.outputs[0].token_ids for o in llm.generate(second, greedy(4), use_tqdm=False)] == want[6:]
    s = llm.stats()["checkpoint_tiers"]["host"]
    # each corrupted state was refused when its prefix came back (the tokens above: recomputed);
    # what the host holds now are fresh states of the recomputed prefixes, all passing the check
    assert s["refused_corrupt"] == len(corrupted), s
    assert all(host.usable(k, e.position) for k, e in list(host.entries.items()))
    assert_no_leaks(llm)


def test_the_cli_flag_and_metrics_carry_the_tiers(bamba):
    """`--host-cache-mb` reaches LLM(...); `/metrics` renders every tier's stats as
    `checkpoint_tier_*{tier=...}`, each value the one in `stats()["checkpoint_tiers"]`."""
    import argparse

    from hybridkv.cli import add_llm_args, llm_kwargs
    from hybridkv.server.metrics import ServerMetrics

    ap = argparse.ArgumentParser()
    add_llm_args(ap)
    assert llm_kwargs(ap.parse_args(["--host-cache-mb", "3"]))["host_cache_bytes"] == 3 << 20
    specs = LLM(str(bamba), memory_budget_bytes=16 << 20).model.cache_specs()
    llm = LLM(str(bamba), host_cache_bytes=8 * 2 * state_bytes_per_slot(specs), max_num_seqs=2,
              checkpoint_share=0.1, memory_budget_bytes=tight_budget(specs, 16, blocks=64, slots=1 + 2 + 2))
    rng = random.Random(0)
    two_passes(llm, [[rng.randrange(4, 128) for _ in range(48)] for _ in range(6)])
    s = llm.stats()
    text = ServerMetrics("m").render(s).decode()
    tiers = s["checkpoint_tiers"]
    assert tiers["host"]["promotions"] >= 4 and tiers["host"]["promotion_seconds"] > 0, tiers
    for tier, st in tiers.items():
        for key, v in st.items():
            gauge = key in ("entries", "bytes", "budget_bytes")
            name = f"checkpoint_tier_{key}" + ("" if gauge else "_total")
            assert f'hybridkv:{name}{{model_name="m",tier="{tier}"}} {float(v)}' in text, (name, tier, v)
    assert 'hybridkv:checkpoint_tier_demotions_total{model_name="m",tier="device"}' not in text
