"""Sampling breadth through the engine, against transformers on the same tiny checkpoint:
prompt logprobs across chunked prefill and a warm prefix cache, greedy decoding under penalties
and logit_bias (teacher-forced: transformers' processors on transformers' logits pick every
token), min_tokens, stop_reason, logprob ranks, and seeded penalized requests whatever the batch."""
import pytest
import torch
from transformers.generation import logits_process as hf

from hybridkv import LLM, SamplingParams

from engine_fixtures import assert_no_leaks, hf_model, ragged_prompts, tight_budget
from model_harness import hf_logits
from hybridkv.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    path = make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"))
    return str(path), hf_model(path)


@pytest.fixture(scope="module")
def llm(bamba):
    return LLM(bamba[0], memory_budget_bytes=16 << 20, max_num_batched_tokens=16)


def test_prompt_logprobs_match_transformers_across_chunks_and_a_warm_cache(llm, bamba):
    prompt = ragged_prompts(6, 128, seed=11)[4]  # 3 blocks + 5 tokens: 4 chunks of 16
    other = ragged_prompts(6, 128, seed=12)[5]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm the cache
    outs = llm.generate([other, prompt], [SamplingParams(temperature=0, max_tokens=2),
                                          SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)],
                        use_tqdm=False)
    assert outs[0].prompt_logprobs is None
    got = outs[1].prompt_logprobs
    assert outs[1].num_cached_tokens == 0 and len(got) == len(prompt) and got[0] is None
    ref = torch.log_softmax(hf_logits(bamba[1], prompt), -1)
    tok = llm.get_tokenizer()
    for p in range(1, len(prompt)):
        row, t = ref[p - 1], prompt[p]
        assert got[p][t].logprob == pytest.approx(float(row[t]), abs=1e-4)
        assert got[p][t].rank == int((row > row[t]).sum()) + 1
        assert got[p][t].decoded_token == (tok.decode([t]) or tok.convert_ids_to_tokens(t) or f"token_id:{t}")
        top2 = row.topk(2).indices.tolist()
        assert set(top2) <= set(got[p]) and len(got[p]) <= 3
    assert_no_leaks(llm)


def teacher_forced_check(hf_model, prompt, generated, processors):
    """Every generated token is the argmax of transformers' logits after `processors`."""
    logits = hf_logits(hf_model, prompt + generated)
    for t, tok in enumerate(generated):
        ids = torch.tensor([prompt + generated[:t]])
        row = logits[len(prompt) - 1 + t].unsqueeze(0).clone()
        for proc in processors:
            row = proc(ids, row)
        assert int(row.argmax()) == tok, f"step {t}"


def test_greedy_under_repetition_penalty_and_bias_is_transformers(llm, bamba):
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8,
                       logit_bias={20: 1.5, 21: -3.0})
    out = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert out != plain  # the penalty changed something
    teacher_forced_check(bamba[1], prompt, out, [
        hf.SequenceBiasLogitsProcessor([[[20], 1.5], [[21], -3.0]]), hf.RepetitionPenaltyLogitsProcessor(1.8)])


def test_greedy_under_frequency_and_presence_follows_openai_formula(llm, bamba):
    prompt = [30, 31, 32, 33]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.5,
                       presence_penalty=0.7)
    out = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids

    def openai(ids, row):  # mu[j] - c[j] * frequency - (c[j] > 0) * presence, c over the output
        done = ids[0, len(prompt):].tolist()
        for tok in set(done):
            row[0, tok] -= done.count(tok) * 1.5 + 0.7
        return row
    teacher_forced_check(bamba[1], prompt, out, [openai])
    assert len(set(out)) > 2


def test_min_tokens_and_stop_reason(llm):
    prompt = [40, 41, 42]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    first = base.token_ids[0]
    o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first]),
                     use_tqdm=False)[0].outputs[0]
    assert o.token_ids == [first] and o.finish_reason == "stop" and o.stop_reason == first
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first],
                                                 min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert first not in held.token_ids[:4] and len(held.token_ids) >= 4
    if first in held.token_ids:
        assert held.token_ids[-1] == first and held.stop_reason == first
    else:
        assert held.finish_reason == "length" and held.stop_reason is None
    text = base.text
    stop = text[2:4]
    s = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=["zzzz", stop]),
                     use_tqdm=False)[0].outputs[0]
    assert s.finish_reason == "stop" and s.stop_reason == stop
    assert base.finish_reason == "length" and base.stop_reason is None


def test_logit_bias_steers_and_bad_ids_are_refused(llm):
    out = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                logit_bias={"50": 100}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [50] * 5
    with pytest.raises(ValueError, match=r"logit_bias token id 128 is outside the vocabulary \[0, 128\)"):
        llm.add_request([5, 6], SamplingParams(logit_bias={128: 1.0}))
    assert not llm.has_unfinished_requests()


def test_logprobs_carry_rank_and_decoded_token(llm):
    o = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=3),
                     use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    for t, entry in zip(o.token_ids, o.logprobs):
        assert t in entry and len(entry) in (3, 4)
        ranks = sorted(v.rank for k, v in entry.items() if k != t or v.rank <= 3)
        assert ranks[:3] == [1, 2, 3]
        assert all(v.decoded_token == (tok.decode([k]) or tok.convert_ids_to_tokens(k) or f"token_id:{k}")
                   for k, v in entry.items())


def test_seeded_penalized_request_ignores_its_batch(bamba):
    p = SamplingParams(temperature=0.9, seed=77, max_tokens=10, top_p=0.95, min_p=0.05,
                       repetition_penalty=1.3, presence_penalty=0.4, ignore_eos=True)
    prompt = [11, 12, 13, 14, 15]
    alone = LLM(bamba[0], memory_budget_bytes=16 << 20).generate([prompt], p, use_tqdm=False)[0]
    crowd = LLM(bamba[0], memory_budget_bytes=16 << 20, max_num_batched_tokens=16)
    others = ragged_prompts(5, 128, seed=5)
    outs = crowd.generate(others + [prompt], [SamplingParams(temperature=1.0, max_tokens=8)] * 5 + [p],
                          use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_penalized_seeded_request_migrates_through_bytes_unchanged(bamba):
    from hybridkv.scheduler.snapshot_io import snapshot_from_bytes, snapshot_to_bytes

    p = SamplingParams(temperature=0.8, seed=9, max_tokens=10, ignore_eos=True, logit_bias={40: 2.0},
                       repetition_penalty=1.4, frequency_penalty=0.5, min_tokens=3, logprobs=1)
    prompt = list(range(4, 30))
    want = LLM(bamba[0], memory_budget_bytes=16 << 20).generate([prompt], p, use_tqdm=False)[0].outputs[0]
    src, dst = (LLM(bamba[0], memory_budget_bytes=16 << 20, max_num_batched_tokens=16) for _ in range(2))
    rid = src.add_request(prompt, p)
    for _ in range(4):  # two prefill chunks, then decodes
        src.step()
    dst.import_request(snapshot_from_bytes(snapshot_to_bytes(src.export_request(rid))))
    got = {}
    while dst.has_unfinished_requests():
        got.update({o.request_id: o for o in dst.step() if o.finished})
    out = got[rid].outputs[0]
    assert out.token_ids == want.token_ids
    assert [sorted(d) for d in out.logprobs] == [sorted(d) for d in want.logprobs]
    for d, w in zip(out.logprobs, want.logprobs):
        assert all(d[t].logprob == pytest.approx(w[t].logprob, abs=1e-5) and d[t].rank == w[t].rank for t in w)
    assert all(v.rank >= 1 for d in out.logprobs for v in d.values())


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(presence_penalty=2.5), ValueError, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    (dict(frequency_penalty=float("nan")), ValueError, "frequency_penalty must be finite"),
    (dict(repetition_penalty=0), ValueError, r"repetition_penalty must be > 0 \(1 is off\), got 0.0"),
    (dict(min_p=-0.1), ValueError, r"min_p must be in \[0, 1\], got -0.1"),
    (dict(min_tokens=20, max_tokens=10), ValueError, r"min_tokens must be <= max_tokens \(10\), got 20"),
    (dict(min_tokens=1.0), TypeError, "min_tokens must be an integer, got 1.0"),
    (dict(logit_bias=[1, 2]), TypeError, "logit_bias must be a dict"),
    (dict(logit_bias={-1: 1.0}), ValueError, "logit_bias token id must be an integer >= 0, got -1"),
    (dict(logit_bias={3: 150}), ValueError, r"logit_bias\[3\] must be in \[-100, 100\], got 150.0"),
    (dict(prompt_logprobs=21), ValueError, r"prompt_logprobs must be an integer in \[0, 20\], got 21"),
])
def test_new_sampling_params_refuse_junk_naming_the_value(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def _penalized_params(n):
    return [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=24, ignore_eos=True, top_p=0.9,
                           repetition_penalty=1.2, frequency_penalty=0.3, logit_bias={7: 1.0},
                           prompt_logprobs=1 if i % 3 == 0 else None) for i in range(n)]


@pytest.fixture(scope="module")
def roomy_penalized_run(bamba):
    """(prompts, the roomy engine's outputs, the tight budget) shared by both preemption modes
    (read only; each mode runs its own tight engine on params of its own)."""
    prompts = ragged_prompts(12, 128, seed=21)
    roomy = LLM(bamba[0], memory_budget_bytes=16 << 20).generate(prompts, _penalized_params(len(prompts)),
                                                                  use_tqdm=False)
    probe = LLM(bamba[0], memory_budget_bytes=8 << 20)
    return prompts, roomy, tight_budget(probe.model.cache_specs(), 16, blocks=10, slots=1 + 6 + 2)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_seeded_penalized_draws_and_prompt_logprobs(bamba, mode, roomy_penalized_run):
    prompts, roomy, budget = roomy_penalized_run
    params = _penalized_params(len(prompts))
    tight = LLM(bamba[0], memory_budget_bytes=budget, max_num_seqs=6, preemption_mode=mode,
                max_num_batched_tokens=32, checkpoint_share=0.0)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats()["preemptions"][mode] > 0, tight.stats()["preemptions"]
    for got, want in zip(outs, roomy):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        if want.prompt_logprobs is None:
            assert got.prompt_logprobs is None
            continue
        assert got.prompt_logprobs[0] is None and all(e is not None for e in got.prompt_logprobs[1:])
        for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert g.keys() == w.keys()
            assert all(g[t].logprob == pytest.approx(w[t].logprob, abs=1e-4) for t in w)
    assert_no_leaks(tight)
