"""Request-level behaviour: bad input, abort, n > 1, seeds, stops, prefix hits and salts."""
import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.errors import RequestTooLargeError
from hybridkv.models.tiny import make_tiny_checkpoint

from engine_fixtures import assert_no_leaks, greedy, ragged_prompts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba")))


@pytest.fixture()
def llm(ckpt):
    return LLM(ckpt, memory_budget_bytes=16 << 20, max_num_batched_tokens=64)


def run(llm, ids):
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                outs[o.request_id] = o
    return [outs[i] for i in ids]


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(n=0), "n must be an integer >= 1, got 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
])
def test_bad_sampling_params_name_the_value(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_bad_requests_are_refused_alone(llm):
    prompts = ragged_prompts(4, 128, seed=3)
    good = [llm.add_request(p, greedy(8)) for p in prompts[:2]]
    llm.step()  # the good ones are running when the bad ones arrive
    with pytest.raises(ValueError, match="prompt has 600 tokens; this model's max_model_len is 512"):
        llm.add_request([5] * 600, greedy())
    with pytest.raises(ValueError, match=r"token id 128 is outside the vocabulary \[0, 128\)"):
        llm.add_request([5, 128, 6], greedy())
    with pytest.raises(ValueError, match=r"token id -1 is outside"):
        llm.add_request([-1], greedy())
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.add_request([], greedy())
    more = [llm.add_request(p, greedy(8)) for p in prompts[2:]]
    outs = run(llm, good + more)
    ref = LLM(llm.model_path, memory_budget_bytes=16 << 20).generate(prompts, greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert_no_leaks(llm)


def test_request_that_can_never_fit_is_refused(ckpt):
    from engine_fixtures import tight_budget
    probe = LLM(ckpt, memory_budget_bytes=8 << 20)
    small = LLM(ckpt, memory_budget_bytes=tight_budget(probe.model.cache_specs(), 16, 4, 3),
                max_num_seqs=2, checkpoint_share=0.0)
    with pytest.raises(RequestTooLargeError, match="KV blocks"):
        small.add_request([5] * 100, greedy(40))
    assert small.generate([[5, 6, 7]], greedy(4), use_tqdm=False)[0].outputs[0].token_ids


def test_abort_frees_memory_at_once(llm):
    a = llm.add_request([7] * 40, greedy(30))
    b = llm.add_request([9] * 20, greedy(5))
    for _ in range(3):
        llm.step()
    used = llm.stats()["kv_blocks_used"]
    llm.abort(a)
    assert llm.stats()["kv_blocks_used"] < used
    assert llm.stats()["state_slots_live"] == 1
    run(llm, [b])
    assert_no_leaks(llm)


def test_n_samples_fork_and_seeds_reproduce(llm, ckpt):
    p = SamplingParams(n=3, temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    out = llm.generate([[11] * 33], p, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and llm.stats()["forks"] == 2
    seqs = [o.token_ids for o in out.outputs]
    assert len({tuple(s) for s in seqs}) > 1  # three different samples
    other = LLM(ckpt, memory_budget_bytes=16 << 20, max_num_batched_tokens=16)
    again = other.generate([[3] * 5, [11] * 33], [greedy(3), p], use_tqdm=False)[1]
    assert [o.token_ids for o in again.outputs] == seqs  # same seed, other batch and chunking
    assert_no_leaks(llm)


def test_greedy_n_forks_agree_with_single(llm):
    outs = llm.generate([[4, 5, 6] * 7], SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0]
    single = llm.generate([[4, 5, 6] * 7], greedy(6), use_tqdm=False)[0]
    assert outs.outputs[0].token_ids == outs.outputs[1].token_ids == single.outputs[0].token_ids


def test_stop_ids_stop_strings_and_logprobs(llm):
    base = llm.generate(["hello there"], greedy(12), use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    s = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
                     use_tqdm=False)[0].outputs[0]
    assert s.token_ids == base.token_ids[:first + 1] and s.finish_reason == "stop"
    stop_text = base.text[3:5]
    t = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=12, stop=[stop_text]),
                     use_tqdm=False)[0].outputs[0]
    assert t.finish_reason == "stop" and stop_text not in t.text and base.text.startswith(t.text)
    lp = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)[0]
    for tok, d in zip(lp.outputs[0].token_ids, lp.outputs[0].logprobs):
        assert tok in d and max(v.logprob for v in d.values()) == d[tok].logprob <= 0.0 and d[tok].rank == 1
    assert base.finish_reason == "length"


def test_hybrid_prefix_hit_at_block_granularity_and_salts(llm):
    shared = list(range(10, 50))  # 40 tokens
    a = llm.generate([shared + [60, 61, 62]], greedy(4), use_tqdm=False)[0]
    before = llm.stats()["prefix_hit_tokens"]
    b = llm.generate([shared + [60, 61, 62]], greedy(4), use_tqdm=False)[0]
    assert b.num_cached_tokens == 32  # prompt_end checkpoint: last block boundary inside 43 tokens
    assert llm.stats()["prefix_hit_tokens"] - before == 32
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    # Another tenant never hits, and its misses are reported as no KV match.
    misses = llm.stats()["prefix_misses"]["no_kv_match"]
    c = llm.generate([shared + [60, 61, 62]], greedy(4), use_tqdm=False, cache_salt="tenant-b")[0]
    assert c.num_cached_tokens == 0 and c.outputs[0].token_ids == a.outputs[0].token_ids
    assert llm.stats()["prefix_misses"]["no_kv_match"] == misses + 1
    assert_no_leaks(llm)


def test_miss_reason_kv_without_checkpoint_and_branch_points(ckpt):
    p1 = list(range(10, 60))  # 50 tokens: prompt_end checkpoint at 48, KV blocks up to 48 cached
    p2 = p1[:40] + [90] * 10  # shares blocks [0, 32) with p1, but no state exists at 32
    p3 = p1[:40] + [91] * 10
    for policy, hit3 in (("prompt_end", 0), ("branch_points", 32)):
        llm = LLM(ckpt, memory_budget_bytes=16 << 20, checkpoint_policy=policy)
        llm.generate([p1], greedy(2), use_tqdm=False)
        out2 = llm.generate([p2], greedy(2), use_tqdm=False)[0]
        assert out2.num_cached_tokens == 0
        assert llm.stats()["prefix_misses"]["kv_match_no_checkpoint"] == 1
        # branch_points cut p2's prefill at the junction (32) and kept the state there.
        out3 = llm.generate([p3], greedy(2), use_tqdm=False)[0]
        assert out3.num_cached_tokens == hit3, policy
        assert_no_leaks(llm)


def test_priority_runs_first_when_seats_are_scarce(ckpt):
    llm = LLM(ckpt, memory_budget_bytes=16 << 20, max_num_seqs=1)
    first = llm.add_request([5] * 10, greedy(3), priority=5)
    llm.step()  # `first` holds the only seat
    low = llm.add_request([6] * 10, greedy(3), priority=9)
    high = llm.add_request([7] * 10, greedy(3), priority=0)
    order = []
    while llm.has_unfinished_requests():
        order += [o.request_id for o in llm.step() if o.finished]
    assert order == [first, high, low]
    assert_no_leaks(llm)


def test_length_stop_at_max_model_len_and_duplicate_ids(ckpt):
    llm = LLM(ckpt, memory_budget_bytes=16 << 20, max_model_len=40)
    out = llm.generate([[5] * 35], greedy(20), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"  # 35 + 5 = max_model_len
    llm.add_request([5, 6], greedy(2), request_id="x")
    with pytest.raises(ValueError, match="request id 'x' is already in use"):
        llm.add_request([5, 6], greedy(2), request_id="x")
    llm.abort("x")
    assert_no_leaks(llm)


def test_malformed_checkpoint_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        LLM(str(tmp_path / "nope"))


def test_next_chat_turn_resumes_past_the_previous_answer(ckpt, tmp_path):
    from engine_fixtures import hf_model
    from model_harness import assert_greedy_matches_hf

    turn1 = list(range(10, 50))  # 40 tokens; the answer runs to 40 + 30 = 70 tokens
    llm = LLM(ckpt, memory_budget_bytes=16 << 20)
    answer = llm.generate([turn1], greedy(30), use_tqdm=False)[0].outputs[0].token_ids
    turn2 = turn1 + answer + [60, 61, 62, 63, 64]
    out = llm.generate([turn2], greedy(6), use_tqdm=False)[0]
    # the state after 64 tokens (a boundary inside turn 1's answer) was kept while it decoded
    assert out.num_cached_tokens == 64
    assert llm.stats()["state_slots_checkpoint"] <= 3  # rolling checkpoints replace each other
    assert_greedy_matches_hf(hf_model(ckpt), turn2, out.outputs[0].token_ids)
    assert_no_leaks(llm)


def test_generation_config_defaults_apply_when_no_params_are_given(tmp_path):
    import json

    path = make_tiny_checkpoint("llama", tmp_path / "gen")
    cfg = json.loads((path / "generation_config.json").read_text())
    cfg.update(temperature=0.0, max_new_tokens=5, min_p=0.1, repetition_penalty=1.3)
    (path / "generation_config.json").write_text(json.dumps(cfg))
    llm = LLM(str(path), memory_budget_bytes=8 << 20)
    d = llm.get_default_sampling_params()
    assert d.temperature == 0.0 and d.max_tokens == 5 and d.min_p == 0.1 and d.repetition_penalty == 1.3
    out = llm.generate([[5, 6, 7, 8]], use_tqdm=False)[0].outputs[0]
    greedy5 = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                          repetition_penalty=1.3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5 and out.token_ids == greedy5.token_ids[: len(out.token_ids)]
    explicit = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(explicit[0].outputs[0].token_ids) <= 3  # explicit params are used as given
