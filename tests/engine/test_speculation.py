"""Speculative decoding through the engine (scheduler/speculation.py; the draft rows of the model
runner; the manager's drafts.allocate / drafts.commit; the per-position state slots of
models/slot_split.py): the output is token for token the engine's without speculation — with
drafts always right, always wrong and right by chance; for every family in the table; through
preemption in both modes, prefix hits on a checkpoint taken inside an accepted run, migration
mid-run, stops and max_tokens inside a run, logprobs, seeded sampling and n > 1 — and no block or
slot outlives its request (no draft slot outlives its step). Unseeded sampling keeps the plain
engine's distribution (a two-sample chi-square test)."""
import random
import sys

import pytest

from engine_fixtures import assert_no_leaks, greedy, tight_budget
from family_checks import FAMILIES, prompt
from hybridkv import LLM, SamplingParams
from hybridkv.state_pool import DRAFT

SPEC = {"method": "ngram", "num_speculative_tokens": 5, "off_when_slower": False}  # counts independent of timing


class ScriptedDrafter:
    """Proposes the continuation a plain run produced (`runs`: full token lists, prompt first),
    each token replaced by a wrong one with probability `p_wrong`; nothing for a sequence that left
    every run. Stands in for the n-gram drafter so that acceptance is known."""

    def __init__(self, runs, p_wrong: float, seed: int = 0, vocab: int = 128):
        self.runs = [list(r) for r in runs]
        self.p_wrong = p_wrong
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.asked = 0

    def propose(self, request_id, tokens, k):
        self.asked += 1
        n = len(tokens)
        for run in self.runs:
            if len(run) > n and run[:n] == tokens:
                return [t if self.rng.random() >= self.p_wrong else 4 + (t - 3) % (self.vocab - 4)
                        for t in run[n:n + k]]
        return []

    def propose_many(self, asks):
        return [self.propose(*ask) for ask in asks]

    def forget(self, request_id):
        pass


def speculating(path, runs, p_wrong, seed=0, **kw):
    """An LLM on `path` with speculation on, drafting from `runs` (ScriptedDrafter)."""
    llm = LLM(str(path), speculative_config=kw.pop("speculative_config", SPEC), **kw)
    llm.engine.scheduler.speculation.drafter = ScriptedDrafter(runs, p_wrong, seed, llm.model.vocab_size)
    return llm


def no_draft_slot_left(llm) -> bool:
    rec = llm.manager.recurrent
    return rec is None or rec.states.count(DRAFT) == 0


def full_runs(prompts, outs):
    return [p + list(c.token_ids) for p, o in zip(prompts, outs) for c in o.outputs]


def tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    from hybridkv.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"), seed=2)


@pytest.fixture(scope="module")
def family_checkpoint(tmp_path_factory):
    """name -> the tiny checkpoint of FAMILIES[name], made once per module (tests only read it)."""
    made = {}

    def get(name):
        if name not in made:
            fam = FAMILIES[name]
            made[name] = fam.make(fam.name, tmp_path_factory.mktemp(name), seed=fam.seed, **fam.overrides)
        return made[name]

    return get


# ---- every family ---------------------------------------------------------------------------
FAST = {"llama", "bamba", "rwkv", "qwen3_next", "lfm2", "gpt_oss"}  # one of each kind of memory: all 3 cases
# in the fast tier: Mamba2 + attention and GDN + attention (the other FAST rows, 1-3 s each, run all
# three cases in the slow tier; llama's rejected-KV trim is also test_a_pure_attention_model_... below)
FAST_TIER = {"bamba", "qwen3_next"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST_TIER else pytest.mark.slow)
                                  for n in FAMILIES])
def test_every_family_decodes_the_tokens_of_plain_decoding(name, family_checkpoint):
    """Drafts always right, right 60% of the time, always wrong (the slow rows: right 60% of the
    time alone, which both accepts and rejects): the same greedy tokens as the engine without
    speculation, for prompts of 1, 15, 17 and 53 tokens; drafts were verified and (but for the
    always-wrong ones) accepted; nothing leaks."""
    path = family_checkpoint(name)
    prompts = [prompt(n, 40 + n) for n in (1, 15, 17, 53)]
    params = greedy(30)
    plain = LLM(str(path), memory_budget_bytes=16 << 20).generate(prompts, params, use_tqdm=False)
    for p_wrong in (0.0, 0.4, 1.0) if name in FAST else (0.4,):
        llm = speculating(path, full_runs(prompts, plain), p_wrong, memory_budget_bytes=16 << 20)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert tokens(outs) == tokens(plain), p_wrong
        s = llm.stats()
        assert s["spec_verify_runs"] > 0
        assert (s["spec_accepted_tokens"] > 0) == (p_wrong < 1.0)
        assert_no_leaks(llm)
        assert no_draft_slot_left(llm)


def test_speculative_tokens_are_transformers_greedy_tokens(bamba):
    """Tied to the oracle once: the speculative engine's greedy tokens are transformers'."""
    from model_harness import assert_greedy_matches_hf
    from engine_fixtures import hf_model

    prompts = [prompt(n, 7 + n) for n in (5, 33)]
    plain = LLM(str(bamba), memory_budget_bytes=16 << 20).generate(prompts, greedy(24), use_tqdm=False)
    outs = speculating(bamba, full_runs(prompts, plain), 0.3, memory_budget_bytes=16 << 20).generate(
        prompts, greedy(24), use_tqdm=False)
    hf = hf_model(bamba)
    for p, o in zip(prompts, outs):
        assert assert_greedy_matches_hf(hf, p, o.outputs[0].token_ids) == 0


# ---- the memory around a run ----------------------------------------------------------------
@pytest.fixture(scope="module")
def roomy_plain_run(bamba):
    """(prompts, the plain engine's outputs, cache specs) of the preemption cases: one roomy run shared
    by both modes (read only; each mode speculates on an engine of its own)."""
    prompts = [prompt(n, 90 + n) for n in (3, 17, 30, 9, 22)]
    llm = LLM(str(bamba), memory_budget_bytes=16 << 20)
    return prompts, llm.generate(prompts, greedy(40), use_tqdm=False), llm.model.cache_specs()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_both_modes_between_runs(bamba, mode, roomy_plain_run):
    """A budget of 7 blocks, 3 live slots and 3 x 6 draft slots for 5 requests of 40 tokens:
    requests are preempted while others verify drafts, resume, and end with the plain engine's
    tokens."""
    prompts, plain, specs = roomy_plain_run
    params = greedy(40)
    llm = speculating(bamba, full_runs(prompts, plain), 0.3, preemption_mode=mode, max_num_seqs=3,
                      max_num_batched_tokens=24, checkpoint_share=0.0,
                      memory_budget_bytes=tight_budget(specs, 16, blocks=7, slots=1 + 3 + 18))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == tokens(plain)
    s = llm.stats()
    assert s["preemptions"][mode] > 0 and s["spec_accepted_tokens"] > 0
    assert_no_leaks(llm)


def test_a_checkpoint_inside_an_accepted_run_serves_the_next_turn(bamba):
    """A 20-token prompt generating 30 tokens crosses the block boundaries 32 and 48 inside
    accepted runs; the rolling output checkpoint is taken from the draft slot of that position.
    The next turn (prompt + answer + more) hits it: cached tokens at that boundary, and the plain
    engine's tokens."""
    first = prompt(20, 3)
    plain = LLM(str(bamba), memory_budget_bytes=16 << 20)
    a = plain.generate([first], greedy(30), use_tqdm=False)[0]
    turn = first + list(a.outputs[0].token_ids) + prompt(5, 4)
    b = plain.generate([turn], greedy(12), use_tqdm=False)[0]
    llm = speculating(bamba, [first + list(a.outputs[0].token_ids), turn + list(b.outputs[0].token_ids)], 0.0,
                      memory_budget_bytes=16 << 20)
    ga = llm.generate([first], greedy(30), use_tqdm=False)[0]
    assert ga.outputs[0].token_ids == a.outputs[0].token_ids
    assert llm.stats()["spec_accepted_tokens"] >= 20
    gb = llm.generate([turn], greedy(12), use_tqdm=False)[0]
    assert gb.num_cached_tokens == 48  # the state at 48 came from a draft slot
    assert gb.outputs[0].token_ids == b.outputs[0].token_ids
    assert_no_leaks(llm)


def test_a_burst_waits_for_its_leader_while_others_verify_drafts(bamba):
    """A running request verifies drafts while three prompts sharing 40 tokens arrive together:
    the followers wait for the leader's checkpoint at 32 and resume there (the burst rule), and
    every output is the plain engine's."""
    shared = prompt(40, 41)
    burst = [shared + prompt(3 + i, 42 + i) for i in range(3)]
    first = prompt(12, 40)
    plain = LLM(str(bamba), memory_budget_bytes=16 << 20)
    want = [plain.generate([p], greedy(16), use_tqdm=False)[0] for p in [first] + burst]  # one by one: no burst
    llm = speculating(bamba, full_runs([first] + burst, want), 0.2, memory_budget_bytes=16 << 20)
    early = llm.add_request(first, greedy(16))
    for _ in range(3):
        llm.step()
    ids = [llm.add_request(p, greedy(16)) for p in burst]
    done = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o
    assert [done[r].outputs[0].token_ids for r in [early] + ids] == [w.outputs[0].token_ids for w in want]
    assert [done[r].num_cached_tokens for r in ids] == [0, 32, 32]
    s = llm.stats()
    assert s["burst_waits"] >= 2 and s["spec_accepted_tokens"] > 0
    assert_no_leaks(llm)


def test_migration_between_runs(bamba):
    """Exported after a few verification steps, imported into another speculating engine (block
    size 8): it finishes with the plain engine's tokens; the snapshot holds committed state only."""
    p = prompt(21, 5)
    plain = LLM(str(bamba), memory_budget_bytes=16 << 20).generate([p], greedy(30), use_tqdm=False)[0]
    runs = full_runs([p], [plain])
    src = speculating(bamba, runs, 0.3, memory_budget_bytes=16 << 20)
    rid = src.add_request(p, greedy(30))
    for _ in range(4):
        src.step()
    snap = src.export_request(rid)
    assert snap.num_computed_tokens == len(snap.token_ids) - 1 > len(p) + 3
    dst = speculating(bamba, runs, 0.3, memory_budget_bytes=16 << 20, block_size=8)
    dst.import_request(snap)
    out = None
    while dst.has_unfinished_requests():
        out = next((o for o in dst.step() if o.finished), out)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert src.stats()["spec_verify_runs"] > 0 and dst.stats()["spec_verify_runs"] > 0
    assert_no_leaks(src)
    assert_no_leaks(dst)


def test_abort_between_runs_frees_everything(bamba):
    p = prompt(30, 6)
    plain = LLM(str(bamba), memory_budget_bytes=16 << 20).generate([p], greedy(40), use_tqdm=False)[0]
    llm = speculating(bamba, full_runs([p], [plain]), 0.2, memory_budget_bytes=16 << 20)
    rid = llm.add_request(p, greedy(40))
    for _ in range(3):
        llm.step()
        assert no_draft_slot_left(llm)
    llm.abort(rid)
    llm.step()
    assert_no_leaks(llm)
    assert llm.stats()["spec_verify_runs"] > 0


# ---- what a run yields ----------------------------------------------------------------------
def test_a_stop_token_inside_an_accepted_run_ends_it_there(bamba):
    """The plain run's 9th token is made a stop id: with drafts of 5 always right, it is accepted
    mid-run; the output ends there (stop_reason, the same tokens) and the run's later tokens are
    dropped."""
    p = prompt(12, 8)
    ref = LLM(str(bamba), memory_budget_bytes=16 << 20).generate([p], greedy(20), use_tqdm=False)[0]
    stop = ref.outputs[0].token_ids[8]
    params = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop])
    plain = LLM(str(bamba), memory_budget_bytes=16 << 20).generate([p], params, use_tqdm=False)[0]
    llm = speculating(bamba, full_runs([p], [ref]), 0.0, memory_budget_bytes=16 << 20)
    out = llm.generate([p], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.outputs[0].stop_reason == plain.outputs[0].stop_reason == stop
    assert out.outputs[0].finish_reason == "stop"
    assert_no_leaks(llm)


def test_a_stop_string_inside_an_accepted_run_ends_it_there(bamba):
    p = prompt(12, 8)
    llm0 = LLM(str(bamba), memory_budget_bytes=16 << 20)
    ref = llm0.generate([p], greedy(20), use_tqdm=False)[0]
    text = ref.outputs[0].text
    stop = text[6:8]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop])
    plain = llm0.generate([p], params, use_tqdm=False)[0]
    llm = speculating(bamba, full_runs([p], [ref]), 0.0, memory_budget_bytes=16 << 20)
    out = llm.generate([p], params, use_tqdm=False)[0]
    assert (out.outputs[0].text, out.outputs[0].token_ids) == (plain.outputs[0].text, plain.outputs[0].token_ids)
    assert out.outputs[0].finish_reason == "stop"
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def ref_20_tokens(bamba):
    """The plain engine's 20 greedy tokens after prompt(10, 9), the drafts of every max_tokens case
    (made once: a fresh engine's output, read only)."""
    return LLM(str(bamba), memory_budget_bytes=16 << 20).generate([prompt(10, 9)], greedy(20), use_tqdm=False)[0]


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 12])
def test_max_tokens_cuts_a_run(bamba, max_tokens, ref_20_tokens):
    p = prompt(10, 9)
    plain = LLM(str(bamba), memory_budget_bytes=16 << 20).generate([p], greedy(max_tokens), use_tqdm=False)[0]
    ref = ref_20_tokens
    llm = speculating(bamba, full_runs([p], [ref]), 0.0, memory_budget_bytes=16 << 20)
    out = llm.generate([p], greedy(max_tokens), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == max_tokens
    assert_no_leaks(llm)


def test_logprobs_of_accepted_tokens_are_the_plain_ones(bamba):
    p = prompt(14, 10)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3, ignore_eos=True)
    plain = LLM(str(bamba), memory_budget_bytes=16 << 20).generate([p], params, use_tqdm=False)[0]
    llm = speculating(bamba, full_runs([p], [plain]), 0.3, memory_budget_bytes=16 << 20)
    out = llm.generate([p], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert llm.stats()["spec_accepted_tokens"] > 0
    for got, want in zip(out.outputs[0].logprobs, plain.outputs[0].logprobs):
        assert got.keys() == want.keys()
        for t in got:
            assert got[t].rank == want[t].rank
            assert got[t].logprob == pytest.approx(want[t].logprob, abs=1e-4)


def test_seeded_sampling_and_n_forks_draw_the_plain_tokens(bamba):
    """A seeded draw depends on (seed, sequence, position): a verified position draws the token the
    plain step at that position would, so sampled output with penalties, top-k / top-p and n = 3
    is token for token the plain engine's."""
    prompts = [prompt(9, 11), prompt(26, 12)]
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, top_k=20, n=3, seed=3, presence_penalty=0.5,
                             repetition_penalty=1.2, ignore_eos=True)]
    plain = LLM(str(bamba), memory_budget_bytes=16 << 20).generate(prompts, params, use_tqdm=False)
    llm = speculating(bamba, full_runs(prompts, plain), 0.2, memory_budget_bytes=16 << 20)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == tokens(plain)
    assert llm.stats()["spec_accepted_tokens"] > 10
    assert_no_leaks(llm)


@pytest.mark.slow  # 2 x 300 requests
def test_unseeded_sampling_keeps_the_plain_distribution(bamba):
    """300 unseeded requests of 3 tokens at temperature 0.1, drafting the greedy continuation: the
    pairs (2nd, 3rd token) follow the same distribution with and without speculation (two-sample
    chi-square over the 12 most common pairs and the rest, p > 0.001), and drafts were accepted."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    p = prompt(12, 13)
    params = SamplingParams(max_tokens=3, temperature=0.1, ignore_eos=True)
    greedy_run = LLM(str(bamba), memory_budget_bytes=16 << 20).generate([p], greedy(3), use_tqdm=False)
    counts = []
    for spec in (False, True):
        kw = dict(memory_budget_bytes=16 << 20, seed=5, max_num_seqs=8)
        llm = speculating(bamba, full_runs([p], greedy_run), 0.0, **kw) if spec else LLM(str(bamba), **kw)
        outs = llm.generate([p] * 300, params, use_tqdm=False)
        counts.append(Counter(tuple(o.outputs[0].token_ids[1:]) for o in outs))
        if spec:
            assert llm.stats()["spec_accepted_tokens"] > 20
    top = [k for k, _ in (counts[0] + counts[1]).most_common(12)]
    table = [[c[k] for k in top] + [sum(c.values()) - sum(c[k] for k in top)] for c in counts]
    assert chi2_contingency(table).pvalue > 1e-3


# ---- adaptive k and the n-gram drafter ------------------------------------------------------
def test_drafts_that_never_match_back_off(bamba):
    """Always-wrong drafts for 60 tokens: after each miss the request skips 1, 2, 4, ... steps, so
    a handful of runs verify, none accepts, and the output is the plain one."""
    p = prompt(8, 14)
    plain = LLM(str(bamba), memory_budget_bytes=16 << 20).generate([p], greedy(60), use_tqdm=False)[0]
    llm = speculating(bamba, full_runs([p], [plain]), 1.0, memory_budget_bytes=16 << 20,
                      speculative_config={**SPEC, "off_when_slower": False})  # the back-off alone
    out = llm.generate([p], greedy(60), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    s = llm.stats()
    assert 3 <= s["spec_verify_runs"] <= 7 and s["spec_accepted_tokens"] == 0


def test_the_ngram_drafter_speeds_a_repeating_prompt_without_changing_it(bamba):
    """The real drafter on a prompt the model continues by repeating: with a prompt that repeats a
    phrase, whatever the random model does, tokens equal the plain ones; the counters add up."""
    phrase = prompt(9, 15)
    p = phrase * 4
    plain = LLM(str(bamba), memory_budget_bytes=16 << 20).generate([p], greedy(30), use_tqdm=False)[0]
    llm = LLM(str(bamba), memory_budget_bytes=16 << 20, speculative_config={"num_speculative_tokens": 4,
                                                                              "prompt_lookup_min": 1})
    out = llm.generate([p], greedy(30), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    s = llm.stats()
    assert s["spec_verify_runs"] > 0
    assert s["spec_acceptance_rate"] == pytest.approx(s["spec_accepted_tokens"] / s["spec_draft_tokens"])
    assert s["spec_mean_accepted_length"] == pytest.approx(
        (s["spec_accepted_tokens"] + s["spec_verify_runs"]) / s["spec_verify_runs"])
    assert_no_leaks(llm)


def test_a_pure_attention_model_drops_the_kv_of_rejected_tokens(tmp_path):
    """Llama (no state): rejected positions' blocks go back to the pool at the step's end, so
    between steps a request holds exactly the blocks its computed tokens need."""
    from hybridkv.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path, seed=1)
    p = prompt(13, 16)
    plain = LLM(str(path), memory_budget_bytes=16 << 20).generate([p], greedy(40), use_tqdm=False)[0]
    llm = speculating(path, full_runs([p], [plain]), 0.5, memory_budget_bytes=16 << 20,
                      enable_prefix_caching=False)
    rid = llm.add_request(p, greedy(40))
    while llm.has_unfinished_requests():
        llm.step()
        r = llm.manager.requests.get(rid)
        if r is not None:
            assert len(llm.manager.block_ids(rid)) == -(-r.num_computed_tokens // 16), r
    assert llm.stats()["spec_verify_runs"] > 3
    assert_no_leaks(llm)


def test_the_cost_model_drafts_where_measured_faster():
    """StepCosts: both ways measured first, then the faster way, and the other every 32 steps."""
    from hybridkv.scheduler.speculation import PROBE_EVERY, StepCosts

    costs = StepCosts()
    assert costs.choose(1) is True  # nothing measured: drafts first
    costs.record(1, True, 30, 1.0)
    assert costs.choose(1) is False  # then a plain step
    costs.record(1, False, 10, 1.0)
    picks = [costs.choose(1) for _ in range(2 * PROBE_EVERY)]
    assert picks.count(False) == 2 and picks.count(True) == 2 * PROBE_EVERY - 2
    for _ in range(20):
        costs.record(1, True, 5, 1.0)  # drafts became slower
    picks = [costs.choose(1) for _ in range(2 * PROBE_EVERY)]
    assert picks.count(True) == 2
    assert costs.choose(4) is True  # another batch size measures afresh


def test_next_k_is_the_pace_of_the_next_draft():
    """What an MTP head chains to for a request (Speculation.next_k): k_max before its first run,
    then its adaptive k, and 1 while it skips drafting."""
    from types import SimpleNamespace

    from hybridkv.scheduler.speculation import Speculation
    from hybridkv.speculative.config import SpeculativeConfig
    from hybridkv.speculative.mtp import MtpDrafter

    spec = Speculation(SpeculativeConfig(method="mtp", num_speculative_tokens=3), 16, MtpDrafter())
    seq = SimpleNamespace(request_id="r", num_prompt_tokens=4, max_tokens=100, token_ids=[1] * 5)
    assert spec.next_k("r") == 3 and spec.wanted(seq, 64) == 3
    spec.observe(seq, 3, 1)  # one of three taken: k falls to 2
    assert spec.next_k("r") == 2
    spec.observe(seq, 2, 0)  # none taken: k 1 and a step without drafting
    assert spec.next_k("r") == 1 and spec.wanted(seq, 64) == 0
    spec.observe(seq, 1, 1)
    assert spec.next_k("r") == 2


@pytest.mark.slow  # tensor-parallel workers are processes
def test_tensor_parallel_ranks_verify_the_same_drafts(tmp_path):
    """TP = 2 (gloo): rank 1 runs each draft run's per-position state slots from the batch it is
    sent, so the tokens are TP = 1's and no draft slot is left."""
    from family_checks import mamba2_scans_that_matter
    from hybridkv.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("bamba", tmp_path)
    mamba2_scans_that_matter(path, seed=0)  # a wrong state shard changes the tokens
    prompts = [prompt(n, 70 + n) for n in (6, 23)]
    plain = LLM(str(path), memory_budget_bytes=16 << 20).generate(prompts, greedy(24), use_tqdm=False)
    llm = speculating(path, full_runs(prompts, plain), 0.3, memory_budget_bytes=16 << 20, tensor_parallel_size=2)
    try:
        outs = llm.generate(prompts, greedy(24), use_tqdm=False)
        assert tokens(outs) == tokens(plain)
        assert llm.stats()["spec_accepted_tokens"] > 0
        assert_no_leaks(llm)
    finally:
        llm.close()


@pytest.mark.slow  # two engines, the built-in models
def test_a_draft_model_proposes_from_pools_of_its_own():
    """method 'draft_model': the built-in draft proposes for the built-in code model from its own
    pools, inside the target's steps; the output is the plain engine's, drafts were accepted, and
    neither the target's pools nor the draft's keep anything (tests/speculative/test_draft_model.py
    has the rest)."""
    prompts = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n", "import os\nimport sys\n\n"]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain = LLM("hybridkv/tiny-code", memory_budget_bytes=32 << 20).generate(prompts, params, use_tqdm=False)
    llm = LLM("hybridkv/tiny-code", memory_budget_bytes=32 << 20, speculative_config={
        "method": "draft_model", "model": "hybridkv/tiny-code-draft", "num_speculative_tokens": 4,
        "off_when_slower": False})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == tokens(plain)
    s = llm.stats()
    assert s["spec_accepted_tokens"] > 10
    assert_no_leaks(llm)
    draft = llm.engine.scheduler.speculation.drafter.mgr.stats()
    assert draft.kv_blocks_used == draft.slots_live == 0, draft


def test_a_draft_model_of_another_vocabulary_is_refused_by_name(bamba):
    with pytest.raises(ValueError, match="vocabulary of 4096 tokens; the target's has 128"):
        LLM(str(bamba), memory_budget_bytes=16 << 20,
            speculative_config={"method": "draft_model", "model": "hybridkv/tiny-code-draft"})


@pytest.mark.slow  # interpreted Triton: ~15-30 s a family
@pytest.mark.parametrize("name", ["bamba", "qwen3_next"])
def test_the_triton_kernels_verify_drafts_as_they_decode(name, tmp_path, monkeypatch):
    """HYBRIDKV_BACKEND=triton (the CUDA kernels, interpreted here): the per-position draft runs go
    through the same one-token Triton kernels as plain decodes (Mamba2 / GDN state, conv window,
    paged attention), and the tokens are the Triton engine's without speculation."""
    monkeypatch.setenv("HYBRIDKV_BACKEND", "triton")
    fam = FAMILIES[name]
    path = fam.make(fam.name, tmp_path, seed=fam.seed, **fam.overrides)
    prompts = [prompt(9, 12)]
    kw = dict(memory_budget_bytes=16 << 20, max_num_batched_tokens=16)  # (a short profiling pass, interpreted)
    plain = LLM(str(path), **kw).generate(prompts, greedy(7), use_tqdm=False)
    llm = speculating(path, full_runs(prompts, plain), 0.4, **kw,
                      speculative_config={**SPEC, "num_speculative_tokens": 3, "off_when_slower": False})
    outs = llm.generate(prompts, greedy(7), use_tqdm=False)
    assert tokens(outs) == tokens(plain)
    assert llm.stats()["spec_accepted_tokens"] > 0
    assert_no_leaks(llm)


def test_the_cli_flag_and_metrics_carry_speculation(bamba):
    """`--speculative-config JSON` reaches LLM(...) as given; `/metrics` renders the counters."""
    import argparse

    from hybridkv.cli import add_llm_args, llm_kwargs
    from hybridkv.server.metrics import ServerMetrics

    ap = argparse.ArgumentParser()
    add_llm_args(ap)
    kw = llm_kwargs(ap.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']))
    assert kw["speculative_config"] == '{"method": "ngram", "num_speculative_tokens": 3}'
    llm = LLM(str(bamba), memory_budget_bytes=16 << 20, speculative_config=kw["speculative_config"])
    assert llm.config.speculative_config.num_speculative_tokens == 3
    p = prompt(9, 17) * 3
    llm.generate([p], greedy(12), use_tqdm=False)
    text = ServerMetrics("m").render(llm.stats()).decode()
    s = llm.stats()
    for name, key in (("spec_decode_num_drafts_total", "spec_verify_runs"),
                      ("spec_decode_num_draft_tokens_total", "spec_draft_tokens"),
                      ("spec_decode_num_accepted_tokens_total", "spec_accepted_tokens")):
        assert f'hybridkv:{name}{{model_name="m"}} {float(s[key])}' in text, name
    assert "hybridkv:spec_decode_acceptance_rate" in text


# ---- every family under pressure, and through a prefix hit and a migration ------------------
def _pressure_rows():
    return [pytest.param(n, marks=pytest.mark.slow) for n, f in FAMILIES.items() if f.pressure is not None]


@pytest.fixture(scope="module")
def pressure_plain(family_checkpoint):
    """name -> (checkpoint, prompts, the roomy plain engine's outputs, the tight budget) of the
    family's pressure case, run once for both modes (read only; each mode speculates on its own engine)."""
    from engine_fixtures import ragged_prompts

    runs = {}

    def get(name):
        if name not in runs:
            case = FAMILIES[name].pressure
            path = family_checkpoint(name)
            roomy = LLM(str(path), memory_budget_bytes=16 << 20)
            prompts = (ragged_prompts(6, roomy.model.vocab_size, seed=5) if case.lengths is None
                       else [prompt(n, 50 + n) for n in case.lengths])
            plain = roomy.generate(prompts, greedy(case.max_tokens + 8), use_tqdm=False)
            budget = tight_budget(roomy.model.cache_specs(), 16, blocks=case.blocks + 2, slots=1 + 3 + 3 * 5)
            runs[name] = path, prompts, plain, budget
        return runs[name]

    return get


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", _pressure_rows())
def test_every_pressure_family_speculates_through_preemption(name, mode, pressure_plain):
    """The family table's memory-pressure case (6 KV blocks, 3 live slots, 3 seats, 24 tokens a
    step; tests/family_checks.py) with speculation on (drafts right 70% of the time, 3 x 5 draft
    slots more): requests are preempted in `mode` between runs and end with the roomy plain
    engine's tokens; nothing leaks."""
    case = FAMILIES[name].pressure
    path, prompts, plain, budget = pressure_plain(name)
    params = greedy(case.max_tokens + 8)
    llm = speculating(path, full_runs(prompts, plain), 0.3, memory_budget_bytes=budget, max_num_seqs=3,
                      max_num_batched_tokens=24, preemption_mode=mode, checkpoint_share=0.0,
                      speculative_config={**SPEC, "num_speculative_tokens": 4, "max_speculating_seqs": 3,
                                          "off_when_slower": False})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == tokens(plain)
    s = llm.stats()
    assert s["preemptions"][mode] > 0 and s["spec_accepted_tokens"] > 0, s
    assert_no_leaks(llm)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n, f in FAMILIES.items()
                                  if f.prefix_migration or f.prefix_hit])
def test_every_family_speculates_through_a_prefix_hit_and_a_migration(name, family_checkpoint):
    """Two prompts sharing 40 tokens: the second hits the first's checkpoint, verifies drafts, is
    exported mid-answer and imported into an engine with block size 8 that speculates on; both end
    with the plain engine's tokens, and neither engine leaks."""
    path = family_checkpoint(name)
    shared = prompt(40, 61)
    first, second = shared + prompt(3, 62), shared + prompt(6, 63)
    plain = LLM(str(path), memory_budget_bytes=16 << 20).generate([first, second], greedy(20), use_tqdm=False)
    runs = full_runs([first, second], plain)
    kw = dict(memory_budget_bytes=16 << 20, speculative_config={**SPEC, "num_speculative_tokens": 3,
                                                                "off_when_slower": False})
    src = speculating(path, runs, 0.3, checkpoint_policy="prompt_end", max_num_batched_tokens=32, **kw)
    a = src.generate([first], greedy(20), use_tqdm=False)[0]
    rid = src.add_request(second, greedy(20))
    for _ in range(4):
        src.step()
    snap = src.export_request(rid)
    assert snap.num_computed_tokens > snap.num_prompt_tokens
    dst = speculating(path, runs, 0.3, block_size=8, **kw)
    dst.import_request(snap)
    out = None
    while dst.has_unfinished_requests():
        out = next((o for o in dst.step() if o.finished), out)
    assert src.stats()["prefix_hit_tokens"] >= 32
    assert [a.outputs[0].token_ids, out.outputs[0].token_ids] == [c.token_ids for o in plain for c in o.outputs]
    assert src.stats()["spec_accepted_tokens"] > 0 and dst.stats()["spec_verify_runs"] > 0
    assert_no_leaks(src)
    assert_no_leaks(dst)
