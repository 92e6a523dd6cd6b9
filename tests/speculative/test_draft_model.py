"""Speculation with a draft model (hybridkv/speculative/draft_model.py): the draft runs inside the
target's step on pools of its own. Oracles: every proposal is the draft checkpoint's own greedy
continuation of the same context (a plain engine of the draft checkpoint), the target's output is
token for token the engine's without speculation (through preemption in both modes, a migration,
seeded sampling with n = 2 and a stop string), the draft computes each real token once (plus k - 1
speculative positions a proposal), and neither the target's pools nor the draft's keep anything
once the requests end. Drafts: Qwen3-Next (another family: gated delta net, conv and attention),
RWKV (token shift, no attention), and the target's own checkpoint (every draft accepted)."""
import random

import pytest

from engine_fixtures import assert_no_leaks, greedy, plain_truth, tight_budget
from family_checks import FAMILIES
from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.speculative.draft_model import DraftModelDrafter
from hybridkv.state_pool import DRAFT

K = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> a tiny checkpoint: the target (Bamba) and the drafts (family_checks.FAMILIES rows;
    each of vocabulary 128)."""
    made = {}

    def get(name):
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            if name == "target":
                made[name] = make_tiny_checkpoint("bamba", path, seed=2)
            else:  # the family table's checkpoint, whose recurrent state moves the logits
                fam = FAMILIES[name]
                made[name] = fam.make(fam.name, path, seed=fam.seed, **fam.overrides)
        return made[name]

    return get


def spec(draft_path, k=K):
    return {"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": k, "off_when_slower": False}


def draft_path(checkpoints, draft):
    return checkpoints("target" if draft == "self" else draft)


def drafter_of(llm) -> DraftModelDrafter:
    return llm.engine.scheduler.speculation.drafter


def recorded(llm) -> list:
    """Every ask the drafter answers from now on, as (request id, tokens, k, proposal) (returned list)."""
    drafter, seen = drafter_of(llm), []
    inner = drafter.propose_many

    def propose_many(asks):
        asks = [(rid, list(tokens), k) for rid, tokens, k in asks]
        outs = inner(asks)
        seen.extend((rid, tokens, k, list(o)) for (rid, tokens, k), o in zip(asks, outs))
        return outs

    drafter.propose_many = propose_many
    return seen


def assert_no_draft_leaks(llm) -> None:
    mgr = drafter_of(llm).mgr
    s = mgr.stats()
    assert s.kv_blocks_used == 0 and s.slots_live == 0 and not mgr.requests, s
    assert mgr.recurrent is None or mgr.recurrent.states.count(DRAFT) == 0


def tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def rand_prompts(seed, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(4, 128) for _ in range(n)] for n in lengths]


# ---- the proposals --------------------------------------------------------------------------
@pytest.mark.parametrize("draft", ["qwen3_next", "rwkv", "lfm2", "self"])
def test_the_drafter_proposes_its_own_greedy_continuation(checkpoints, draft):
    """The drafter alone, asked as the scheduler asks: three requests (prompts of 5 to 75 tokens:
    catch-ups in several forwards of at most 32 tokens, cut at checkpoints) for k of 1 to 4 tokens a
    step, each step taking a random part of its proposal and one token of its own, as a target
    would; a fourth, sharing the second's prompt, joins once the second ended; an ask repeated
    without a new token gets the same proposal for no computation. Every proposal is what
    a plain engine of the draft checkpoint generates greedily after the same tokens; the draft
    computed each real token once (less its prefix hits) and k - 1 speculative positions a proposal."""
    path = draft_path(checkpoints, draft)
    drafter = DraftModelDrafter.load(str(path), 128, 32 << 20, device="cpu", dtype="float32", block_size=16,
                                     max_num_seqs=4, max_num_batched_tokens=32, draft_slots=4 * (K + 1))
    rng = random.Random(7)
    seqs = dict(zip("abc", rand_prompts(8, (5, 40, 75))))
    seen, last = [], {}
    for step in range(14):
        if step == 7:
            drafter.forget("b")
            seqs["d"] = seqs.pop("b")[:40] + rand_prompts(9, (30,))[0]
        asks = [(rid, list(t), rng.randint(1, K)) for rid, t in seqs.items()]
        proposals = drafter.propose_many(asks)
        if step == 3:  # asked again without a new token (a request preempted by swap after its proposal)
            before = dict(drafter.counters)
            assert drafter.propose_many(asks) == proposals and drafter.counters == before
        for (rid, t, k), proposal in zip(asks, proposals):
            assert len(proposal) == k
            seen.append((t, k, proposal))
            last[rid] = len(t)
            seqs[rid].extend(proposal[:rng.randint(0, k)] + [rng.randrange(4, 128)])
    own = LLM(str(path), memory_budget_bytes=32 << 20).generate(
        [t for t, _, _ in seen], [greedy(k) for _, k, _ in seen], use_tqdm=False)
    assert [p for _, _, p in seen] == [list(o.outputs[0].token_ids) for o in own]
    c = drafter.counters
    assert c["draft_real_tokens"] == sum(last.values()) - drafter.mgr.stats().prefix_hit_tokens
    assert c["draft_speculative_tokens"] == sum(k - 1 for _, k, _ in seen)
    assert drafter.mgr.stats().prefix_hit_tokens >= 32  # "d" resumes from "b"'s prompt-end state
    for rid in list(seqs):
        drafter.forget(rid)
    s = drafter.mgr.stats()
    assert s.kv_blocks_used == 0 and s.slots_live == 0 and not drafter.mgr.requests


@pytest.mark.parametrize("draft", ["qwen3_next", "rwkv", "self"])
def test_every_proposal_is_the_drafts_own_greedy_continuation(checkpoints, draft):
    """Three requests at once, 40 tokens each: each proposal equals what a plain engine of the draft
    checkpoint generates greedily after the same tokens; the target's output is the plain one; the
    draft computed every real token once and k - 1 speculative positions a proposal, nothing more."""
    target, path = checkpoints("target"), draft_path(checkpoints, draft)
    prompts = rand_prompts(1, (5, 21, 34))
    plain, _ = plain_truth(target, prompts, greedy(40))
    llm = LLM(str(target), memory_budget_bytes=32 << 20, speculative_config=spec(path))
    seen = recorded(llm)
    assert tokens(llm.generate(prompts, greedy(40), use_tqdm=False)) == tokens(plain)
    asked = [(t, k, p) for _, t, k, p in seen]
    assert len(asked) >= 10 and all(len(p) == k for _, k, p in asked)
    own = LLM(str(path), memory_budget_bytes=32 << 20).generate(
        [t for t, _, _ in asked], [greedy(k) for _, k, _ in asked], use_tqdm=False)
    assert [p for _, _, p in asked] == [list(o.outputs[0].token_ids) for o in own]
    drafter = drafter_of(llm)
    last = {rid: len(t) for rid, t, _, _ in seen}  # what D mirrors when its request ends
    c = drafter.counters
    assert c["draft_real_tokens"] == sum(last.values()) - drafter.mgr.stats().prefix_hit_tokens
    assert c["draft_speculative_tokens"] == sum(k - 1 for _, k, _ in asked)
    assert c["draft_evictions"] == 0
    s = llm.stats()
    assert s["spec_draft_model"] == {"forwards": c["draft_forwards"], "real_tokens": c["draft_real_tokens"],
                                     "speculative_tokens": c["draft_speculative_tokens"], "evictions": 0}
    if draft == "self":
        assert s["spec_accepted_tokens"] == s["spec_draft_tokens"] > 60
    assert_no_leaks(llm)
    assert_no_draft_leaks(llm)


def test_a_draft_request_resumes_from_the_drafts_prefix_cache(checkpoints):
    """The second of two prompts sharing 40 tokens builds its draft request from the first's state
    in the draft's prefix cache (its prompt-end checkpoint at 32), and its proposals are still the
    draft's own greedy continuation."""
    target, path = checkpoints("target"), checkpoints("qwen3_next")
    shared = rand_prompts(2, (40,))[0]
    prompts = [shared + p for p in rand_prompts(3, (3, 7))]
    plain, _ = plain_truth(target, prompts, greedy(12))
    llm = LLM(str(target), memory_budget_bytes=32 << 20, speculative_config=spec(path))
    seen = recorded(llm)
    outs = [llm.generate([p], greedy(12), use_tqdm=False)[0] for p in prompts]
    assert tokens(outs) == tokens(plain)
    assert drafter_of(llm).mgr.stats().prefix_hit_tokens >= 32
    asked = [(t, k, p) for _, t, k, p in seen if p]
    own = LLM(str(path), memory_budget_bytes=32 << 20).generate(
        [t for t, _, _ in asked], [greedy(k) for _, k, _ in asked], use_tqdm=False)
    assert [p for _, _, p in asked] == [list(o.outputs[0].token_ids)[:len(p)] for (_, _, p), o in zip(asked, own)]
    assert_no_leaks(llm)
    assert_no_draft_leaks(llm)


# ---- the target's output through what the engine does around it ----------------------------
@pytest.mark.parametrize("draft", ["qwen3_next", "self"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_both_modes_keeps_the_plain_tokens(checkpoints, draft, mode):
    """5 requests of 40 tokens on a target of 7 KV blocks and 3 live slots (3 seats): requests are
    preempted while others verify drafts. The draft's own pools (2 live slots) hold fewer requests
    than run, so the least recently asked draft requests are freed and rebuilt. The output is the
    plain engine's; nothing leaks in either pool."""
    target, path = checkpoints("target"), draft_path(checkpoints, draft)
    prompts = rand_prompts(4, (3, 17, 30, 9, 22))
    params = greedy(40)
    plain, _ = plain_truth(target, prompts, params)
    specs = LLM(str(target), memory_budget_bytes=16 << 20).model.cache_specs()
    llm = LLM(str(target), preemption_mode=mode, max_num_seqs=3, max_num_batched_tokens=24, checkpoint_share=0.0,
              memory_budget_bytes=tight_budget(specs, 16, blocks=7, slots=1 + 3 + 3 * (K + 1)),
              speculative_config={"method": "ngram", "num_speculative_tokens": K, "off_when_slower": False})
    draft_specs = LLM(str(path), memory_budget_bytes=16 << 20).model.cache_specs()
    speculation = llm.engine.scheduler.speculation
    speculation.drafter = DraftModelDrafter.load(
        str(path), 128, tight_budget(draft_specs, 16, blocks=12, slots=1 + 2 + 3 * K), device="cpu",
        dtype="float32", block_size=16, max_num_seqs=2, max_num_batched_tokens=24, draft_slots=3 * K)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == tokens(plain)
    s = llm.stats()
    assert s["preemptions"][mode] > 0 and s["spec_verify_runs"] > 0, s
    if draft == "self":
        assert s["spec_accepted_tokens"] > 40
    assert drafter_of(llm).counters["draft_evictions"] > 0
    assert_no_leaks(llm)
    assert_no_draft_leaks(llm)


@pytest.mark.parametrize("draft", ["qwen3_next", "self"])
def test_a_migration_keeps_the_plain_tokens(checkpoints, draft):
    """Exported after a few verification steps, imported into another engine (block size 8) that
    drafts with the same checkpoint: its draft request is built there from the imported tokens;
    the output is the plain engine's, and neither engine nor draft keeps anything."""
    target, path = checkpoints("target"), draft_path(checkpoints, draft)
    p = rand_prompts(5, (21,))[0]
    plain, _ = plain_truth(target, [p], greedy(30))
    src = LLM(str(target), memory_budget_bytes=32 << 20, speculative_config=spec(path))
    rid = src.add_request(p, greedy(30))
    for _ in range(4):
        src.step()
    snap = src.export_request(rid)
    assert_no_draft_leaks(src)  # the request left: its draft request went with it
    dst = LLM(str(target), memory_budget_bytes=32 << 20, block_size=8, speculative_config=spec(path))
    seen = recorded(dst)
    dst.import_request(snap)
    out = None
    while dst.has_unfinished_requests():
        out = next((o for o in dst.step() if o.finished), out)
    assert out.outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert src.stats()["spec_verify_runs"] > 0 and dst.stats()["spec_verify_runs"] > 0 and seen
    assert drafter_of(dst).counters["draft_real_tokens"] >= len(seen[0][1])  # built from the imported tokens
    for engine in (src, dst):
        assert_no_leaks(engine)
        assert_no_draft_leaks(engine)


@pytest.mark.parametrize("draft", ["qwen3_next", "self"])
def test_seeded_sampling_n_forks_and_a_stop_string_keep_the_plain_tokens(checkpoints, draft):
    target, path = checkpoints("target"), draft_path(checkpoints, draft)
    prompts = rand_prompts(6, (9, 26))
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, top_k=20, n=2, seed=3, ignore_eos=True)]
    plain, _ = plain_truth(target, prompts, params)
    llm = LLM(str(target), memory_budget_bytes=32 << 20, speculative_config=spec(path))
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == tokens(plain)
    assert llm.stats()["spec_verify_runs"] > 0
    ref = plain_truth(target, prompts[:1], greedy(24))[0][0].outputs[0]
    text = ref.text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # two characters from the middle of the greedy answer
    stopped = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    want = plain_truth(target, prompts[:1], stopped)[0][0].outputs[0]
    got = llm.generate(prompts[:1], stopped, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")
    if draft == "self":
        assert llm.stats()["spec_accepted_tokens"] > 10
    assert_no_leaks(llm)
    assert_no_draft_leaks(llm)

