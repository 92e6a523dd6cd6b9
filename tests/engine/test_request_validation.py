"""Validation at the door: SamplingParams checked where they are made, the engine's limits
(vocabulary, max_num_seqs, pools) checked when a request is added, prompts of every accepted
shape, and request ids in their own namespace. A refused call changes nothing."""
import math

import numpy as np
import pytest
import torch

from hybridkv import LLM, SamplingParams
from hybridkv.errors import RequestTooLargeError
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.sampling_params import MAX_LOGPROBS

from engine_fixtures import assert_no_leaks, greedy, tight_budget


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba")))


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, memory_budget_bytes=16 << 20, max_num_batched_tokens=64, max_num_seqs=4)


def drain(llm, max_steps=500):
    done = {}
    for _ in range(max_steps):
        if not llm.has_unfinished_requests():
            return done
        done.update({o.request_id: o for o in llm.step() if o.finished})
    raise AssertionError(llm.stats())


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(temperature=math.nan), ValueError, "temperature must be finite, got nan"),
    (dict(temperature=math.inf), ValueError, "temperature must be finite, got inf"),
    (dict(temperature="0.5"), TypeError, "temperature must be a number, got '0.5'"),
    (dict(top_p=math.nan), ValueError, "top_p must be finite"),
    (dict(top_k=True), TypeError, "top_k .* must be an integer, got True"),
    (dict(top_k=2.0), TypeError, "top_k .* must be an integer, got 2.0"),
    (dict(seed=1.5), TypeError, "seed must be an integer, got 1.5"),
    (dict(seed=False), TypeError, "seed must be an integer, got False"),
    (dict(max_tokens=8.0), TypeError, "max_tokens must be an integer, got 8.0"),
    (dict(max_tokens=None), TypeError, "max_tokens must be an integer, got None"),
    (dict(n=True), TypeError, "n must be an integer, got True"),
    (dict(n=2.0), TypeError, "n must be an integer, got 2.0"),
    (dict(logprobs=2.5), TypeError, "logprobs must be an integer, got 2.5"),
    (dict(logprobs=MAX_LOGPROBS + 1), ValueError, r"logprobs must be an integer in \[0, 20\], got 21"),
    (dict(logprobs=-1), ValueError, r"logprobs must be an integer in \[0, 20\], got -1"),
    (dict(stop_token_ids="abc"), TypeError, "stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=[1, 2.5]), TypeError, "stop_token_ids entry must be an integer, got 2.5"),
    (dict(stop_token_ids=[-3]), ValueError, "stop_token_ids entry must be an integer >= 0, got -3"),
    (dict(stop=[1]), TypeError, "stop must be a string or a list of strings"),
    (dict(stop=[""]), ValueError, "stop strings must be non-empty"),
    (dict(ignore_eos="yes"), TypeError, "ignore_eos must be True or False"),
])
def test_sampling_params_refuse_junk_naming_the_value(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_what_they_accept():
    p = SamplingParams(n=np.int64(2), seed=np.int32(7), top_k=np.int16(3), temperature=1,
                       stop="x", stop_token_ids=np.array([5, 6]), logprobs=MAX_LOGPROBS)
    assert (p.n, p.seed, p.top_k, p.temperature, p.stop, p.stop_token_ids) == (2, 7, 3, 1.0, ["x"], [5, 6])
    assert type(p.n) is int and type(p.stop_token_ids[0]) is int
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_tiny_temperature_is_greedy_not_garbage(llm):
    p = [5, 6, 7, 8]
    tiny = llm.generate([p], SamplingParams(max_tokens=6, temperature=1e-300, ignore_eos=True), use_tqdm=False)
    assert tiny[0].outputs[0].token_ids == llm.generate([p], greedy(6), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("params, message", [
    (SamplingParams(n=5), "n=5 sequences exceed this engine's max_num_seqs=4"),
    (SamplingParams(stop_token_ids=[128]), r"stop token id 128 is outside the vocabulary \[0, 128\)"),
])
def test_engine_limits_are_refused_at_the_door(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.add_request([5, 6], params)
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6], [7, 8]], [greedy(2), params], use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert_no_leaks(llm)


@pytest.mark.parametrize("prompt", [[5.9, 6.1], [True, 5], [b"5"], ["5", "6"], b"\x05\x06",
                                    np.array([5.0, 6.0]), torch.tensor([True, False]),
                                    np.array([[5, 6]]), {"prompt_token_ids": [5, 6.0]}, 5, None])
def test_prompts_of_the_wrong_type_are_refused(llm, prompt):
    with pytest.raises(TypeError, match="must be|not an integer|must be a list"):
        llm.add_request(prompt, greedy(2))
    with pytest.raises(TypeError):
        llm.generate([[5, 6], prompt], greedy(2), use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert_no_leaks(llm)


def test_numpy_and_torch_prompts_match_lists(llm):
    ids = [11, 12, 13, 14]
    ref = llm.generate([ids], greedy(5), use_tqdm=False)[0].outputs[0].token_ids
    for p in (np.array(ids), np.array(ids, dtype=np.int32), torch.tensor(ids), tuple(ids)):
        assert llm.generate(p, greedy(5), use_tqdm=False)[0].outputs[0].token_ids == ref  # one prompt
        assert [o.outputs[0].token_ids for o in llm.generate([p, ids], greedy(5), use_tqdm=False)] == [ref, ref]
        rid = llm.add_request(p, greedy(5))
        assert drain(llm)[rid].outputs[0].token_ids == ref
    assert_no_leaks(llm)


@pytest.mark.parametrize("priority", ["high", None, 1.5, True])
def test_priorities_are_ints(llm, priority):
    with pytest.raises(TypeError, match="priority must be an integer"):
        llm.add_request([5, 6], greedy(2), priority=priority)
    with pytest.raises(TypeError, match="priority must be"):
        llm.generate([[5, 6]], greedy(2), priority=[priority], use_tqdm=False)
    assert_no_leaks(llm)


@pytest.mark.parametrize("priority", [2**63, -(2**63) - 1, 2**70])
def test_priorities_fit_in_64_bits_as_over_http(llm, priority):
    with pytest.raises(ValueError, match=r"priority \(lower runs first\) must be an integer in"):
        llm.add_request([5, 6], greedy(2), priority=priority)
    assert llm.add_request([5, 6], greedy(2), priority=2**63 - 1) is not None
    drain(llm)
    assert_no_leaks(llm)


def test_max_tokens_is_capped_the_same_way_at_the_door_and_at_admission(ckpt):
    """max_tokens beyond max_model_len runs to max_model_len when the pools hold that much, and is
    refused at once when they never can; it never waits at the head of the queue forever."""
    llm = LLM(ckpt, memory_budget_bytes=16 << 20, max_model_len=48)
    huge = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    big = llm.add_request([5] * 10, huge)
    small = llm.add_request([6] * 10, greedy(4))
    done = drain(llm)
    assert len(done[big].outputs[0].token_ids) == 38 and done[big].outputs[0].finish_reason == "length"
    assert len(done[small].outputs[0].token_ids) == 4
    specs = llm.model.cache_specs()
    tiny = LLM(ckpt, memory_budget_bytes=tight_budget(specs, 16, 2, 3), max_num_seqs=2,
               checkpoint_share=0.0, max_model_len=200)
    with pytest.raises(RequestTooLargeError, match="KV blocks"):
        tiny.add_request([5] * 10, huge)
    assert tiny.generate([[5] * 10], greedy(4), use_tqdm=False)[0].outputs[0].finish_reason == "length"
    assert_no_leaks(tiny)


# ---- ids ------------------------------------------------------------------------------------
def test_a_user_id_like_a_fork_name_is_its_own_request(llm):
    params = SamplingParams(n=2, max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)
    ref_a = [c.token_ids for c in llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs]
    ref_b = llm.generate([[8, 9]], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    llm.add_request([5, 6, 7], params, request_id="a")
    llm.step()  # "a" forks its child now
    llm.add_request([8, 9], greedy(6), request_id="a#1")
    done = drain(llm)
    assert [c.token_ids for c in done["a"].outputs] == ref_a
    assert done["a#1"].outputs[0].token_ids == ref_b
    assert_no_leaks(llm)


def test_ids_are_strings_and_a_duplicate_is_refused(llm):
    with pytest.raises(TypeError, match="request_id must be a string"):
        llm.add_request([5], greedy(2), request_id=("a", 1))
    llm.add_request([5, 6], greedy(3), request_id="dup")
    with pytest.raises(ValueError, match="request id 'dup' is already in use"):
        llm.add_request([7, 8], greedy(3), request_id="dup")
    done = drain(llm)
    assert list(done) == ["dup"] and done["dup"].prompt_token_ids == [5, 6]
    assert_no_leaks(llm)


def test_generate_keeps_its_own_ids_and_returns_others_outputs_later(llm):
    ref = [o.outputs[0].token_ids for o in llm.generate([[5, 6], [7, 8], [9, 10]], greedy(4), use_tqdm=False)]
    llm.add_request([9, 10], greedy(4), request_id="0")  # the id generate's first request would show
    llm.add_request([5, 6], greedy(2), request_id="1")
    outs = llm.generate([[5, 6], [7, 8]], greedy(4), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref[:2]
    assert {o.request_id for o in outs}.isdisjoint({"0", "1"})  # shown ids skip those in use
    later = drain(llm)  # both of the caller's requests finished inside generate(): returned now
    assert later["0"].outputs[0].token_ids == ref[2] and later["1"].outputs[0].token_ids == ref[0][:2]
    llm.abort(outs[0].request_id)  # a caller's abort cannot reach generate's requests (they are done)
    assert_no_leaks(llm)
