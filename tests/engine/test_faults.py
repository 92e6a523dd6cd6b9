"""Fault isolation: an exception injected at one stage of a step, for ONE request of a busy batch,
ends that request alone with finish_reason "error"; every other request finishes with the tokens
of an unperturbed run, nothing leaks, and the engine serves on. A failed forward pass ends its
whole batch the same way."""
import pytest
import torch

from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.plan import kv_bytes_per_block, state_bytes_per_slot
from hybridkv.request import RequestStatus
from hybridkv.scheduler.sampler import Sampler

from engine_fixtures import assert_no_leaks

VICTIM_SEED = 4242
MAX_SEQS = 6


class Injected(RuntimeError):
    pass


def workload(vocab):
    """Five bystanders (greedy and seeded, one with n=2) and the victim: seeded, n=2, arriving
    last with a lower priority, so it is the first to be preempted."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, vocab, (L,), generator=g).tolist() for L in (30, 17, 41, 5, 26, 35)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=12, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.7, seed=13, n=2, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, seed=VICTIM_SEED, n=2, ignore_eos=True)]
    return prompts, params


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba")))
    roomy = LLM(path, memory_budget_bytes=32 << 20, max_num_seqs=16)
    prompts, params = workload(roomy.model.vocab_size)
    ref = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    specs = roomy.model.cache_specs()
    return path, ref, (kv_bytes_per_block(specs, 16), state_bytes_per_slot(specs))


def tight(ckpt, blocks=6, mode="swap") -> LLM:
    """Pools of `blocks` KV blocks, MAX_SEQS live slots and 3 checkpoint slots: the batch preempts."""
    path, _, (kv, slot) = ckpt
    budget = kv * blocks + slot * (1 + MAX_SEQS + 3)
    return LLM(path, memory_budget_bytes=budget, max_num_seqs=MAX_SEQS, preemption_mode=mode,
               max_num_batched_tokens=40, checkpoint_policy="every_n_blocks", checkpoint_every_n=1,
               checkpoint_share=(slot * 3 + 0.5) / budget)


def submit(llm, with_victim=True):
    prompts, params = workload(llm.model.vocab_size)
    n = len(prompts) if with_victim else len(prompts) - 1
    for i in range(n):
        llm.add_request(prompts[i], params[i], request_id="v" if i == 5 else f"r{i}",
                        priority=1 if i == 5 else 0)


def drain(llm, max_steps=2000):
    done = {}
    for _ in range(max_steps):
        if not llm.has_unfinished_requests():
            return done
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o
    raise AssertionError(f"no end after {max_steps} steps: {llm.stats()}")


def assert_bystanders_untouched(done, ref):
    for i in range(5):
        assert [c.token_ids for c in done[f"r{i}"].outputs] == ref[i], i
        assert all(c.finish_reason == "length" for c in done[f"r{i}"].outputs)


def assert_serves_on(llm, ref):
    prompts, params = workload(llm.model.vocab_size)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == ref
    assert_no_leaks(llm)


def victim(mgr, rid) -> bool:
    """rid is the victim or one of its forks (manager ids: "v", ("v", j))."""
    return rid == "v" or (isinstance(rid, tuple) and rid[0] == "v")


def fail_on(obj, name, when, hits):
    """Wrap obj.name so it raises Injected when `when(*args)` holds; counts the hits."""
    real = getattr(obj, name)

    def wrapped(*args, **kwargs):
        if when(*args, **kwargs):
            hits.append(args)
            raise Injected(f"injected fault in {name}")
        return real(*args, **kwargs)
    return wrapped


def install(stage, llm, monkeypatch, hits):
    mgr = llm.engine.mgr
    if stage == "sampler":  # raises inside the batched call: the engine redoes the rows one by one
        real = Sampler._draw

        def draw(self, logits, rows):
            for r in rows:
                if r.params.seed == VICTIM_SEED and r.num_generated == 3:
                    hits.append(r)
                    raise Injected("injected fault in the sampler")
            return real(self, logits, rows)
        monkeypatch.setattr(Sampler, "_draw", draw)
    elif stage == "fork":
        monkeypatch.setattr(mgr, "fork", fail_on(mgr, "fork", lambda p, c, **k: victim(mgr, p), hits))
    elif stage == "commit":
        monkeypatch.setattr(mgr, "commit", fail_on(
            mgr, "commit", lambda r, n: victim(mgr, r) and mgr.request(r).num_computed_tokens > 0, hits))
    elif stage == "checkpoint":
        monkeypatch.setattr(mgr.prefix_cache, "checkpoint", fail_on(mgr.prefix_cache, "checkpoint", lambda r: victim(mgr, r), hits))
    elif stage == "swap_out":
        monkeypatch.setattr(mgr, "preempt", fail_on(
            mgr, "preempt", lambda r, mode="recompute": victim(mgr, r) and not hits, hits))
    elif stage == "swap_in":
        monkeypatch.setattr(mgr, "resume", fail_on(
            mgr, "resume", lambda r, **k: victim(mgr, r) and mgr.request(r).status is RequestStatus.SWAPPED, hits))
    elif stage == "nonfinite":  # the victim's logits row turns NaN after a few tokens
        real = llm.model.forward

        def forward(batch, caches):
            logits = real(batch, caches)
            vs = [mgr.live_slot(r) for r in mgr.requests if victim(mgr, r)
                  and mgr.request(r).status is RequestStatus.RUNNING and len(mgr.request(r).token_ids) > 40]
            rows = [i for i, s in enumerate(batch.state_slots.tolist()) if s in vs]
            if rows:
                hits.append(rows)
                logits[rows] = float("nan")
            return logits
        monkeypatch.setattr(llm.model, "forward", forward)


@pytest.mark.parametrize("stage", ["sampler", "fork", "commit", "checkpoint", "swap_out", "swap_in",
                                   "nonfinite"])
def test_a_fault_in_one_request_ends_it_alone(ckpt, stage, monkeypatch):
    _, ref, _ = ckpt
    llm = tight(ckpt)
    hits = []
    install(stage, llm, monkeypatch, hits)
    submit(llm)
    done = drain(llm)
    assert hits, f"the {stage} fault was never reached"
    v = done["v"]
    assert v.finished and any(c.finish_reason == "error" for c in v.outputs), v
    err = next(c.error for c in v.outputs if c.finish_reason == "error")
    assert ("injected" in err) if stage != "nonfinite" else ("non-finite logits" in err), err
    assert_bystanders_untouched(done, ref)
    assert llm.stats()["failed"] == 1
    assert_no_leaks(llm)
    monkeypatch.undo()
    assert_serves_on(llm, ref)


def test_a_failed_forward_ends_its_batch_and_the_engine_serves_on(ckpt, monkeypatch):
    _, ref, _ = ckpt
    llm = tight(ckpt, blocks=40)
    real, calls = llm.model.forward, []

    def forward(batch, caches):
        calls.append(1)
        if len(calls) == 3:
            raise Injected("injected fault in the forward pass")
        return real(batch, caches)
    monkeypatch.setattr(llm.model, "forward", forward)
    submit(llm)
    done = drain(llm)
    failed = {r for r, o in done.items() if any(c.finish_reason == "error" for c in o.outputs)}
    assert failed and set(done) == {"r0", "r1", "r2", "r3", "r4", "v"}
    for r in failed:
        assert "forward pass of its batch failed" in done[r].outputs[0].error
    for i in range(5):
        if f"r{i}" not in failed:
            assert [c.token_ids for c in done[f"r{i}"].outputs] == ref[i]
    assert_no_leaks(llm)
    assert_serves_on(llm, ref)


def test_a_fault_at_import_changes_nothing(ckpt, monkeypatch):
    _, ref, _ = ckpt
    src, dst = tight(ckpt, blocks=40), tight(ckpt, blocks=40)
    prompts, params = workload(src.model.vocab_size)
    single = SamplingParams(max_tokens=12, temperature=0.9, seed=VICTIM_SEED, ignore_eos=True)
    src.add_request(prompts[5], single, request_id="v")
    for _ in range(4):
        src.step()
    snap = src.export_request("v")
    submit(dst, with_victim=False)
    dst.step()
    mgr, hits = dst.engine.mgr, []
    monkeypatch.setattr(mgr, "import_snapshot", fail_on(mgr, "import_snapshot", lambda *a, **k: True, hits))
    with pytest.raises(Injected):
        dst.import_request(snap)
    assert hits and "v" not in dst.engine.groups
    monkeypatch.undo()
    dst.import_request(snap)  # the same snapshot imports once the fault is gone
    done = drain(dst)
    assert_bystanders_untouched(done, ref)
    assert done["v"].outputs[0].token_ids == ref[5][0]  # a seeded n=2 request's first sequence
    assert_no_leaks(dst)
    assert_no_leaks(src)


def test_nan_weights_fail_every_request_and_poison_no_cache(ckpt):
    """NaN in the weights: each request ends with "error" (not token 0), none of its KV or state
    is cached, and once the weights are whole again the same prompts give the oracle's tokens."""
    _, ref, _ = ckpt
    llm = tight(ckpt, blocks=40)
    prompts, params = workload(llm.model.vocab_size)
    weight = next(p for n, p in llm.model.named_parameters() if "embed" in n)
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.fill_(float("nan"))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(c.finish_reason == "error" and "non-finite logits" in c.error for o in outs for c in o.outputs)
    assert_no_leaks(llm)
    assert llm.stats()["kv_blocks_cached"] == 0 and llm.stats()["state_slots_checkpoint"] == 0
    with torch.no_grad():
        weight.copy_(saved)
    assert_serves_on(llm, ref)
