"""Bad input at the LLM surface: a refused call raises a clear error and changes nothing (no
request queued, no block or slot held); vLLM-style prompt dicts are accepted."""
import itertools

import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import make_tiny_checkpoint

from engine_fixtures import assert_no_leaks, greedy


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"))
    return LLM(str(path), memory_budget_bytes=16 << 20, max_num_batched_tokens=64)


def assert_untouched(llm: LLM) -> None:
    """Nothing queued or running, no block or live slot held, and the next call runs alone."""
    assert not llm.has_unfinished_requests()
    assert_no_leaks(llm)
    outs = llm.generate([[5, 6, 7]], greedy(2), use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 2
    assert_no_leaks(llm)


def test_priority_of_another_length_is_refused(llm):
    with pytest.raises(ValueError, match="priority has 1 values for 3 prompts"):
        llm.generate([[5, 6], [7, 8], [9, 10]], greedy(4), priority=[1], use_tqdm=False)
    assert_untouched(llm)
    with pytest.raises(ValueError, match="priority has 3 values for 2 prompts"):
        llm.generate([[5, 6], [7, 8]], greedy(4), priority=[0, 1, 2], use_tqdm=False)
    assert_untouched(llm)


def test_priority_that_is_not_an_integer_is_refused(llm):
    with pytest.raises(TypeError, match="priority must be an integer"):
        llm.generate([[5, 6], [7, 8]], greedy(4), priority=[0, "high"], use_tqdm=False)
    assert_untouched(llm)
    with pytest.raises(TypeError, match="priority must be an integer"):
        llm.add_request([5, 6], greedy(4), priority=0.5)
    assert_untouched(llm)


def test_a_bad_prompt_late_in_the_batch_queues_none_of_it(llm):
    with pytest.raises(ValueError, match="token id 999 is outside the vocabulary"):
        llm.generate([[5, 6], [7, 8], [9, 999]], greedy(4), use_tqdm=False)
    assert_untouched(llm)


def test_vllm_prompt_dicts_match_plain_prompts(llm):
    ids = [11, 12, 13, 14, 15]
    plain = llm.generate([ids, "hello there"], greedy(6), use_tqdm=False)
    dicts = llm.generate([{"prompt_token_ids": ids}, {"prompt": "hello there"}], greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt_token_ids == ids and dicts[0].prompt is None
    assert dicts[1].prompt == "hello there" and dicts[1].prompt_token_ids == plain[1].prompt_token_ids
    single = llm.generate({"prompt_token_ids": ids}, greedy(6), use_tqdm=False)  # one dict, not a list
    assert len(single) == 1 and single[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    rid = llm.add_request({"prompt_token_ids": ids}, greedy(6))
    served = {}
    while llm.has_unfinished_requests():
        served.update({o.request_id: o for o in llm.step() if o.finished})
    assert served[rid].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert_no_leaks(llm)


def test_prompt_dict_cache_salt_separates_tenants(llm):
    shared = list(range(20, 60))  # two full blocks and more
    llm.generate([{"prompt_token_ids": shared, "cache_salt": "a"}], greedy(2), use_tqdm=False)
    other = llm.generate([{"prompt_token_ids": shared + [7], "cache_salt": "b"}], greedy(2), use_tqdm=False)
    same = llm.generate([{"prompt_token_ids": shared + [8], "cache_salt": "a"}], greedy(2), use_tqdm=False)
    assert other[0].num_cached_tokens == 0 and same[0].num_cached_tokens > 0


@pytest.mark.parametrize("prompt, error, message", [
    ({}, ValueError, "has neither 'prompt' \\(text\\) nor 'prompt_token_ids'"),
    ({"cache_salt": "x"}, ValueError, "has neither 'prompt'"),
    ({"prompt_ids": [5, 6]}, ValueError, r"unknown key\(s\) \['prompt_ids'\]; accepted keys: "
                                          r"\['prompt', 'prompt_token_ids', 'cache_salt'\]"),
    ({"prompt_token_ids": [5, 6], "temperature": 0}, ValueError, r"unknown key\(s\) \['temperature'\]"),
    ({"prompt": "hi", "multi_modal_data": {"image": None}}, ValueError, "multi-modal input is not supported"),
    ({"prompt_token_ids": "5 6 7"}, TypeError, "'prompt_token_ids' must be a list of token ids"),
    ({"prompt_token_ids": [5, 6.5]}, TypeError, "'prompt_token_ids' must be text, a list of integer token ids"),
    ({"prompt": 42}, TypeError, "'prompt' must be a string, got int"),
    ([5, None], TypeError, "a prompt must be text, a list of integer token ids"),
])
def test_malformed_prompts_are_refused(llm, prompt, error, message):
    with pytest.raises(error, match=message):
        llm.generate([[5, 6, 7], prompt], greedy(3), use_tqdm=False)
    assert_untouched(llm)
    with pytest.raises(error, match=message):
        llm.add_request(prompt, greedy(3))
    assert_untouched(llm)


def test_unknown_llm_keyword_names_llm_and_the_keyword(tmp_path):
    with pytest.raises(TypeError) as e:
        LLM(str(tmp_path / "never-loaded"), max_num_seq=4)  # refused before the model is read
    msg = str(e.value)
    assert msg.startswith("LLM() got unexpected keyword argument(s) ['max_num_seq']")
    assert "max_num_seqs" in msg and "checkpoint_policy" in msg and "EngineConfig" not in msg


def test_a_call_that_fails_midway_leaves_nothing_queued(llm, monkeypatch):
    calls = {"n": 0}
    real_step = llm.engine.step

    def failing_step(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault in the model")
        return real_step(*a, **k)

    aborted = llm.stats()["aborted"]
    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate([[5] * 40, [6] * 30], greedy(8), use_tqdm=False)
    monkeypatch.undo()
    assert llm.stats()["aborted"] == aborted + 2  # both were mid-way, holding blocks and slots
    assert_untouched(llm)


def test_duplicate_request_id_is_refused_without_harm(llm, monkeypatch):
    # the next automatic id collides with a caller's id
    monkeypatch.setattr(llm, "_ids_counter", itertools.chain(["x", "y"], itertools.count(1000)))
    assert llm.add_request([5, 6, 7], greedy(3), request_id="x") == "x"
    with pytest.raises(ValueError, match="request id 'x' is already in use"):
        llm.add_request([8, 9], greedy(3), request_id="x")
    outs = llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)
    assert outs[0].request_id == "y" and len(outs[0].outputs[0].token_ids) == 2
    while llm.has_unfinished_requests():  # "x" runs to its end too
        llm.step()
    assert_no_leaks(llm)


def test_sampling_params_list_of_another_length_is_refused(llm):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate([[5], [6], [7]], [greedy(2), greedy(2)], use_tqdm=False)
    assert_untouched(llm)
    with pytest.raises(TypeError, match="sampling params must be a SamplingParams"):
        llm.generate([[5], [6]], [greedy(2), {"max_tokens": 2}], use_tqdm=False)
    assert_untouched(llm)
    assert SamplingParams().max_tokens == 16


@pytest.mark.parametrize("block_size", [0, -16, 1.5, True])
def test_block_size_must_be_a_positive_int(block_size):
    from hybridkv.scheduler.config import EngineConfig
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=block_size)
