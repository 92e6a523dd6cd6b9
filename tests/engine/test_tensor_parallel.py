"""Tensor parallelism over torch.distributed (gloo, 2 processes): a TP=2 engine's greedy tokens equal
a TP=1 engine's through chunked prefill, preemption (recompute and swap), a prefix hit and migration
in both directions; a killed rank fails the LLM with a clear error within the step timeout."""
import os
import random
import signal
import threading
import time

import pytest
import torch

from hybridkv import LLM
from hybridkv.models import load_model
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.parallel import RankFailedError
from hybridkv.parallel.shard_layout import ShardLayout
from hybridkv.parallel.sharding import shard_model

from engine_fixtures import assert_no_leaks, greedy, tight_budget
from family_checks import mamba2_scans_that_matter

pytestmark = pytest.mark.slow  # tensor-parallel workers are processes

FAMILIES = ["llama", "bamba", "qwen3_next", "mamba2"]
OVERRIDES = {"llama": {"num_key_value_heads": 1}}  # fewer KV heads than ranks: replicated on both
RNG = random.Random(1)
PROMPTS = [[RNG.randrange(4, 128) for _ in range(n)] for n in (7, 20, 35, 41)]
SWAP_PROMPTS = [[RNG.randrange(4, 128) for _ in range(n)] for n in (9, 22, 33, 44)]  # no hit on PROMPTS
SHARED = [RNG.randrange(4, 128) for _ in range(40)]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Engines by (family, tp), built once per module and closed at its end."""
    engines = {}
    yield engines
    for llm in engines.values():
        llm.close()


def _engine(made, tmp_path_factory, family: str, tp: int) -> LLM:
    if (family, tp) not in made:
        path = tmp_path_factory.getbasetemp() / f"tp-{family}"
        if not (path / "config.json").exists():
            make_tiny_checkpoint(family, path, **OVERRIDES.get(family, {}))
            if family in ("bamba", "mamba2"):  # a wrong SSM state shard changes the greedy tokens
                mamba2_scans_that_matter(path, seed=0)
        model = load_model(str(path))
        if tp > 1:
            shard_model(model, 0, tp, lambda t: t)  # rank 0's shard: the specs each rank's pools hold
        # the same blocks and slots on every rank as on one device
        budget = tight_budget(model.cache_specs(), 16, 7, 4)
        made[(family, tp)] = LLM(str(path), memory_budget_bytes=budget, max_num_batched_tokens=16,
                                 max_num_seqs=4, preemption_mode="recompute", tensor_parallel_size=tp)
    return made[(family, tp)]


def _finish(llm, rid):
    out = None
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished and o.request_id == rid:
                out = o.outputs[0].token_ids
    return out


def _scenario(llm, other) -> dict:
    """Everything a TP=2 engine must do as a TP=1 engine does; `other` is the far side of migrations."""
    got = {}
    llm.engine.scheduler.policy.mode = "recompute"
    got["recompute"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(14), use_tqdm=False)]
    llm.engine.scheduler.policy.mode = "swap"  # one engine per family: the policy's mode is switched
    got["swap"] = [o.outputs[0].token_ids for o in llm.generate(SWAP_PROMPTS, greedy(14), use_tqdm=False)]
    llm.generate([SHARED + [5, 6, 7]], greedy(3), use_tqdm=False)
    got["prefix"] = llm.generate([SHARED + [9, 10]], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    s = llm.stats()
    got["stats"] = (s["kv_blocks_total"], s["state_slots_total"], s["preemptions"], s["swaps"],
                    s["prefix_hit_tokens"])
    # migration out: mid-decode from this engine to `other`, and back in from `other`
    llm.add_request(PROMPTS[2], greedy(12), request_id="out")
    other.add_request(PROMPTS[3], greedy(12), request_id="in")
    for _ in range(5):
        llm.step()
        other.step()
    other.import_request(llm.export_request("out"))
    llm.import_request(other.export_request("in"))
    got["migrated_out"], got["migrated_in"] = _finish(other, "out"), _finish(llm, "in")
    assert_no_leaks(llm)
    return got


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_greedy_equals_tp1(made, tmp_path_factory, family):
    one = _engine(made, tmp_path_factory, family, 1)
    ref_side = LLM(one.model_path, memory_budget_bytes=16 << 20, max_num_batched_tokens=16)
    want = _scenario(one, ref_side)
    two = _engine(made, tmp_path_factory, family, 2)
    got = _scenario(two, ref_side)
    assert got == want
    blocks, slots, preemptions, swaps, hits = got["stats"]
    assert hits > 0 and (blocks == 0 or preemptions["recompute"] > 0 and swaps > 0), got["stats"]
    comm = two.tensor_parallel.communication_bytes()
    assert comm["all_reduce"] > 0 and comm["broadcast"] > 0 and comm["gather"] > 0  # swaps gathered shards


DECODE_PROMPTS = [[RNG.randrange(4, 128) for _ in range(n)] for n in (5, 9, 12, 7, 11, 6)]  # 6 > 4 seats


def _preempting_run(llm, mode: str) -> tuple[list, int, int, int]:
    """6 short prompts, 24 tokens each, on 4 seats and a few KV blocks: KV grows while decoding, so
    running requests are preempted mid-decode. Returns (tokens, preemptions in `mode`, swaps, the
    preempted requests seen holding generated tokens), counted over this run only."""
    llm.engine.scheduler.policy.mode = mode
    before = llm.stats()
    ids = [llm.add_request(p, greedy(24)) for p in DECODE_PROMPTS]
    tokens, mid_decode = {}, 0
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                tokens[o.request_id] = o.outputs[0].token_ids
        sched = llm.engine.scheduler
        mid_decode += sum(len(s.token_ids) > s.num_prompt_tokens for q in (sched.swapped, sched.waiting) for s in q)
    after = llm.stats()
    assert_no_leaks(llm)
    return ([tokens[i] for i in ids], after["preemptions"][mode] - before["preemptions"][mode],
            after["swaps"] - before["swaps"], mid_decode)


def test_tp2_bamba_preempted_mid_decode_equals_tp1(made, tmp_path_factory):
    """Recompute and swap of a Bamba request mid-decode: a swap gathers and scatters every rank's KV
    and Mamba state shards, a recompute rebuilds them; tokens as on one device."""
    one, two = _engine(made, tmp_path_factory, "bamba", 1), _engine(made, tmp_path_factory, "bamba", 2)
    for mode in ("recompute", "swap"):
        want, got = _preempting_run(one, mode), _preempting_run(two, mode)
        assert got[0] == want[0], mode
        preempted, swaps, mid_decode = got[1:]
        assert preempted > 0 and mid_decode > 0, (mode, got[1:])
        assert (swaps > 0) == (mode == "swap"), (mode, got[1:])


# families whose mixers joined later: chunked prefill + decode only, one family per new kind of
# rank state or cut (Mamba1 in Jamba, LFM2's conv-only state, Nemotron-H's MLP / MoE, Falcon-H1's
# two caches per layer, Zamba2's shared block with one KV cache per use site); each spawn costs
# seconds, so Mamba, FalconMamba, LFM2, GraniteMoeHybrid and Qwen3.5 are checked, with every other
# family, in-process by tests/parallel/test_sharding.py (2 ranks as 2 threads, each loading its
# shard as a worker does)
MORE_FAMILIES = ["jamba", "lfm2_moe", "nemotron_h", "falcon_h1", "zamba2"]


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_tp2_greedy_equals_tp1_more_families(tmp_path, family):
    path = str(make_tiny_checkpoint(family, tmp_path / family))
    got = {}
    for tp in (1, 2):
        llm = LLM(path, memory_budget_bytes=16 << 20, max_num_batched_tokens=16, tensor_parallel_size=tp)
        try:
            got[tp] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], greedy(8), use_tqdm=False)]
        finally:
            llm.close()
    assert got[2] == got[1]


def test_killed_rank_fails_with_a_clear_error(made, tmp_path_factory):
    llm = _engine(made, tmp_path_factory, "llama", 2)
    worker = llm.tensor_parallel.procs[0]
    killer = threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL))  # mid-run: in a step or between
    t0 = time.monotonic()
    killer.start()
    try:
        with pytest.raises(RankFailedError, match=r"tensor-parallel .*rank"):
            for _ in range(100):  # runs until the kill lands (a round takes well over 10 ms)
                llm.generate(PROMPTS, greedy(60), use_tqdm=False)
    finally:
        killer.cancel()
    assert time.monotonic() - t0 < 60
    with pytest.raises(RankFailedError):  # and it stays failed, no hang
        llm.generate([PROMPTS[0]], greedy(2), use_tqdm=False)
    assert not llm.has_unfinished_requests()  # generate aborted what it queued


def test_bad_tensor_parallel_size_is_refused_before_anything_starts(tmp_path):
    path = str(make_tiny_checkpoint("llama", tmp_path / "llama"))
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            LLM(path, tensor_parallel_size=bad)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 cannot be split over tensor_parallel_size=3"):
        LLM(path, tensor_parallel_size=3)
    zamba = str(make_tiny_checkpoint("zamba", tmp_path / "zamba"))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 is not supported for ZambaForCausalLM"):
        LLM(zamba, tensor_parallel_size=2)


def test_shard_layout_takes_and_merges_split_and_replicated_segments():
    g = torch.Generator().manual_seed(0)
    layout = ShardLayout.of((4, 2, 3), (1, 1, 5), (2, 2))  # heads split, one group replicated, dt split
    full = torch.randn(6, layout.full, generator=g)
    shards = [layout.take(full, r, 2, 1) for r in range(2)]
    assert [s.shape[1] for s in shards] == [6 + 5 + 1] * 2
    assert torch.equal(shards[0][:, 6:11], full[:, 12:17]) and torch.equal(shards[1][:, 6:11], full[:, 12:17])
    assert torch.equal(layout.merge(shards, 1), full)
    kv = ShardLayout.of((1, 1))  # one KV head over 4 ranks: every rank holds it
    assert torch.equal(kv.merge([kv.take(full[:, :1], r, 4, 1) for r in range(4)], 1), full[:, :1])
