"""The batched decode verbs (DecodeRows.allocate / commit / checkpoint, batched_checkpoints) against the
per-request ones (checkpoint_due, allocate, commit, checkpoint), on twin managers driven through
the same random runs: after every decode round both hold the same state, block for block and
slot for slot, and the same KV and state values; a third twin keeps its DecodeRows handle across
rounds while the same requests decode, as the engine's decode batch does. Random forks (shared
partial blocks: copy on write), finishes, small pools (blocks run short: the batched call leaves
those to allocate one by one) and a sliding-window group are in the runs."""
import random

import numpy as np
import pytest
import torch

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.request import Request
from hybridkv.specs import AttentionSpec, RecurrentSpec
from hybridkv.state_pool import StatePool

BS = 4
MODELS = {
    "hybrid": {0: RecurrentSpec((3, 2), (2, 4), torch.float32), 1: AttentionSpec(2, 4, torch.float32)},
    "attention": {1: AttentionSpec(2, 4, torch.float32)},
    "sliding hybrid": {0: RecurrentSpec((3, 2), (2, 4), torch.float32), 1: AttentionSpec(2, 4, torch.float32, 6),
                       2: AttentionSpec(1, 4, torch.float32)},
}


def twin(specs, blocks, policy):
    return HybridCacheManager(specs, BS, blocks, 10, checkpoint_policy=policy, fingerprint="t")


def model_writes(m, rid, slot, pos, value):
    """A model step's writes for one token: KV at its slot in every group, the live state."""
    for g in m.attention_groups.values():
        s = slot if g is m.attention else g.slot_mapping(rid, pos, pos + 1)[0]
        for t in g.pool.kv.values():
            t[s // BS, :, s % BS] = value
    live = m.live_slot(rid)
    for t in list(m.conv_states.values()) + list(m.ssm_states.values()):
        t[live] = value


def decode_one_by_one(m, rids, values):
    for rid, v in zip(rids, values):
        s = m.request(rid).num_computed_tokens
        due = m.prefix_cache.checkpoint_due(rid, s, s + 1)
        slots = m.allocate(rid, 1)
        if slots is None:
            continue
        model_writes(m, rid, slots[0], s, v)
        m.commit(rid, 1)
        if due is not None:
            m.prefix_cache.checkpoint(rid)


def decode_batched(m, rids, values, handle=None, continued=None):
    """One decode round through the batched verbs; with `handle` (a DecodeRows of rids kept from
    earlier rounds) as the engine's decode batch calls them: the handle, and the starts (the very
    array the last commit left, `handle.next`, when this round continues the last: then
    continued[0] counts it)."""
    starts = [m.request(r).num_computed_tokens for r in rids]
    given = starts
    if handle is not None:
        given = handle.next if handle.next is not None else np.asarray(starts, dtype=np.int64)
        assert given.tolist() == starts
        if given is handle.next:
            continued[0] += 1
    slots, due, done = (handle if handle is not None else m.decode_rows([m.request(r) for r in rids])).allocate(given)
    ready = [i for i, ok in enumerate(done) if ok]
    with m.prefix_cache.batched_checkpoints():
        for i in ready:
            model_writes(m, rids[i], slots[i], starts[i], values[i])
        if handle is not None and all(done):
            assert handle.commit(given) == {}
            for i in ready:
                if due[i]:
                    handle.checkpoint(i)
        else:
            assert m.decode_rows([m.request(rids[i]) for i in ready]).commit() == {}
            for i in ready:
                if due[i]:
                    m.prefix_cache.checkpoint(rids[i])
    decode_one_by_one(m, [r for r, ok in zip(rids, done) if not ok], [v for v, ok in zip(values, done) if not ok])
    return len(ready) < len(rids)


def snapshot(m):
    """Everything the manager and its pools hold, comparable across twins."""
    reqs = {rid: (r.num_computed_tokens, list(r.token_ids), list(r.block_hashes), r.num_hashed_blocks,
                  [list(g.block_ids(rid)) for g in m.attention_groups.values()], m.live_slot(rid))
            for rid, r in m.requests.items()}
    pools = [(list(g.pool.refcount), list(g.pool.free), dict(g.pool.cached), [t.clone() for t in g.pool.kv.values()])
             for g in m.attention_groups.values()]
    rec = None
    if m.recurrent is not None:
        rec = ({h: (c.slot, c.position, c.output) for h, c in m.recurrent.checkpoints.items()},
               list(m.recurrent.states.kind), [t.clone() for t in m.recurrent.states._tensors()])
    return reqs, pools, rec


def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("seed", range(6))
def test_batched_decodes_leave_the_same_state_as_one_by_one(model, seed):
    rng = random.Random(seed)
    blocks = rng.choice([14, 40])
    policy = rng.choice(["junctions", "every_n_blocks", "none"])
    a, b, c = (twin(MODELS[model], blocks, policy) for _ in range(3))  # c keeps its DecodeRows handle
    next_id, short, handle, reused, continued = 0, 0, None, 0, [0]
    for _ in range(40):
        op = rng.random()
        if not op >= 0.35 or not a.requests:
            handle = None  # a request joined, forked or left: the engine makes a new batch
        if op < 0.2 or not a.requests:  # admit and prefill a new prompt (shared starts: prefix hits)
            prompt = [rng.randrange(3) for _ in range(rng.randint(1, 3))] * rng.randint(1, 4)
            for m in (a, b, c):
                if m.admit(Request(next_id, list(prompt), max_tokens=30)) is not None:
                    n = len(prompt) - m.request(next_id).num_computed_tokens
                    slots = m.allocate(next_id, n)
                    if slots is None:
                        m.finish(next_id)
                    else:
                        for j, s in enumerate(slots):
                            model_writes(m, next_id, s, m.request(next_id).num_computed_tokens + j, 0.5 + j)
                        m.commit(next_id, n)
            next_id += 1
        elif op < 0.3:  # fork: the child shares the parent's partial block (copied on first write)
            parent = rng.choice(sorted(a.requests))
            for m in (a, b, c):
                m.fork(parent, m.request(parent).fork(next_id))
            next_id += 1
        elif op < 0.35:
            rid = rng.choice(sorted(a.requests))
            for m in (a, b, c):
                m.finish(rid)
        else:  # a decode round over every request whose tokens are all computed
            rids = [r for r in sorted(a.requests) if a.request(r).num_computed_tokens == len(a.request(r).token_ids)
                    and len(a.request(r).token_ids) < 60]
            toks = [rng.randrange(3) for _ in rids]
            for m in (a, b, c):
                for rid, t in zip(rids, toks):
                    m.append_tokens(rid, [t])
            values = [rng.random() for _ in rids]
            short += decode_batched(a, rids, values)
            decode_one_by_one(b, rids, values)
            if rids:
                if handle is not None and handle.req_ids == rids:
                    reused += 1
                else:
                    handle = c.decode_rows([c.request(r) for r in rids])
                if decode_batched(c, rids, values, handle, continued):
                    handle = None  # some went one by one (allocate): their blocks changed under the handle
            else:
                handle = None
        assert same(snapshot(a), snapshot(b)) and same(snapshot(a), snapshot(c))
    assert any(len(r.token_ids) > r.num_prompt_tokens + BS for r in a.requests.values()) or short
    assert reused, "a kept handle served later rounds"
    assert continued[0], "a round continued the handle's last one (the starts its commit left)"


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_batched_decode_short_of_blocks_leaves_the_rest_to_allocate_alone(model):
    """Two requests whose next token starts a block, one free block: the batched allocate gives it
    to one and leaves the other as it was (the scheduler allocates it alone, preempting as needed);
    the twins stay equal."""
    a, b = (twin(MODELS[model], 3, "none") for _ in range(2))
    for m in (a, b):
        for rid in (0, 1):
            m.admit(Request(rid, [rid + 1] * BS, max_tokens=8))
            slots = m.allocate(rid, BS)
            for j, s_ in enumerate(slots):
                model_writes(m, rid, s_, j, 0.5 + j)
            m.commit(rid, BS)
            m.append_tokens(rid, [7])
    free = [len(g.pool.free) for g in a.attention_groups.values()]
    assert decode_batched(a, [0, 1], [0.25, 0.75]), free  # one was left to allocate alone
    decode_one_by_one(b, [0, 1], [0.25, 0.75])
    assert same(snapshot(a), snapshot(b))
    assert sorted(a.request(r).num_computed_tokens for r in (0, 1)) == [BS, BS + 1]


@pytest.mark.parametrize("ssm_shape", [(2, 4), (64, 80)])  # small slots: gathered; 20 KiB: copied one by one
def test_deferred_copies_equal_copies_in_order(ssm_shape):
    """StatePool.deferred_copies: the copies at the exit, the same slots as copying each at once,
    a later copy into a slot winning (as in order)."""
    spec = {0: RecurrentSpec((3, 2), ssm_shape, torch.float32), 1: RecurrentSpec((2,), (), torch.float32)}
    rng = random.Random(0)
    for _ in range(20):
        now, later = StatePool(spec, 8), StatePool(spec, 8)
        for t, u in zip(now._tensors(), later._tensors()):
            t.copy_(torch.randn(t.shape))
            u.copy_(t)
        live = rng.sample(range(1, 8), 3)
        copies = [(rng.choice(live), rng.choice([s for s in range(1, 8) if s not in live])) for _ in range(5)]
        for src, dst in copies:
            now.copy(src, dst)
        with later.deferred_copies():
            for src, dst in copies:
                later.copy(src, dst)
            assert not any(torch.equal(t, u) for t, u in zip(now._tensors(), later._tensors())) or not copies
        assert all(torch.equal(t, u) for t, u in zip(now._tensors(), later._tensors()))
