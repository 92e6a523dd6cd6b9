"""The batched sampler against transformers' logits processors on the same random logits (each
processor alone, then the whole chain in vLLM's order), presence / frequency against OpenAI's
formula, draws against their distribution, logprob ranks against a sort, and seeded rows
against batch composition."""
import pytest
import torch
from transformers.generation import logits_process as hf

from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler import logits_processors as lp
from hybridkv.scheduler.sampler import SampleRow, Sampler, argmax_rows, gather_logprobs

V = 1000
EOS = [3]


def random_case(rows: int, seed: int = 0, prompt_len: int = 30, out_len: int = 20):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g) * 3
    ids = torch.randint(0, V // 4, (rows, prompt_len + out_len), generator=g)  # repeats likely
    return logits, ids, prompt_len


def rows_for(params: list[SamplingParams], ids: torch.Tensor, prompt_len: int) -> list[SampleRow]:
    return [SampleRow(p, 0, ids.shape[1] - prompt_len, ids[i].tolist(), prompt_len)
            for i, p in enumerate(params)]


def hf_chain(logits, ids, p: SamplingParams, prompt_len: int):
    """transformers' processors for one SamplingParams, in vLLM's order."""
    out = logits.clone()
    if p.logit_bias:
        out = hf.SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()])(ids, out)
    if p.min_tokens:
        out = hf.MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, EOS + p.stop_token_ids)(ids, out)
    if p.repetition_penalty != 1.0:
        out = hf.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, out)
    if not p.greedy:
        out = hf.TemperatureLogitsWarper(p.temperature)(ids, out)
        if p.top_k > 0:
            out = hf.TopKLogitsWarper(p.top_k)(ids, out)
        if p.top_p < 1.0:
            out = hf.TopPLogitsWarper(p.top_p)(ids, out)
        if p.min_p > 0:
            out = hf.MinPLogitsWarper(p.min_p)(ids, out)
    return out


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=17),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.6, repetition_penalty=0.7, top_p=0.95),
    SamplingParams(temperature=1.0, logit_bias={5: 7.5, 900: -100.0, 17: 0.5}),
    SamplingParams(temperature=1.1, min_tokens=40, stop_token_ids=[8, 9], max_tokens=50),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={2: 3.0}),
    SamplingParams(temperature=0.5, top_k=1),
]


def test_each_row_matches_transformers_chain_in_one_batch():
    logits, ids, P = random_case(len(CASES), seed=1)
    sampler = Sampler(eos_ids=EOS)
    got = sampler.process(logits, rows_for(CASES, ids, P))
    for i, p in enumerate(CASES):
        want = hf_chain(logits[i:i + 1], ids[i:i + 1], p, P)[0]
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (i, p)
        keep = torch.isfinite(want)
        torch.testing.assert_close(got[i][keep], want[keep], rtol=1e-5, atol=1e-5, msg=str(p))
    assert not torch.equal(got[0], logits[0])  # something happened, and the input is untouched
    assert torch.equal(logits, random_case(len(CASES), seed=1)[0])


@pytest.mark.parametrize("candidates", [V, 64])  # 64: some nuclei pass the candidates (full-sort rows)
def test_top_k_top_p_match_transformers_over_many_rows_and_values(candidates):
    logits, ids, _ = random_case(64, seed=2)
    logits[::3] *= 0.3  # flatter rows: wider nuclei
    g = torch.Generator().manual_seed(3)
    top_p = torch.rand(64, generator=g) * 0.98 + 0.01
    top_k = torch.where(torch.rand(64, generator=g) < 0.3, torch.randint(1, 200, (64,), generator=g), V)
    got = lp.apply_top_k_top_p(logits, top_k, top_p, candidates=candidates)
    for i in range(64):
        want = logits[i:i + 1].clone()
        if top_k[i] < V:
            want = hf.TopKLogitsWarper(int(top_k[i]))(ids[i:i + 1], want)
        want = hf.TopPLogitsWarper(float(top_p[i]))(ids[i:i + 1], want)[0]
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        assert torch.equal(got[i][torch.isfinite(want)], want[torch.isfinite(want)])


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits, ids, P = random_case(2, seed=4)
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7], max_tokens=10)
    logits[:, 3] = 50.0  # EOS would win
    early = SampleRow(p, 0, 2, ids[0].tolist(), P)
    done = SampleRow(p, 0, 3, ids[1].tolist(), P)
    toks, _ = Sampler(eos_ids=EOS)(logits, [early, done])
    assert toks[0] != 3 and toks[1] == 3
    ignore = SampleRow(SamplingParams(temperature=0, min_tokens=3, ignore_eos=True, max_tokens=10), 0, 0)
    assert Sampler(eos_ids=EOS)(logits[:1], [ignore])[0] == [3]  # ignore_eos: EOS is no stop to hold


def test_presence_and_frequency_follow_openai_formula():
    logits, ids, P = random_case(3, seed=5)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(presence_penalty=-1.2), SamplingParams(frequency_penalty=2.0)]
    got = Sampler().process(logits, rows_for(params, ids, P))
    for i, p in enumerate(params):
        want = logits[i].clone()
        out = ids[i, P:].tolist()
        for tok in set(out):  # mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
            want[tok] -= out.count(tok) * p.frequency_penalty + p.presence_penalty
        torch.testing.assert_close(got[i] * p.temperature, want)  # temperature 1


def test_unseeded_draws_follow_the_processed_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 6) * 1.5
    p = SamplingParams(temperature=0.8, top_k=4)
    rows = [SampleRow(p, 0, 0)] * 4000
    sampler = Sampler(seed=1)
    toks, _ = sampler(logits.expand(4000, 6), rows)
    probs = sampler.process(logits, rows[:1]).softmax(-1)[0]
    freq = torch.bincount(torch.tensor(toks), minlength=6).float() / 4000
    assert (freq[probs == 0] == 0).all()
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


def test_seeded_rows_ignore_batch_composition():
    logits, ids, P = random_case(6, seed=6)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, repetition_penalty=1.2)
    others = [SamplingParams(temperature=0.9), SamplingParams(temperature=0), SamplingParams(temperature=1, top_k=3)]
    rows = rows_for([others[0], seeded, others[1], others[2], seeded, seeded], ids, P)
    rows[4] = SampleRow(seeded, 0, rows[1].num_generated, ids[1].tolist(), P)  # same sequence state as row 1
    logits[4] = logits[1]
    batch, _ = Sampler(seed=3)(logits, rows)
    alone, _ = Sampler(seed=9)(logits[1:2], rows[1:2])
    assert batch[1] == batch[4] == alone[0]
    later = SampleRow(seeded, 0, rows[1].num_generated + 1, ids[1].tolist(), P)
    draws = {Sampler()(logits[1:2], [SampleRow(seeded, 0, s, ids[1].tolist(), P)])[0][0] for s in range(30)}
    assert len(draws) > 1 and Sampler()(logits[1:2], [later]) == Sampler(seed=5)(logits[1:2], [later])


def test_logprobs_ranks_and_top_k_against_a_sort():
    logits, _, _ = random_case(3, seed=7)
    chosen = torch.tensor([int(logits[0].argmax()), 11, 500])
    got = gather_logprobs(logits, chosen, [3, 0, 5])
    ref = torch.log_softmax(logits, -1)
    for i, entry in enumerate(got):
        order = ref[i].argsort(descending=True).tolist()
        c = int(chosen[i])
        assert entry[c].rank == order.index(c) + 1
        assert entry[c].logprob == pytest.approx(float(ref[i, c]), abs=1e-5)
        k = [3, 0, 5][i]
        assert {t for t in entry if t != c} <= set(order[:k]) and set(order[:k]) <= set(entry)
        for t in order[:k]:
            assert entry[t].rank == order.index(t) + 1
            assert entry[t].logprob == pytest.approx(float(ref[i, t]), abs=1e-5)
    assert list(got[1]) == [11]


def test_sampler_logprobs_are_of_the_model_not_the_processed_logits():
    logits, ids, P = random_case(1, seed=8)
    p = SamplingParams(temperature=0, logprobs=2, logit_bias={9: 100.0})
    toks, lps = Sampler()(logits, rows_for([p], ids, P))
    assert toks == [9]
    assert lps[0][9].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[9]), abs=1e-5)
    assert len(lps[0]) == 3 and min(v.rank for v in lps[0].values()) == 1


PLAIN = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, stop_token_ids=[4], max_tokens=9),
         SamplingParams(temperature=0.0, ignore_eos=True, stop=["x"])]
NOT_PLAIN = CASES + [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0, min_tokens=2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_plain_and_greedy_are_what_the_sampler_does_for_plain_rows(dtype):
    logits, ids, P = random_case(6, seed=9)
    logits = logits.to(dtype)
    rows = rows_for([PLAIN[i % 3] for i in range(6)], ids, P)
    assert Sampler.all_greedy(rows)
    tensor, tokens = Sampler.greedy(logits)
    assert tensor.dtype == torch.int64 and tensor.shape == (6,) and tensor.tolist() == tokens
    assert Sampler(eos_ids=EOS)(logits, rows) == (tokens, [None] * 6)
    assert tokens == logits.float().argmax(dim=-1).tolist()  # torch's own argmax, the oracle
    for p in NOT_PLAIN:  # one row that is not plain makes the batch not plain
        mixed = rows_for(PLAIN + [p], ids[:4], P)
        assert not Sampler.all_greedy(mixed), p
        if p.greedy and p.logprobs is not None:
            assert Sampler(eos_ids=EOS)(logits[:4], mixed)[1][3] is not None


def test_argmax_rows_is_torchs_argmax_with_ties_nans_and_strides():
    g = torch.Generator().manual_seed(10)
    x = torch.randn(40, 300, generator=g)
    x[:20] = x[:20].round()  # many ties: the first maximum wins
    x[3, 7] = x[5, 0] = x[5, 299] = float("nan")  # a NaN is the maximum
    x[6] = float("-inf")
    x[8, 100] = x[8, 200] = float("inf")
    for view in (x, x[::3], x[:, 50:], x.t().contiguous().t()):
        got = argmax_rows(view)
        assert got.dtype == torch.int64 and torch.equal(got, view.argmax(dim=-1))
