"""Speculation with the target's MTP head (hybridkv/speculative/mtp.py) keeps the output of the
engine without speculation through what the engine does around it: prefix hits (the head's KV
comes with the target's blocks), a migration into another block size, preemption in both modes,
seeded sampling with n > 1 and a stop string. The oracle is the same checkpoint's engine with
speculation off; most proposals are steered to the true token (engine_fixtures.steer_mtp_drafts)
so runs are accepted, the rest are the random head's own."""
import random

import pytest

from engine_fixtures import assert_no_leaks, greedy, plain_truth, steer_mtp_drafts, tight_budget
from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import add_tiny_mtp_weights, make_tiny_checkpoint
from hybridkv.speculative.mtp import MtpDrafter

MTP = {"method": "mtp", "off_when_slower": False}


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return add_tiny_mtp_weights(make_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("qwen3_next_mtp")))


def tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def test_the_drafter_proposes_only_for_the_next_token():
    d = MtpDrafter()
    d.record({"a": (5, [42, 43, 44]), "b": (3, [7])})
    assert d.propose_many([("a", [0] * 5, 2), ("b", [0] * 4, 1), ("c", [0], 1), ("a", [0] * 5, 0)]) == [
        [42, 43], [], [], []]
    assert d.propose("a", [0] * 5, 4) == [42, 43, 44]
    d.forget("a")
    assert d.propose("a", [0] * 5, 1) == []


def test_prefix_hits_and_a_migration_keep_the_plain_tokens(qwen3_next):
    rng = random.Random(2)
    shared = [rng.randrange(4, 128) for _ in range(40)]
    prompts = [shared + [rng.randrange(4, 128) for _ in range(n)] for n in (3, 9, 14)]
    params = greedy(24)
    plain, truth = plain_truth(qwen3_next, prompts, params)
    llm = LLM(str(qwen3_next), memory_budget_bytes=32 << 20, speculative_config=MTP)
    steer_mtp_drafts(llm, truth, 0.7)
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one by one: each later one hits
    assert tokens(outs) == tokens(plain)
    s = llm.stats()
    assert s["prefix_hit_tokens"] >= 2 * 32 and s["spec_accepted_tokens"] > 0, s
    # a migration mid-answer into an engine of block size 8 that drafts with the head too
    src = LLM(str(qwen3_next), memory_budget_bytes=32 << 20, speculative_config=MTP)
    steer_mtp_drafts(src, truth, 0.7)
    rid = src.add_request(prompts[1], params)
    for _ in range(6):
        src.step()
    snap = src.export_request(rid)
    dst = LLM(str(qwen3_next), memory_budget_bytes=32 << 20, block_size=8, speculative_config=MTP)
    steer_mtp_drafts(dst, truth, 0.7)
    dst.import_request(snap)
    out = None
    while dst.has_unfinished_requests():
        out = next((o for o in dst.step() if o.finished), out)
    assert list(out.outputs[0].token_ids) == list(plain[1].outputs[0].token_ids)
    assert src.stats()["spec_verify_runs"] > 0 and dst.stats()["spec_verify_runs"] > 0
    for engine in (llm, src, dst):
        assert_no_leaks(engine)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_both_modes_keeps_the_plain_tokens(qwen3_next, mode, k):
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 128) for _ in range(n)] for n in (5, 19, 30, 11, 24)]
    params = greedy(32)
    plain, truth = plain_truth(qwen3_next, prompts, params)
    specs = LLM(str(qwen3_next), memory_budget_bytes=16 << 20, speculative_config=MTP).model.cache_specs()
    llm = LLM(str(qwen3_next), speculative_config={**MTP, "num_speculative_tokens": k}, preemption_mode=mode,
              max_num_seqs=3, max_num_batched_tokens=24, checkpoint_share=0.0,
              memory_budget_bytes=tight_budget(specs, 16, blocks=7, slots=1 + 3 + (k + 1) * 3))
    steer_mtp_drafts(llm, truth, 0.7)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == tokens(plain)
    s = llm.stats()
    assert s["preemptions"][mode] > 0 and s["spec_accepted_tokens"] > 0, (s["preemptions"], s["spec_accepted_tokens"])
    assert_no_leaks(llm)


def test_seeded_sampling_n_forks_and_a_stop_string_keep_the_plain_tokens(qwen3_next):
    rng = random.Random(4)
    prompts = [[rng.randrange(4, 128) for _ in range(n)] for n in (9, 26)]
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, top_k=20, n=2, seed=3, ignore_eos=True)]
    plain, truth = plain_truth(qwen3_next, prompts, params)
    llm = LLM(str(qwen3_next), memory_budget_bytes=32 << 20, speculative_config=MTP)
    steer_mtp_drafts(llm, truth, 0.7)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == tokens(plain)
    assert llm.stats()["spec_accepted_tokens"] > 0
    text = plain[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # two characters from the middle of the plain answer
    stopped = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    want = plain_truth(qwen3_next, prompts[:1], stopped)[0][0].outputs[0]
    got = llm.generate(prompts[:1], stopped, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert_no_leaks(llm)
