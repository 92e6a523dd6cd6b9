"""The disk tier through the engine (hybridkv/memory/disk_tier.py): an LLM with `disk_cache_dir`
answers, is closed, and a NEW LLM on the same directory answers the same prompts from disk
(cached tokens > 0) with the tokens of the first run and of an engine without any cache (the
oracle); a damaged file of any kind is refused and counted, and the prompt recomputed to the
same tokens. Hybrid (Bamba), pure attention (Llama), two attention groups (gpt-oss: full +
sliding window) and pure recurrent (Falcon-Mamba: states only), int8 caches (bytes carried as they are), another cache layout in the same
directory, the CLI flags and /metrics."""
import os
from pathlib import Path

import pytest

from engine_fixtures import assert_no_leaks, greedy, three_block_prompts, tokens_and_cached
from hybridkv import LLM
from hybridkv.models.tiny import make_tiny_checkpoint

KW = dict(memory_budget_bytes=16 << 20, max_num_seqs=4)
FAMILIES = {"bamba": 0, "llama": 1, "gpt_oss": 5, "falcon_mamba": 2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {f: make_tiny_checkpoint(f, tmp_path_factory.mktemp(f), seed=s) for f, s in FAMILIES.items()}


def entry_files(root) -> list[Path]:
    return sorted(p for p in Path(root).glob("*/*.hkv"))


def first_run(path, root, **kw):
    """The first engine's tokens on the disk tier at `root` (closed: every write done)."""
    llm = LLM(str(path), disk_cache_dir=str(root), **KW, **kw)
    tokens, cached = tokens_and_cached(llm, three_block_prompts())
    assert cached == [0, 0, 0]
    llm.close()
    return tokens, llm.stats()["checkpoint_tiers"]["disk"]


@pytest.mark.parametrize("family", [f if f in ("bamba", "llama") else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])  # sliding windows and a pure-recurrent model: slow tier
def test_a_restarted_engine_answers_from_disk(checkpoints, tmp_path, family):
    path = checkpoints[family]
    oracle, _ = tokens_and_cached(LLM(str(path), enable_prefix_caching=False, **KW), three_block_prompts())
    tokens, wrote = first_run(path, tmp_path)
    assert tokens == oracle
    assert wrote["kv_demotions"] >= (0 if family == "falcon_mamba" else 3 * 3), wrote
    assert wrote["write_errors"] == wrote["dropped_writes"] == 0, wrote
    files = entry_files(tmp_path)
    assert len(files) == wrote["entries"] + wrote["kv_entries"]
    again = LLM(str(path), disk_cache_dir=str(tmp_path), **KW)
    got, cached = tokens_and_cached(again, three_block_prompts())
    assert got == tokens == oracle
    assert cached == [48, 48, 48], cached
    disk = again.stats()["checkpoint_tiers"]["disk"]
    assert disk["hits"] == 3 and disk["refused_corrupt"] == 0, disk
    assert disk["kv_promotions"] >= (0 if family == "falcon_mamba" else 9), disk
    if family in ("bamba", "falcon_mamba"):
        assert disk["promotions"] == 3 and wrote["demotions"] >= 3, (disk, wrote)
    assert_no_leaks(again)
    again.close()


def truncate(p: Path):
    p.write_bytes(p.read_bytes()[:-9])


def flip(p: Path):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def swap_names(files: list[Path]):
    """Each file takes the next one's name (same kind): its key no longer matches its name."""
    by_kind: dict[str, list[Path]] = {}
    for p in files:
        by_kind.setdefault(p.name.split("-")[0] + p.name.split("-")[1], []).append(p)
    for group in by_kind.values():
        data = [p.read_bytes() for p in group]
        for p, d in zip(group, data[1:] + data[:1]):
            p.write_bytes(d)


@pytest.mark.parametrize("damage", ["flip", pytest.param("truncate", marks=pytest.mark.slow),
                                    pytest.param("swap", marks=pytest.mark.slow)])
def test_damaged_entries_are_refused_and_recomputed(checkpoints, tmp_path, damage):
    """Every entry file is damaged between the runs: no hit, no crash, each refusal counted,
    the refused files deleted, and the tokens those of the first run."""
    path = checkpoints["bamba"]
    tokens, _ = first_run(path, tmp_path)
    files = entry_files(tmp_path)
    if damage == "swap":
        swap_names(files)
    else:
        for p in files:
            (flip if damage == "flip" else truncate)(p)
    again = LLM(str(path), disk_cache_dir=str(tmp_path), **KW)
    got, cached = tokens_and_cached(again, three_block_prompts())
    assert got == tokens and cached == [0, 0, 0]
    disk = again.stats()["checkpoint_tiers"]["disk"]
    # each prompt's 3 KV blocks and state: all read (not only the first that failed) and refused
    assert disk["refused_corrupt"] == len(files) == 12, disk
    assert disk["hits"] == 0 and disk["promotions"] == 0, disk
    again.close()
    # the refused files were deleted and the recomputed prefixes written afresh: a third engine hits
    third = LLM(str(path), disk_cache_dir=str(tmp_path), **KW)
    got, cached = tokens_and_cached(third, three_block_prompts())
    assert got == tokens and cached == [48, 48, 48]
    assert third.stats()["checkpoint_tiers"]["disk"]["refused_corrupt"] == 0
    third.close()


def test_quantized_caches_and_another_layout_in_one_directory(checkpoints, tmp_path):
    """int8 KV and state pools: their bytes are written and read back as they are (the restart's
    tokens are the first int8 run's); the float32 engine on the same directory uses its own
    namespace, so it neither hits nor refuses the int8 files."""
    path = checkpoints["bamba"]
    q = dict(kv_cache_dtype="int8", state_cache_dtype="int8")
    tokens, _ = first_run(path, tmp_path, **q)
    again = LLM(str(path), disk_cache_dir=str(tmp_path), **KW, **q)
    got, cached = tokens_and_cached(again, three_block_prompts())
    again.close()
    assert got == tokens and cached == [48, 48, 48]
    plain = LLM(str(path), disk_cache_dir=str(tmp_path), **KW)
    _, cached = tokens_and_cached(plain, three_block_prompts())
    plain.close()
    assert cached == [0, 0, 0] and plain.stats()["checkpoint_tiers"]["disk"]["refused_corrupt"] == 0
    assert len(os.listdir(tmp_path)) == 2  # two namespaces


def test_the_cli_flags_metrics_and_a_bad_directory(checkpoints, tmp_path):
    import argparse

    from prometheus_client.parser import text_string_to_metric_families

    from hybridkv.cli import add_llm_args, llm_kwargs
    from hybridkv.server.metrics import ServerMetrics

    ap = argparse.ArgumentParser()
    add_llm_args(ap)
    kw = llm_kwargs(ap.parse_args(["--disk-cache", str(tmp_path), "--disk-cache-gb", "0.5", "--no-disk-read-ahead"]))
    assert kw["disk_cache_dir"] == str(tmp_path) and kw["disk_cache_bytes"] == 1 << 29
    assert kw["disk_read_ahead"] is False
    default = llm_kwargs(ap.parse_args([]))
    assert default["disk_cache_dir"] is None and default["disk_cache_bytes"] == 16 << 30
    assert default["disk_read_ahead"] is True
    first_run(checkpoints["bamba"], tmp_path)
    llm = LLM(str(checkpoints["bamba"]), disk_cache_dir=str(tmp_path), **KW)
    tokens_and_cached(llm, three_block_prompts())
    llm.close()
    s = llm.stats()
    samples = {(x.name, x.labels.get("tier")): x.value
               for fam in text_string_to_metric_families(ServerMetrics("m").render(s).decode()) for x in fam.samples}
    disk = s["checkpoint_tiers"]["disk"]
    assert disk["hits"] == 3
    for key, v in disk.items():
        gauge = key in ("entries", "kv_entries", "bytes", "budget_bytes")
        name = f"hybridkv:checkpoint_tier_{key}" + ("" if gauge else "_total")
        assert samples.get((name, "disk")) == float(v), (name, v)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=f"disk_cache_dir '{blocker}': cannot create and write"):
        LLM(str(checkpoints["bamba"]), disk_cache_dir=str(blocker), **KW)
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        LLM(str(checkpoints["bamba"]), disk_cache_dir=str(tmp_path), enable_prefix_caching=False, **KW)
    with pytest.raises(ValueError, match="disk_cache_bytes=0 must be an integer > 0"):
        LLM(str(checkpoints["bamba"]), disk_cache_dir=str(tmp_path), disk_cache_bytes=0, **KW)


@pytest.mark.slow  # three tiers, two passes and a restart
def test_with_a_host_tier_a_tight_device_and_a_small_disk_budget(checkpoints, tmp_path):
    """Two device checkpoint slots, a host tier and a disk budget of about three prompts' entries:
    states move between device and host while the disk evicts files; every output is the no-cache
    engine's, the disk stays within its budget, and a restart still hits what the disk kept."""
    from engine_fixtures import tight_budget
    from hybridkv.plan import state_bytes_per_slot

    path = checkpoints["bamba"]
    specs = LLM(str(path), memory_budget_bytes=16 << 20).model.cache_specs()
    kw = dict(max_num_seqs=2, checkpoint_share=0.1, memory_budget_bytes=tight_budget(specs, 16, blocks=64, slots=5))
    ps = three_block_prompts(6, seed=3)
    oracle, _ = tokens_and_cached(LLM(str(path), enable_prefix_caching=False, **kw), ps + ps)
    host = 4 * state_bytes_per_slot(specs)  # (the probe too: with a host tier a prompt also leaves a trail)
    probe = LLM(str(path), disk_cache_dir=str(tmp_path / "probe"), host_cache_bytes=host, **kw)
    tokens_and_cached(probe, ps[:1])
    probe.close()
    per_prompt = probe.stats()["checkpoint_tiers"]["disk"]["bytes"]
    budget = 3 * per_prompt + per_prompt // 2
    tiers = dict(host_cache_bytes=host, disk_cache_dir=str(tmp_path / "d"),
                 disk_cache_bytes=budget)
    llm = LLM(str(path), **kw, **tiers)
    got, _ = tokens_and_cached(llm, ps + ps)
    llm.close()
    assert got == oracle
    disk = llm.stats()["checkpoint_tiers"]["disk"]
    assert disk["evictions"] > 0 and disk["bytes"] <= budget and disk["refused_corrupt"] == 0, disk
    assert llm.stats()["checkpoint_tiers"]["host"]["demotions"] > 0
    again = LLM(str(path), **kw, **tiers)
    got, cached = tokens_and_cached(again, ps[::-1])  # the most recently written first: the budget kept those
    again.close()
    assert got == oracle[:6][::-1]
    # the newest entries survive the budget: a prefix of the reversed prompts hits whole, the rest
    # miss (how many fit depends on which states the host tier demoted and so wrote: 2 or 3 of 6)
    assert cached[:2] == [48, 48] and set(cached) <= {0, 48} and cached == sorted(cached, reverse=True), cached
    assert again.stats()["checkpoint_tiers"]["disk"]["refused_corrupt"] == 0


def test_the_guards_invalidation_deletes_the_state_files(checkpoints, tmp_path):
    """`PrefixCache.invalidate(key)` (the prefix-hit guard's verb) drops the state under that key
    from the disk as well: a restart no longer hits that prompt, and still hits the others."""
    path = checkpoints["bamba"]
    tokens, _ = first_run(path, tmp_path)
    llm = LLM(str(path), disk_cache_dir=str(tmp_path), **KW)
    states = {p.name.split("-")[-1][:-4]: p for p in Path(tmp_path).glob("*/state-*.hkv")}
    assert len(states) == 3
    key = llm.manager.prefix_cache.prompt_hashes(three_block_prompts()[0], None)[2]
    assert llm.manager.prefix_cache.invalidate(key)
    assert not llm.manager.prefix_cache.invalidate(bytes(32))  # held by no tier
    llm.close()
    assert not states[key.hex()].exists() and sum(p.exists() for p in states.values()) == 2
    again = LLM(str(path), disk_cache_dir=str(tmp_path), **KW)
    got, cached = tokens_and_cached(again, three_block_prompts())
    again.close()
    assert got == tokens and cached == [0, 48, 48]


@pytest.mark.parametrize("spec", [None, pytest.param({"method": "ngram", "num_speculative_tokens": 3},
                                                     marks=pytest.mark.slow)], ids=["plain", "ngram"])
def test_the_next_turn_after_a_restart_resumes_past_the_answer(checkpoints, tmp_path, spec):
    """The rolling state inside an answer (a block boundary of the output, kept by the decodes) is
    written through as well: after a restart, a next turn (prompt + part of the answer + new
    tokens) hits past the prompt, with the tokens of the engine without any cache; also with
    speculative decoding on (its verify steps keep that state; on this random model the n-gram
    drafter's drafts are rarely accepted, so the draft-slot path is not what this checks)."""
    path = checkpoints["bamba"]
    prompt = [5, 6, 7, 8] * 13  # 52 tokens; repetitive, so the n-gram drafter proposes drafts
    kw = dict(KW, speculative_config=spec)
    first = LLM(str(path), disk_cache_dir=str(tmp_path), **kw)
    answer = first.generate([prompt], greedy(30), use_tqdm=False)[0].outputs[0].token_ids
    first.close()
    turn = prompt + answer[:20] + [9, 10, 11]  # 75 tokens: the output's boundary at 64 is inside
    oracle = LLM(str(path), enable_prefix_caching=False, **KW).generate([turn], greedy(6), use_tqdm=False)[0]
    again = LLM(str(path), disk_cache_dir=str(tmp_path), **kw)
    out = again.generate([turn], greedy(6), use_tqdm=False)[0]
    again.close()
    assert out.num_cached_tokens == 64 and out.outputs[0].token_ids == oracle.outputs[0].token_ids


@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "damaged"])
def test_a_hit_mixing_host_and_disk_blocks_gives_the_no_cache_tokens(checkpoints, tmp_path, damaged):
    """Each prompt's prefix is left with its KV blocks split between the host KV tier and the disk
    (host-disk-host, disk-host-disk, host-host-disk) and its state on the disk, or where it was (the
    device or the host): the admission takes the whole prefix from the mix (memory/tier_reach.py),
    with the tokens of the engine without any cache and nothing leaked. damaged: the disk block of
    the first prompt is bit-flipped: refused, counted, that prompt hits less, its tokens unchanged."""
    from engine_fixtures import tight_budget

    path = checkpoints["bamba"]
    specs = LLM(str(path), memory_budget_bytes=16 << 20).model.cache_specs()
    kw = dict(max_num_seqs=4, memory_budget_bytes=tight_budget(specs, 16, blocks=16, slots=1 + 4 + 2))
    ps = three_block_prompts()
    oracle, _ = tokens_and_cached(LLM(str(path), enable_prefix_caching=False, **kw), ps)
    llm = LLM(str(path), disk_cache_dir=str(tmp_path), host_cache_bytes=64 << 20, **kw)
    assert tokens_and_cached(llm, ps) == (oracle, [0, 0, 0])
    for seed in (9, 10):  # other prompts take every block (16 and a rounding): the first ones' KV goes to the host
        tokens_and_cached(llm, three_block_prompts(4, seed=seed))
    mgr = llm.manager
    mgr.disk.flush()
    host_kv, disk = mgr.prefix_cache.host_kv, mgr.disk
    for p, blocks, state in zip(ps, ["HDH", "DHD", "HHD"], ["disk", "disk", "kept"]):
        hashes = mgr.prefix_cache.prompt_hashes(p, None)
        for i, where in enumerate(blocks):
            assert (None, hashes[i]) in host_kv and disk.has_kv(None, i, hashes[i])
            if where == "H":
                disk.store.remove(disk.kv_name(None, i, hashes[i]))
            else:
                host_kv.drop(None, hashes[i])
        if state == "disk":
            mgr.recurrent.store.invalidate(hashes[2])  # off the device and the host; its file stays
    disk.flush()
    if damaged:
        hashes = mgr.prefix_cache.prompt_hashes(ps[0], None)
        flip(Path(disk.store.dir) / disk.kv_name(None, 1, hashes[1]))
    assert [llm.manager.prefix_cache.usable_tokens(p) for p in ps] == [48, 48, 48]  # the probe reads no file
    got, cached = tokens_and_cached(llm, ps)
    assert got == oracle
    s = llm.stats()["checkpoint_tiers"]
    if damaged:  # block 1 of the first prompt is gone: no hit past 16 tokens there
        assert cached[0] <= 16 and cached[1:] == [48, 48], cached
        assert s["disk"]["refused_corrupt"] == 1, s["disk"]
    else:
        assert cached == [48, 48, 48], cached
        assert s["disk"]["refused_corrupt"] == 0 and s["disk"]["kv_promotions"] >= 4 and s["disk"]["promotions"] == 2
    assert_no_leaks(llm)
    llm.close()
