"""Models without a single attention layer (Mamba, Mamba2, FalconMamba, RWKV-4) through the whole engine:
the KV pool takes no memory, prefix hits come from state checkpoints alone, preemption and
migration move only states, and every token is transformers' greedy choice."""
import numpy as np
import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.decode_rows import DecodeRows
from hybridkv.plan import state_bytes_per_slot
from hybridkv.scheduler.snapshot_io import snapshot_from_bytes, snapshot_to_bytes
from hybridkv.specs import RecurrentSpec

from engine_fixtures import assert_no_leaks, greedy
from family_checks import BS, prompt
from model_harness import assert_greedy_matches_hf

# falcon_mamba (Mamba1's layer and kernels with extra RMS norms: the engine's paths are mamba's) runs
# these engine checks in the slow tier; its model checks stay fast (tests/models/test_families.py)
PURE = ["mamba", "mamba2", pytest.param("falcon_mamba", marks=pytest.mark.slow), pytest.param("rwkv", marks=pytest.mark.slow)]
LENGTHS = (1, BS - 1, BS + 1, 3 * BS + 5)
BUDGET = 4 << 20


def _prompts(seed: int = 70) -> list[list[int]]:
    return [prompt(n, seed + n) for n in LENGTHS]


def _run(llm: LLM, ids: list) -> list[list[int]]:
    """Step `llm` until nothing is left; the token ids of requests `ids`, in that order."""
    done = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    return [done[i] for i in ids]


def _assert_hf(hf, prompts, outputs):
    for p, t in zip(prompts, outputs):
        assert assert_greedy_matches_hf(hf, p, t) == 0


@pytest.mark.parametrize("name", PURE)
def test_no_kv_pool_every_byte_to_state_slots(name, family_models):
    path, ours, _ = family_models(name)
    specs = ours.cache_specs()
    assert len(specs) == ours.config.num_hidden_layers
    assert all(isinstance(s, RecurrentSpec) for s in specs.values())
    llm = LLM(str(path), memory_budget_bytes=BUDGET)
    mgr, stats = llm.engine.mgr, llm.stats()
    plan = mgr.memory_plan
    assert stats["kv_blocks_total"] == 0 and plan.num_blocks == 0 and plan.kv_bytes == 0
    assert mgr.kv_caches == {}
    # what would have been KV blocks holds checkpoints: the slots use the budget to within a slot
    slot = state_bytes_per_slot(specs)
    held = sum(t.numel() * t.element_size()
               for t in (*mgr.conv_states.values(), *mgr.ssm_states.values()))
    assert held == plan.state_bytes == plan.num_slots * slot
    assert BUDGET - slot < held <= BUDGET
    assert stats["state_slots_total"] == plan.num_slots - 1 > plan.live_slots  # null slot not counted


@pytest.mark.parametrize("name", PURE)
def test_prefix_hit_from_a_state_checkpoint_alone(name, family_models):
    """A prompt sharing 40 tokens with an earlier one resumes from the earlier prompt_end state at
    32 (no KV anywhere) and still makes transformers' tokens."""
    path, _, hf = family_models(name)
    llm = LLM(str(path), memory_budget_bytes=BUDGET, checkpoint_policy="prompt_end")
    shared = prompt(40, 31)
    first, second = shared + prompt(5, 32), shared + prompt(9, 33)
    a = llm.generate([first], greedy(8), use_tqdm=False)[0]
    assert a.num_cached_tokens == 0
    b = llm.generate([second], greedy(8), use_tqdm=False)[0]
    assert b.num_cached_tokens == 2 * BS
    stats = llm.stats()
    assert stats["prefix_hit_tokens"] == 2 * BS and stats["kv_blocks_cached"] == 0
    assert stats["state_slots_checkpoint"] >= 1
    _assert_hf(hf, [first, second], [a.outputs[0].token_ids, b.outputs[0].token_ids])
    assert_no_leaks(llm)


@pytest.mark.parametrize("name", PURE)
def test_burst_computes_a_shared_prefix_once_and_forks_copy_the_state(name, family_models):
    """Three prompts sharing 40 tokens arrive together: the leader stops at 32 and keeps the state
    there, the followers wait a step and resume from it. Then n=2 greedy samples fork the live state."""
    path, _, hf = family_models(name)
    llm = LLM(str(path), memory_budget_bytes=BUDGET)
    shared = prompt(40, 41)
    prompts = [shared + prompt(3 + i, 42 + i) for i in range(3)]
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 2 * BS, 2 * BS]
    assert llm.stats()["burst_waits"] >= 2
    _assert_hf(hf, prompts, [o.outputs[0].token_ids for o in outs])
    two = SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True)
    forked = llm.generate([prompts[0]], two, use_tqdm=False)[0]
    assert [c.token_ids for c in forked.outputs] == [outs[0].outputs[0].token_ids] * 2
    assert llm.stats()["forks"] >= 1
    assert_no_leaks(llm)


@pytest.mark.parametrize("name", PURE)
def test_more_requests_than_slots_queue_and_match(name, family_models):
    """Two live slots for four requests: the others wait for a slot. A running request never needs
    more memory (allocate has nothing to give), so slot pressure queues and never preempts."""
    path, ours, hf = family_models(name)
    budget = state_bytes_per_slot(ours.cache_specs()) * (1 + 2)  # null slot + 2 live
    llm = LLM(str(path), memory_budget_bytes=budget, max_num_seqs=4, checkpoint_share=0.0,
              max_num_batched_tokens=24)
    assert llm.stats()["state_slots_total"] == 2
    prompts = _prompts()
    ids = [llm.add_request(p, greedy(12)) for p in prompts]
    peak, done = 0, {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        peak = max(peak, llm.stats()["state_slots_live"])
    assert peak == 2
    _assert_hf(hf, prompts, [done[i] for i in ids])
    assert sum(llm.stats()["preemptions"].values()) == 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", PURE)
def test_preempted_mid_decode_resumes_identically(name, mode, family_models, monkeypatch):
    """The scheduler's preemption path with zero KV: allocate refuses once per request after 20
    computed tokens (slot pressure alone never preempts, see above), the latest-arriving running
    request is preempted (recompute: from the donated state; swap: the slot to host and back)."""
    path, _, hf = family_models(name)
    llm = LLM(str(path), memory_budget_bytes=BUDGET, preemption_mode=mode, max_num_batched_tokens=32,
              checkpoint_policy="prompt_end")
    mgr = llm.engine.mgr
    allocate, refused = mgr.allocate, set()

    def refuse_once(req_id, n):
        if req_id not in refused and mgr.request(req_id).num_computed_tokens >= 20:
            refused.add(req_id)
            return None
        return allocate(req_id, n)

    allocate_decodes = DecodeRows.allocate

    def decodes_refusing_once(rows, starts):
        """The batched decode verb leaves out (not allocated) each request due its refusal, so the
        scheduler preempts the latest-arriving running request and asks again, as it does when a
        pool runs short."""
        if rows.mgr is not mgr:
            return allocate_decodes(rows, starts)
        req_ids = rows.req_ids
        due = {i for i, rid in enumerate(req_ids)
               if rid not in refused and mgr.request(rid).num_computed_tokens >= 20}
        refused.update(req_ids[i] for i in due)
        keep = [i for i in range(len(req_ids)) if i not in due]
        got = allocate_decodes(mgr.decode_rows([mgr.request(req_ids[i]) for i in keep]),
                               np.asarray([starts[i] for i in keep], dtype=np.int64))
        slots, ckpts, ready = np.full(len(req_ids), -1), np.zeros(len(req_ids), bool), np.zeros(len(req_ids), bool)
        slots[keep], ckpts[keep], ready[keep] = got
        return slots, ckpts, ready

    monkeypatch.setattr(mgr, "allocate", refuse_once)
    monkeypatch.setattr(DecodeRows, "allocate", decodes_refusing_once)
    prompts = _prompts(80)
    ids = [llm.add_request(p, greedy(12)) for p in prompts]
    _assert_hf(hf, prompts, _run(llm, ids))
    stats = llm.stats()
    assert stats["preemptions"][mode] >= 2 and stats["kv_blocks_total"] == 0
    if mode == "swap":
        assert stats["swaps"] == stats["preemptions"]["swap"]
    else:  # at least one victim resumed from the state it donated, not from token 0
        assert stats["prefix_hit_tokens"] >= BS
    assert_no_leaks(llm)


@pytest.mark.parametrize("name", PURE)
def test_migration_mid_decode_moves_the_state_alone(name, family_models):
    path, _, hf = family_models(name)
    src = LLM(str(path), memory_budget_bytes=BUDGET, max_num_batched_tokens=32)
    dst = LLM(str(path), memory_budget_bytes=BUDGET, block_size=32)  # another block size
    prompts = _prompts(90)
    ids = [src.add_request(p, greedy(12)) for p in prompts]
    for _ in range(5):  # prefill (the long prompt in two chunks) and a few decodes
        src.step()
    moving = ids[1:3]
    snaps = [snapshot_from_bytes(snapshot_to_bytes(src.export_request(i))) for i in moving]
    for s, i in zip(snaps, moving):
        assert s.num_computed_tokens > s.num_prompt_tokens  # mid-decode
        assert s.kv == {} and set(s.ssm) == set(range(hf.config.num_hidden_layers))
        dst.import_request(s)
    stay = [i for i in ids if i not in moving]
    got = dict(zip(stay, _run(src, stay))) | dict(zip(moving, _run(dst, moving)))
    _assert_hf(hf, prompts, [got[i] for i in ids])
    assert src.stats()["migrations"]["out"] == 2 and dst.stats()["migrations"]["in"] == 2
    assert_no_leaks(src)
    assert_no_leaks(dst)


@pytest.mark.parametrize("chunk", [2048, 29])
def test_a_repeated_prompt_hits_however_its_prefill_was_chunked(chunk, family_models):
    """FAILS on main (checkpoint policy, not this family): under the default policy a fresh prompt
    keeps its prompt-end state "so a repeat of it hits" (hybridkv/checkpoint_policy.py). Prefilled
    in one pass, the repeat of a 53-token prompt resumes at 48; prefilled in chunks [0, 29) and
    [29, 53) it resumes at 0, because `due()` tests `end - start >= start` with the CHUNK's start
    (48 - 29 < 29) instead of where the request resumed (0). A pure-recurrent model then has
    nothing else to hit; hybrids lose the hit the same way."""
    path, _, _ = family_models("mamba")
    llm = LLM(str(path), memory_budget_bytes=BUDGET, max_num_batched_tokens=chunk)
    tokens = prompt(3 * BS + 5, 51)
    llm.generate([tokens], greedy(2), use_tqdm=False)
    assert llm.generate([tokens], greedy(2), use_tqdm=False)[0].num_cached_tokens == 3 * BS
