"""Quantized pools through the engine (scheduler/cache_staging.py), for every family.

The oracle is a reference written here with nothing of the staging's machinery: before each
forward the WHOLE pools are decoded, the model runs on them with the batch as built (pool slot and
block ids), and after it the rows the step wrote (its state slots; the KV vectors of its tokens)
are encoded back. The staged engine (per-layer working tensors, renumbered slots and blocks) must
give the same tokens and leave the same pool bytes."""
import dataclasses

import pytest
import torch

from engine_fixtures import assert_no_leaks, greedy
from family_checks import FAMILIES, prompt
from hybridkv import LLM, SamplingParams
from hybridkv.models.forward_batch import ModelCaches

FAST = {"bamba"}  # states and KV; sliding groups (gpt_oss) and indexer pages (glm5_next) run in the slow tier


def use_reference_staging(llm: LLM) -> None:
    staging = llm.engine.runner.staging
    bs = staging.block_size
    kv_layouts, conv_layouts, ssm_layouts = staging.kv_layouts, staging.state_layouts["conv"], staging.state_layouts["ssm"]

    def decoded(pools, layouts):
        return {i: layouts[i][0].decode(t, layouts[i][1]) if i in layouts else t for i, t in pools.items()}

    def stage(batch, caches):
        kv, conv, ssm = decoded(caches.kv, kv_layouts), decoded(caches.conv, conv_layouts), decoded(caches.state, ssm_layouts)
        layout_by_storage = {t.untyped_storage().data_ptr(): conv_layouts.get(i, ssm_layouts.get(i, (None,)))[0]
                             for part, layouts in ((conv, conv_layouts), (ssm, ssm_layouts))
                             for i, t in part.items() if i in layouts}

        def requantize(t, slots):
            layout = layout_by_storage[t.untyped_storage().data_ptr()]
            rows = t[slots]
            return layout.decode(layout.encode(rows.reshape(rows.shape[0], *layout.shape)), t.dtype).reshape(rows.shape)

        def store():
            slots = sorted(set(batch.state_slots.tolist()) | {s for c in batch.verify_slots.values() for s in c} - {0})
            idx = torch.tensor(slots, dtype=torch.long)
            for pools, work, layouts in ((caches.conv, conv, conv_layouts), (caches.state, ssm, ssm_layouts)):
                for i, (layout, _) in layouts.items():
                    if slots:
                        pools[i][idx] = layout.encode(work[i][idx])
            for i, (layout, _, window) in kv_layouts.items():
                _, mapping, _ = batch.kv_tables(window if batch.kv_groups else None)
                s = mapping[mapping >= 0].long()
                caches.kv[i][s // bs, :, s % bs] = layout.encode(kv[i][s // bs, :, s % bs])
        batch = dataclasses.replace(batch, requantize=requantize if batch.verify_slots else None)
        return batch, ModelCaches(kv=kv, conv=conv, state=ssm, block_size=caches.block_size), store
    staging.stage = stage


def pools(llm: LLM) -> list[torch.Tensor]:
    m = llm.engine.mgr
    return [t.clone() for d in (m.kv_caches, m.conv_states, m.ssm_states) for t in d.values()]


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in FAMILIES])
def test_every_family_stages_exactly_what_whole_pools_would_give(name, tmp_path):
    """int8 KV and state; prompts of 1, 15, 17 and 53 tokens in chunks of at most 24 tokens, a
    repeated prompt (a prefix hit from a quantized checkpoint), 16 tokens each: the staged engine's
    tokens and pool bytes are the reference's, and nothing leaks."""
    fam = FAMILIES[name]
    path = fam.make(fam.name, tmp_path, seed=fam.seed, **fam.overrides)
    prompts = [prompt(n, 40 + n) for n in (1, 15, 17, 53)]
    prompts.append(list(prompts[3]))
    results = []
    for reference in (False, True):
        llm = LLM(str(path), memory_budget_bytes=16 << 20, max_num_batched_tokens=24,
                  kv_cache_dtype="int8", state_cache_dtype="int8")
        if llm.engine.runner.staging is None:
            pytest.fail(f"{name}: nothing quantized")
        if reference:
            use_reference_staging(llm)
        first = llm.generate(prompts[:4], greedy(16), use_tqdm=False)
        again = llm.generate(prompts[4:], greedy(16), use_tqdm=False)
        assert_no_leaks(llm)
        results.append(([o.outputs[0].token_ids for o in first + again], pools(llm)))
    (staged, staged_pools), (ref, ref_pools) = results
    assert staged == ref
    assert len(staged_pools) == len(ref_pools) and all(torch.equal(a, b) for a, b in zip(staged_pools, ref_pools))


def test_pools_shrink_to_a_byte_a_value_plus_scales(tmp_path):
    from hybridkv.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("bamba", tmp_path, seed=2)
    plain = LLM(str(path), memory_budget_bytes=16 << 20)
    quant = LLM(str(path), memory_budget_bytes=16 << 20, kv_cache_dtype="fp8_e4m3", state_cache_dtype="int8")
    p, q = plain.manager.memory_plan, quant.manager.memory_plan
    assert q.kv_bytes_per_block < p.kv_bytes_per_block / 3  # fp32 -> a byte + 4 bytes a head vector
    assert q.state_bytes_per_slot < p.state_bytes_per_slot / 3
    assert q.num_blocks > 3 * p.num_blocks or q.num_slots > 3 * p.num_slots
    for t in quant.manager.kv_caches.values():
        assert t.dtype == torch.uint8
    assert quant.stats()["kv_blocks_total"] == q.num_blocks


def test_speculation_under_a_quantized_state_decodes_the_plain_tokens(tmp_path):
    """A verified draft token's state passes through the pool's rounding before the next token
    reads it (ForwardBatch.requantize), as a plain decode's does: speculation on and off give the
    same greedy tokens with int8 states."""
    from hybridkv.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("bamba", tmp_path, seed=2)
    prompts = [prompt(n, 7 + n) * 3 for n in (5, 11)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    opts = dict(memory_budget_bytes=16 << 20, state_cache_dtype="int8", kv_cache_dtype="int8")
    plain = LLM(str(path), **opts).generate(prompts, params, use_tqdm=False)
    spec = LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                              "prompt_lookup_min": 1, "off_when_slower": False}, **opts)
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    s = spec.stats()
    assert s["spec_verify_runs"] > 0 and s["spec_accepted_tokens"] > 0, s


def test_stochastic_rounding_is_seeded_and_rounds_otherwise(bamba_path):
    """quantize_stochastic: the same seed gives the same pool bytes; they differ from rounding to nearest."""
    prompts = [prompt(n, 30 + n) for n in (9, 33)]

    def run(**kw):
        llm = LLM(bamba_path, memory_budget_bytes=16 << 20, **QUANT, **kw)
        llm.generate(prompts, greedy(8), use_tqdm=False)
        return pools(llm)
    a, b, nearest = run(quantize_stochastic=True), run(quantize_stochastic=True), run()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, nearest))


def test_options_are_checked(tmp_path):
    from hybridkv.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("bamba", tmp_path, seed=2)
    with pytest.raises(ValueError, match="state_cache_dtype='int4'"):
        LLM(str(path), state_cache_dtype="int4")
    with pytest.raises(ValueError, match="quantize_stochastic rounds int8"):
        LLM(str(path), kv_cache_dtype="fp8_e4m3", quantize_stochastic=True)
    with pytest.raises(ValueError, match="without CUDA graphs"):
        LLM(str(path), kv_cache_dtype="int8", cuda_graphs="dry_run")


def test_serve_flags_reach_llm():
    import argparse

    from hybridkv.cli import add_llm_args, llm_kwargs

    ap = argparse.ArgumentParser()
    add_llm_args(ap)
    kw = llm_kwargs(ap.parse_args(["--kv-cache-dtype", "fp8_e4m3", "--state-cache-dtype", "int8",
                                   "--quantize-stochastic"]))
    assert (kw["kv_cache_dtype"], kw["state_cache_dtype"], kw["quantize_stochastic"]) == ("fp8_e4m3", "int8", True)
    assert llm_kwargs(ap.parse_args([]))["kv_cache_dtype"] == "auto"
    with pytest.raises(SystemExit):
        ap.parse_args(["--kv-cache-dtype", "int4"])


# ---- the memory around quantized pools -------------------------------------------------------
QUANT = dict(kv_cache_dtype="int8", state_cache_dtype="int8")


@pytest.fixture(scope="module")
def bamba_path(tmp_path_factory):
    from hybridkv.models.tiny import make_tiny_checkpoint

    return str(make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"), seed=2))


def pressured(path, mode, reference=False):
    """5 requests of 40 tokens on 7 KV blocks, 3 live slots and 3 seats, preempting in `mode`."""
    from engine_fixtures import tight_budget
    from hybridkv.specs import with_cache_dtypes

    specs = with_cache_dtypes(LLM(path, memory_budget_bytes=16 << 20).model.cache_specs(), "int8", "int8")
    llm = LLM(path, memory_budget_bytes=tight_budget(specs, 16, blocks=7, slots=1 + 3), max_num_seqs=3,
              max_num_batched_tokens=24, preemption_mode=mode, checkpoint_share=0.0, **QUANT)
    if reference:
        use_reference_staging(llm)
    return llm


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_of_quantized_pools(bamba_path, mode):
    """Preempted in both modes, every request ends with the reference staging's tokens under the
    same pressure; swap moves the codes and scales as they are, so its tokens are also those of the
    quantized engine without pressure (recompute rounds the recomputed prefix at other chunk ends,
    so its tokens may legitimately differ from that); nothing leaks."""
    prompts = [prompt(n, 90 + n) for n in (3, 17, 30, 9, 22)]
    runs = []
    for reference in (False, True):
        llm = pressured(bamba_path, mode, reference)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(40), use_tqdm=False)])
        assert llm.stats()["preemptions"][mode] > 0
        assert_no_leaks(llm)
    assert runs[0] == runs[1]
    if mode == "swap":
        free = LLM(bamba_path, memory_budget_bytes=16 << 20, max_num_batched_tokens=24, **QUANT)
        assert runs[0] == [o.outputs[0].token_ids for o in free.generate(prompts, greedy(40), use_tqdm=False)]


def test_migration_carries_codes_and_scales_and_refuses_another_cache_dtype(bamba_path):
    """A request exported mid-decode from an int8 engine continues in an int8 engine of another
    block size with the tokens it would have made; an engine keeping float32 (or fp8) refuses the
    snapshot by naming the cache dtypes, holding nothing."""
    from hybridkv.errors import SnapshotMismatchError
    from hybridkv.scheduler.snapshot_io import snapshot_from_bytes, snapshot_to_bytes

    prompts = [prompt(n, 70 + n) for n in (5, 21, 40)]
    kw = dict(memory_budget_bytes=16 << 20, max_num_batched_tokens=32)
    expected = [o.outputs[0].token_ids for o in LLM(bamba_path, **kw, **QUANT).generate(prompts, greedy(16), use_tqdm=False)]
    src = LLM(bamba_path, **kw, **QUANT)
    ids = [src.add_request(p, greedy(16)) for p in prompts]
    for _ in range(5):
        src.step()
    snaps = [snapshot_from_bytes(snapshot_to_bytes(src.export_request(i))) for i in ids]
    for other in ({}, dict(kv_cache_dtype="fp8_e4m3", state_cache_dtype="fp8_e4m3"), dict(state_cache_dtype="int8")):
        wrong = LLM(bamba_path, **kw, **other)
        with pytest.raises(SnapshotMismatchError, match="cache dtypes"):
            wrong.import_request(snaps[0])
        assert_no_leaks(wrong)
    dst = LLM(bamba_path, **{**kw, "block_size": 32}, **QUANT)
    for s in snaps:
        dst.import_request(s)
    done = {}
    while dst.has_unfinished_requests():
        for o in dst.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert [done[i] for i in ids] == expected
    assert_no_leaks(dst)
    assert_no_leaks(src)


@pytest.mark.parametrize("name,kv", [("bamba", "int8"), ("llama", "fp8_e4m3"), ("gpt_oss", "int8"),
                                     ("qwen3_next", "int8")])
def test_decode_steps_read_quantized_pages_in_place(name, kv, tmp_path, monkeypatch):
    """In steps of one-token decodes, attention layers read their pool's codes in place
    (ModelCaches.kv_codes -> PagedAttention.forward_codes: no page is decoded for them), and so do
    Mamba2 and GDN mixers their conv and state slots (state_codes -> forward_codes: each slot
    decoded, stepped and encoded back in C); the tokens and pool bytes are still the whole-pool
    reference's (gpt_oss: sliding and full KV groups, sinks; qwen3_next: GDN and gated attention)."""
    from hybridkv.models.attention import PagedAttention
    from hybridkv.models.gdn_mixer import GatedDeltaNetMixer
    from hybridkv.models.mamba2_mixer import Mamba2Mixer

    fam = FAMILIES[name]
    path = fam.make(fam.name, tmp_path, seed=fam.seed, **fam.overrides)
    prompts = [prompt(n, 60 + n) for n in (3, 19, 40)]
    calls, mixed = [], []
    real = PagedAttention.forward_codes
    monkeypatch.setattr(PagedAttention, "forward_codes", lambda self, *a: calls.append(1) or real(self, *a))
    for mixer in (Mamba2Mixer, GatedDeltaNetMixer):
        def mixer_codes(self, *a, real_mixer=mixer.forward_codes):
            y = real_mixer(self, *a)
            mixed.append(y is not None)
            return y
        monkeypatch.setattr(mixer, "forward_codes", mixer_codes)
    results = []
    for reference in (False, True):
        llm = LLM(str(path), memory_budget_bytes=16 << 20, max_num_batched_tokens=32, kv_cache_dtype=kv,
                  state_cache_dtype="int8")
        if reference:
            use_reference_staging(llm)
        before = len(calls)
        outs = llm.generate(prompts, greedy(12), use_tqdm=False)
        if reference:
            assert len(calls) == before  # the reference decodes every page
        else:
            assert len(calls) > 0
            assert (len(mixed) > 0 and all(mixed)) if name in ("bamba", "qwen3_next") else not mixed
        results.append(([o.outputs[0].token_ids for o in outs], pools(llm)))
    (staged, staged_pools), (ref, ref_pools) = results
    assert staged == ref
    assert all(torch.equal(a, b) for a, b in zip(staged_pools, ref_pools))
