"""The persistent decode batch (issue 12's fast path, now the only way a decode is scheduled and
committed) carried from step to step against the same batch made afresh each step: twin engines
of one checkpoint, the batch carried over in one (`scheduler.carry_decode_batch = True`: one token
later, or cut to those left, with the manager's phase-bucketed block bookkeeping) and made anew
in the other, driven by the same seeded operations (adds with shared prefixes, n > 1, stop ids,
min_tokens, seeded top-p sampling, logprobs, penalties; aborts; migrations out and back in;
steps, every third reporting only what finished) on pools small enough to preempt (recompute and
swap) and evict. After every step both twins gave the same outputs and hold the same memory:
each request's progress, blocks and slot, the pool counts, the recurrent checkpoints, and the
bytes of the live states and the KV that was written. The fast twin must have carried batches
over (its `carried_decode_batches` counter), the slow twin never. Also on their own: faults in a
decode step (NaN logits, checkpoint, sampler, forward), a stop id mid-batch, the switch flipped
mid-batch, the running queue's version."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from hybridkv.decode_rows import DecodeRows
from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.plan import kv_bytes_per_block, state_bytes_per_slot
from hybridkv.request import Request
from hybridkv.scheduler.sampler import Sampler
from hybridkv.scheduler.sequence_queue import SequenceQueue

from engine_fixtures import assert_no_leaks

BS = 16
# family -> (KV blocks, seats, live state slots, checkpoint slots) of the tight twins
FAMILIES = {"bamba": (10, 5, 5, 2),    # Mamba2 + full attention
            "gpt_oss": (9, 5, 5, 0),   # a full and a sliding-window attention group
            "llama": (10, 5, 5, 0),    # attention only
            "mamba2": (0, 5, 3, 2),    # no attention: states only (short of slots: queues, never preempts)
            "recurrent_gemma": (8, 5, 5, 2)}  # RG-LRU state beside sliding-window attention


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            path = str(make_tiny_checkpoint(family, tmp_path_factory.mktemp(family), seed=3))
            made[family] = path, LLM(path, memory_budget_bytes=4 << 20).model.cache_specs()
        return made[family]
    return get


def twins(checkpoint, mode, blocks, seats, live_slots, ckpt_slots, **kwargs) -> tuple[LLM, LLM]:
    """(fast, slow): the same engine twice on pools of `blocks` KV blocks per group and
    1 + live_slots + ckpt_slots state slots, the fast path on in the first and off in the second."""
    path, specs = checkpoint
    slot = state_bytes_per_slot(specs)
    budget = kv_bytes_per_block(specs, BS) * blocks + slot * (1 + live_slots + ckpt_slots)
    share = (slot * ckpt_slots + 0.5) / budget if slot else 0.0
    pair = []
    for fast in (True, False):
        llm = LLM(path, memory_budget_bytes=budget, max_num_seqs=seats, preemption_mode=mode,
                  max_num_batched_tokens=32, checkpoint_share=share, **kwargs)
        llm.engine.scheduler.carry_decode_batch = fast
        pair.append(llm)
    return pair[0], pair[1]


# ---- what is compared ----------------------------------------------------------------------
def outputs_view(outs) -> list:
    return [(o.request_id, o.finished, o.num_cached_tokens,
             [(c.index, list(c.token_ids), c.finish_reason, c.stop_reason, c.error, c.logprobs) for c in o.outputs])
            for o in outs]


def memory_view(llm: LLM) -> dict:
    """Everything the manager and the scheduler hold that a step changes, as plain values."""
    mgr, sched = llm.engine.mgr, llm.engine.scheduler
    view = {"stats": mgr.stats(),
            "requests": {rid: (r.status, r.num_computed_tokens, len(r.token_ids), mgr.live_slot(rid),
                               {g: list(group.block_ids(rid)) for g, group in mgr.attention_groups.items()})
                         for rid, r in mgr.requests.items()},
            "queues": {name: [(s.request_id, s.status, len(s.token_ids)) for s in getattr(sched, name)]
                       for name in ("running", "waiting", "swapped")}}
    if mgr.recurrent is not None:
        view["checkpoints"] = [(h, c.slot, c.position, c.output, c.last_used)
                               for h, c in mgr.recurrent.checkpoints.items()]
    return view


def held_bytes(llm: LLM) -> list[torch.Tensor]:
    """The live and checkpoint states, and the KV of every written position of every held block."""
    mgr = llm.engine.mgr
    out = []
    if mgr.recurrent is not None:
        slots = sorted({mgr.live_slot(r) for r in mgr.requests} - {0}
                       | {c.slot for c in mgr.recurrent.checkpoints.values()})
        for pool in (*mgr.conv_states.values(), *mgr.ssm_states.values()):
            out.append(pool[slots])
    for group in mgr.attention_groups.values():
        for rid, r in mgr.requests.items():
            for j, b in enumerate(group.block_ids(rid)):
                n = min(BS, r.num_computed_tokens - j * BS)
                if b >= 0 and n > 0:
                    out.extend(group.pool.kv[layer][b, :, :n] for layer in sorted(group.pool.kv))
    return out


def fields_of(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def first_difference(a, b, where="") -> str:
    """Where two views first differ (the path of keys and indices) and the two values there."""
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            if a[k] != b[k]:
                return first_difference(a[k], b[k], f"{where}[{k!r}]")
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{where}[{i}]")
    if hasattr(a, "__dataclass_fields__") and type(a) is type(b):
        return first_difference(fields_of(a), fields_of(b), where)
    return f"{where}: fast {a!r} != slow {b!r}"


def step_twins(fast: LLM, slow: LLM, ops: list, i: int, finished_only: bool = False) -> list:
    """One step of each twin; asserts they agree on the outputs and the memory afterwards.
    finished_only: the engine's step that reports only finished requests (generate's)."""
    def counts():
        c = fast.engine.counters  # a fresh dict each time
        return c["carried_decode_batches"], c["decode_batch_steps"]
    before = counts()
    step = (lambda llm: llm.engine.step(finished_only=True)) if finished_only else (lambda llm: llm.step())
    outs = [outputs_view(step(fast)), outputs_view(step(slow))]
    carried, steady = (after > was for after, was in zip(counts(), before))
    # fast: a steady decode batch carried over from the step before; batch: a steady one made anew
    ops.append(("step", i, "fast" if carried else "batch" if steady else "general"))
    where = f"after step {i} ({ops[-1][2]} path in the fast twin); last ops: {ops[-8:]}"
    assert outs[0] == outs[1], f"outputs differ {where}: {first_difference(outs[0], outs[1])}"
    views = [memory_view(fast), memory_view(slow)]
    assert views[0] == views[1], f"memory differs {where}: {first_difference(views[0], views[1])}"
    tensors = [held_bytes(fast), held_bytes(slow)]
    assert len(tensors[0]) == len(tensors[1])
    for j, (x, y) in enumerate(zip(*tensors)):
        assert torch.equal(x, y), f"held state/KV tensor {j} differs {where}"
    return outs[0]


def same(a, b) -> bool:
    """Equal values, tensors equal to the bit (in dicts, lists and dataclasses such as snapshots)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and same(fields_of(a), fields_of(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def try_import(llm: LLM, snap) -> bool:
    """Import `snap`; False when it does not fit now (RuntimeError: retried later)."""
    try:
        llm.import_request(snap)
        return True
    except RuntimeError:
        return False


def assert_paths_taken(fast: LLM, slow: LLM) -> None:
    assert fast.engine.counters["carried_decode_batches"] > 0, "the fast twin never took the decode-batch path"
    assert slow.engine.counters["carried_decode_batches"] == 0, "the slow twin took the decode-batch path"


# ---- the operations ------------------------------------------------------------------------
def random_params(rng: random.Random, i: int, vocab: int) -> SamplingParams:
    kw = dict(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.6)
    if rng.random() < 0.35:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9, 0.6]), seed=100 + i)
    if rng.random() < 0.25:
        kw.update(n=rng.choice([2, 3]), temperature=0.9, seed=500 + i)
    if rng.random() < 0.3:
        kw["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.3:
        kw["stop_token_ids"] = rng.sample(range(4, vocab), 6)  # tiny random models: one fires now and then
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(1, kw["max_tokens"])
    if rng.random() < 0.15:  # the logits processors read each sequence's own output
        kw.update(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, top_k=20, min_p=0.02,
                  logit_bias={rng.randrange(4, vocab): 3.0})
    if rng.random() < 0.1:
        kw["stop"] = [rng.choice("abcdefghij")]  # a stop string: the detokenizer's side of stopping
    return SamplingParams(**kw)


def drive(fast: LLM, slow: LLM, seed: int, num_ops: int = 90, max_steps: int = 400) -> dict:
    """Apply the same seeded operations to both twins, comparing after every step; then step both
    to the end. Returns the finished outputs by request id."""
    rng = random.Random(seed)
    vocab = fast.model.vocab_size
    systems = [[rng.randrange(4, vocab) for _ in range(rng.randint(17, 40))] for _ in range(2)] + [[]]
    ops, live, done = [], [], {}
    single, away = [], []  # live ids with n == 1 (they may migrate); exported (id, snapshots) to import
    for i in range(num_ops + max_steps):
        if i < num_ops:
            r = rng.random()
            if r < 0.22:
                rid = f"q{i}"
                prompt = rng.choice(systems) + [rng.randrange(4, vocab) for _ in range(rng.randint(1, 24))]
                params = random_params(rng, i, vocab)
                priority = rng.randint(0, 2)
                for llm in (fast, slow):
                    llm.add_request(prompt, params, request_id=rid, priority=priority)
                ops.append(("add", rid, len(prompt), params.n, params.max_tokens, priority))
                live.append(rid)
                if params.n == 1:
                    single.append(rid)
            elif r < 0.27 and live:
                rid = live.pop(rng.randrange(len(live)))
                if rid in single:
                    single.remove(rid)
                for llm in (fast, slow):
                    llm.abort(rid)
                ops.append(("abort", rid))
            elif r < 0.31 and single:  # leaves by migration, comes back when it fits
                rid = single.pop(rng.randrange(len(single)))
                snaps = [llm.export_request(rid) for llm in (fast, slow)]
                assert same(snaps[0], snaps[1]), f"the snapshots of {rid!r} differ after {ops[-8:]}"
                live.remove(rid)
                away.append((rid, snaps))
                ops.append(("export", rid, snaps[0].num_computed_tokens))
        elif not (away or fast.has_unfinished_requests() or slow.has_unfinished_requests()):
            break
        for rid, snaps in list(away):
            landed = [try_import(llm, snap) for llm, snap in zip((fast, slow), snaps)]
            assert landed[0] == landed[1], f"import of {rid!r}: {landed} after {ops[-8:]}"
            if landed[0]:
                away.remove((rid, snaps))
                live.append(rid)
                single.append(rid)
                ops.append(("import", rid))
        for o in step_twins(fast, slow, ops, i, finished_only=i % 3 == 2):
            if o[1]:
                done[o[0]] = o
                for ids in (live, single):
                    if o[0] in ids:
                        ids.remove(o[0])
    else:
        raise AssertionError(f"no end after {num_ops + max_steps} steps: {fast.stats()}")
    for llm in (fast, slow):
        assert_no_leaks(llm)
    return done


# ---- tests ---------------------------------------------------------------------------------
# (family, preemption mode, checkpoint policy, seed): seeds whose workload preempts, hits, forks,
# migrates and stops
CASES = [("bamba", "recompute", "junctions", 0), ("gpt_oss", "swap", "junctions", 0),
         ("llama", "recompute", "junctions", 0), ("mamba2", "recompute", "every_n_blocks", 1),
         ("recurrent_gemma", "swap", "every_n_blocks", 0)]


@pytest.mark.parametrize("family, mode, policy, seed", [  # long: bamba in the fast tier
    c if c[0] == "bamba" else pytest.param(*c, marks=pytest.mark.slow) for c in CASES])
def test_twins_agree_under_random_operations(checkpoints, family, mode, policy, seed):
    fast, slow = twins(checkpoints(family), mode, *FAMILIES[family], checkpoint_policy=policy,
                       checkpoint_every_n=1)
    done = drive(fast, slow, seed=seed)
    stats = fast.stats()
    assert stats["preemptions"][mode] > 0 or family == "mamba2", stats
    assert stats["prefix_hit_tokens"] > 0 and stats["forks"] > 0 and stats["migrations"]["in"] > 0, stats
    reasons = {c[2] for o in done.values() for c in o[3]}
    assert {"length", "stop"} <= reasons, reasons
    assert "error" not in reasons
    assert_paths_taken(fast, slow)


def roomy_twins(checkpoint) -> tuple[LLM, LLM]:
    return twins(checkpoint, "recompute", blocks=40, seats=8, live_slots=8, ckpt_slots=4)


def run_twins(fast: LLM, slow: LLM, requests: dict, max_steps: int = 200, ops=None) -> tuple[dict, list]:
    """Add `requests` {id: (prompt, params)} to both, step them to the end comparing after every
    step; (the finished outputs by id, the log `ops`: ("step", i, path taken, ids finished) per step)."""
    for rid, (prompt, params) in requests.items():
        for llm in (fast, slow):
            llm.add_request(prompt, params, request_id=rid)
    ops, done = ([] if ops is None else ops), {}
    for i in range(max_steps):
        if not fast.has_unfinished_requests():
            break
        for o in step_twins(fast, slow, ops, i):
            if o[1]:
                done[o[0]] = o
                ops[-1] += (o[0],)
    assert not slow.has_unfinished_requests(), f"no end after {max_steps} steps"
    for llm in (fast, slow):
        assert_no_leaks(llm)
    return done, ops


def bystanders(vocab: int) -> dict:
    g = torch.Generator().manual_seed(11)
    lengths, params = (9, 17, 5, 23), [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
                                       SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=21,
                                                      logprobs=2, ignore_eos=True),
                                       SamplingParams(max_tokens=14, temperature=0.9, seed=22, n=2, ignore_eos=True),
                                       SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)]
    return {f"b{i}": (torch.randint(4, vocab, (L,), generator=g).tolist(), p)
            for i, (L, p) in enumerate(zip(lengths, params))}


def test_nonfinite_logits_in_a_decode_batch_fail_only_their_request(checkpoints, monkeypatch):
    """The victim (n=2, seeded) gets NaN logits rows at its 5th token, in a step of a steady decode
    batch: it alone ends with "error" in both twins, and the bystanders keep the tokens of an
    unperturbed run."""
    fast, slow = roomy_twins(checkpoints("bamba"))
    vocab = fast.model.vocab_size
    requests = bystanders(vocab)
    victim_prompt = torch.randint(4, vocab, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    requests["v"] = (victim_prompt, SamplingParams(max_tokens=14, temperature=0.9, seed=4242, n=2, logprobs=1,
                                                   ignore_eos=True))
    ops, hits = [], {}  # twin -> (the victim's rows, the step they were poisoned in)
    for name, llm in (("fast", fast), ("slow", slow)):
        mgr, real = llm.engine.mgr, llm.model.forward

        def forward(batch, caches, name=name, mgr=mgr, real=real):
            logits = real(batch, caches)
            ids = [r for r in mgr.requests if r == "v" or (isinstance(r, tuple) and r[0] == "v")]
            if name not in hits and len(ids) == 2 and all(
                    mgr.request(r).num_computed_tokens == len(victim_prompt) + 4 for r in ids):
                slots = {mgr.live_slot(r) for r in ids}
                rows = [i for i, s in enumerate(batch.state_slots.tolist()) if s in slots]
                hits[name] = (rows, len(ops))
                logits[rows] = float("nan")
            return logits
        monkeypatch.setattr(llm.model, "forward", forward)
    done, _ = run_twins(fast, slow, requests, ops=ops)
    assert len(hits["fast"][0]) == 2 and hits["fast"][1] == hits["slow"][1], hits
    k = hits["fast"][1]  # the poisoned step came from a steady decode batch (the step before it was a
    # fast one and nobody left), and the batch that is left takes the fast path again
    assert ops[k - 1][2] in ("fast", "batch") and len(ops[k - 1]) == 3, f"no steady decode batch at step {k}: {ops}"
    assert any(op[2] == "fast" for op in ops[k + 1:]), f"no fast step after the victim left: {ops}"
    v = done["v"][3]
    assert [c[2] for c in v] == ["error", "error"] and "non-finite logits" in v[0][4] + v[1][4], v
    assert fast.stats()["failed"] == slow.stats()["failed"] == 1
    calm = bystanders(vocab)
    ref = LLM(fast.model_path, memory_budget_bytes=8 << 20).generate(
        [p for p, _ in calm.values()], [q for _, q in calm.values()], use_tqdm=False)
    for rid, o in zip(calm, ref):
        assert [c[1] for c in done[rid][3]] == [c.token_ids for c in o.outputs], rid
        assert all(c[2] == "length" for c in done[rid][3]), rid
    assert_paths_taken(fast, slow)


class Injected(RuntimeError):
    pass


def unperturbed(path: str, requests: dict) -> dict:
    """The token ids of each request's sequences on a roomy engine of its own."""
    outs = LLM(path, memory_budget_bytes=8 << 20).generate([p for p, _ in requests.values()],
                                                            [q for _, q in requests.values()], use_tqdm=False)
    return {rid: [c.token_ids for c in o.outputs] for rid, o in zip(requests, outs)}


@pytest.mark.parametrize("stage", ["checkpoint", "sampler", "forward"])
def test_a_fault_in_a_decode_batch_step_ends_what_it_hit(checkpoints, stage, monkeypatch):
    """An exception in a step of a steady decode batch: the output checkpoint or the draw of the
    victim (n=2, seeded) ends that request alone; a failed forward ends the whole batch. Both twins
    alike, the rest keeps the tokens of an unperturbed run, and the engine serves on (fast again)."""
    fast, slow = roomy_twins(checkpoints("bamba"))
    vocab, path = fast.model.vocab_size, fast.model_path
    requests = bystanders(vocab)
    victim_prompt = torch.randint(4, vocab, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    requests["v"] = (victim_prompt, SamplingParams(max_tokens=14, temperature=0.9, seed=4242, n=2, ignore_eos=True))
    ops, hits = [], {}  # twin -> the first step the fault hit

    def hit(name):
        hits.setdefault(name, len(ops))
        return True
    twin_of_mgr = {}
    if stage == "checkpoint":  # the decode batch's checkpoint verb, on either twin's manager
        real_decode = DecodeRows.checkpoint

        def checkpoint_decode(rows, i):
            rid, name = rows.req_ids[i], twin_of_mgr.get(id(rows.mgr))
            if name and (rid == "v" or rid[0] == "v") and rows.mgr.request(rid).num_computed_tokens > 13 \
                    and hit(name):
                raise Injected("injected fault in checkpoint")
            return real_decode(rows, i)
        monkeypatch.setattr(DecodeRows, "checkpoint", checkpoint_decode)
    for name, llm in (("fast", fast), ("slow", slow)):
        mgr = llm.engine.mgr
        if stage == "checkpoint":  # the victim's first output checkpoint (a block boundary at 16)
            real = mgr.prefix_cache.checkpoint

            def checkpoint(rid, name=name, mgr=mgr, real=real):
                if (rid == "v" or rid[0] == "v") and mgr.request(rid).num_computed_tokens > 13 and hit(name):
                    raise Injected("injected fault in checkpoint")
                return real(rid)
            monkeypatch.setattr(mgr.prefix_cache, "checkpoint", checkpoint)
            twin_of_mgr[id(mgr)] = name
        elif stage == "forward":  # once every request is well into its decodes
            real = llm.model.forward

            def forward(batch, caches, name=name, mgr=mgr, real=real):
                if all(r.num_computed_tokens >= r.num_prompt_tokens + 5 for r in mgr.requests.values()) and hit(name):
                    raise Injected("injected fault in the forward pass")
                return real(batch, caches)
            monkeypatch.setattr(llm.model, "forward", forward)
    if stage == "sampler":  # the victim's 5th draw; the engine redoes the batch's rows one by one
        real_draw, twin_of = Sampler._draw, {id(fast.engine.runner.sampler): "fast", id(slow.engine.runner.sampler): "slow"}

        def draw(self, logits, rows):
            if id(self) in twin_of and any(r.params.seed == 4242 and r.num_generated == 4 for r in rows) \
                    and hit(twin_of[id(self)]):
                raise Injected("injected fault in the sampler")
            return real_draw(self, logits, rows)
        monkeypatch.setattr(Sampler, "_draw", draw)
    done, _ = run_twins(fast, slow, requests, ops=ops)
    assert hits.keys() == {"fast", "slow"} and hits["fast"] == hits["slow"], hits
    k = hits["fast"]
    assert ops[k - 1][2] in ("fast", "batch") and len(ops[k - 1]) == 3, f"no steady decode batch at step {k}: {ops}"
    failed = {rid for rid, o in done.items() if any(c[2] == "error" for c in o[3])}
    assert failed == (set(requests) if stage == "forward" else {"v"}), (failed, ops)
    assert all(c[2] == "error" and "injected" in c[4] for c in done["v"][3]), done["v"]
    monkeypatch.undo()
    ref = unperturbed(path, requests)
    for rid in set(requests) - failed:
        assert [c[1] for c in done[rid][3]] == ref[rid], rid
    again = {f"again-{rid}": r for rid, r in requests.items()}
    done, ops = run_twins(fast, slow, again)
    assert {rid: [c[1] for c in o[3]] for rid, o in done.items()} == {f"again-{r}": t for r, t in ref.items()}
    assert any(op[2] == "fast" for op in ops), ops
    assert_paths_taken(fast, slow)


def test_a_stop_token_mid_batch_and_the_steps_after_it(checkpoints):
    """A greedy request stops on a stop id in the middle of a decode batch; its twin prompt with
    min_tokens past that point may not stop there (the stop id is held back) and goes on; the
    batch that is left keeps matching, and the fast path is taken again after the leaver."""
    path = checkpoints("bamba")
    probe = LLM(path[0], memory_budget_bytes=8 << 20)
    prompt = list(range(20, 31))
    base = probe.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[5]
    first = base.index(stop_id)
    assert first >= 2, base  # tiny random model: the seed gives a stop past the first tokens
    requests = bystanders(probe.model.vocab_size)
    requests["s"] = (prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id], logprobs=3))
    requests["m"] = (prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id],
                                            min_tokens=first + 2, ignore_eos=True))
    fast, slow = roomy_twins(path)
    done, ops = run_twins(fast, slow, requests)
    s, m = done["s"][3][0], done["m"][3][0]
    assert s[1] == base[:first + 1] and s[2] == "stop" and s[3] == stop_id, (s, base)
    assert m[1][:first] == base[:first] and stop_id not in m[1][:first + 2], (m, base)
    stopped = next(i for i, op in enumerate(ops) if "s" in op[3:])
    assert ops[stopped][2] == "fast", f"the stop did not happen in a fast step: {ops}"
    assert any(op[2] == "fast" for op in ops[stopped + 1:]), f"no fast step after the leaver: {ops}"
    assert fast.engine.scheduler.batches_cut > 0, "the batch after the leaver was not cut from the one before"
    assert len(ops) > stopped + 3 and fast.stats()["failed"] == 0
    assert_paths_taken(fast, slow)


def test_a_greedy_batch_cut_as_its_requests_finish(checkpoints):
    """Plain greedy requests (a stop id on some, EOS on, different lengths) leave a steady batch
    one or a few at a time: each such step cuts the batch to those left (their handle, positions,
    sampled input ids and stop rules cut too, nothing made again); both twins stay alike every
    step, and each request's tokens are those of an unperturbed run."""
    fast, slow = roomy_twins(checkpoints("bamba"))
    vocab, path = fast.model.vocab_size, fast.model_path
    rng = random.Random(3)
    requests = {f"g{i}": ([rng.randrange(4, vocab) for _ in range(rng.randint(3, 30))],
                          SamplingParams(max_tokens=rng.randint(4, 30), temperature=0.0,
                                         stop_token_ids=[rng.randrange(4, vocab)] if i % 3 == 0 else None))
                for i in range(8)}
    done, ops = run_twins(fast, slow, requests)
    assert fast.engine.scheduler.batches_cut >= 3, (fast.engine.scheduler.batches_cut, ops)
    ref = unperturbed(path, requests)
    assert {rid: [c[1] for c in o[3]] for rid, o in done.items()} == ref
    assert_paths_taken(fast, slow)


def test_switching_the_fast_path_off_and_on_mid_batch(checkpoints):
    """`carry_decode_batch` is a plain switch: turned off for a few steps of a steady batch (nobody
    joins or leaves) and on again, the fast twin still gives the slow twin's outputs and memory
    (the batch of the step before the switch is carried over)."""
    fast, slow = roomy_twins(checkpoints("bamba"))
    for rid, (prompt, params) in bystanders(fast.model.vocab_size).items():
        for llm in (fast, slow):
            llm.add_request(prompt, params, request_id=rid)
    ops = []
    for i in range(40):
        if not fast.has_unfinished_requests():
            break
        if ops and ops[-1][2] == "fast" and fast.engine.scheduler.carry_decode_batch and i < 9:
            fast.engine.scheduler.carry_decode_batch = False
            off = i
        elif i == 9:
            fast.engine.scheduler.carry_decode_batch = True
        step_twins(fast, slow, ops, i)
    assert off < 8 and [op[2] for op in ops[off:9]] == ["batch"] * (9 - off), ops
    assert ops[9][2] == "fast" and not slow.has_unfinished_requests(), ops
    assert_paths_taken(fast, slow)


def test_running_queue_version_changes_exactly_when_its_sequences_do():
    """The decode batch is kept while the running queue's `version` stays: every add and remove
    (pop included) moves it on, and nothing else does (refused adds, removes of what is not
    queued, peeks and walks that drop stale heap entries); one version, one set of sequences.
    Its `added` moves on exactly with an add (a batch may be cut while it stays)."""
    rng = random.Random(3)
    q, made, seen = SequenceQueue(), [], {}
    params = SamplingParams(max_tokens=4)
    for i in range(600):
        before, members, added = q.version, [(s.request_id, id(s)) for s in q], q.added
        op = rng.random()
        if op < 0.3 or not made:
            made.append(Request(f"s{i % 40}", [5, 6], params, priority=rng.randint(0, 2), arrival=float(i)))
            try:
                q.add(made[-1])
            except ValueError:  # an id already queued: refused, nothing changed
                pass
        elif op < 0.55:
            q.remove(rng.choice(made))  # queued, finished, or an impostor with a queued id
        elif op < 0.65 and len(q):
            q.pop()
        elif op < 0.8:
            q.peek()
            q.head(rng.randint(1, 5))
        else:
            assert len(q) == len(list(q)) and all(s in q for s in q)
        after = [(s.request_id, id(s)) for s in q]
        assert (q.version != before) == (after != members), (i, before, q.version, members, after)
        assert q.version >= before
        assert seen.setdefault(q.version, after) == after, (i, q.version)
        # `added` moves exactly when one joined: the same count, those queued are a subset of before
        assert (q.added != added) == any(m not in members for m in after) and q.added - added in (0, 1), i
    assert q.version > 100
