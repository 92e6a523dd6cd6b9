"""Random sequences of admit / step / decode_all (the batched decode verbs) / fork / checkpoint /
finish / preempt / resume / migrate, through the coordinator, over models with full-attention KV, sliding-window KV and recurrent state,
and models whose attention layers mix a window and full attention (two groups, two pools).

A stand-in "model" writes, for every computed position p, a value that depends on the whole
prefix tokens[0..p] into the KV slots the manager hands out, and after each step the state
value of the whole prefix into the live slot. So any mix-up (a wrong prefix hit, a block
written while shared, a lost swap, a bad import) shows as a wrong value. After every rule:
block refcounts equal the block tables' references, every slot is free, live for one running
request or one checkpoint, every running request reads back its own values (a sliding-window
request: those of its window), and a sliding-window request holds at most ceil(w / bs) + 1 blocks.
Every chunk's batch (scheduler/batch_builder.py) derives the same write slots from the block tables
as allocate() and each group's memory hand out; a prefix probe answers the largest position every
kind accepts (a brute-force search over positions, against prefix_match.py's iteration).
With a host tier of checkpoints (memory/host_tier.py; some runs, and every run of the host-tier
machine): a key is in one tier at most, host bytes stay within the budget and equal the entries',
every host entry holds the state of its prefix, and hits promoted from the host read it back.
With a disk tier (memory/disk_tier.py; every run of the disk-tier machine, which also restarts the
manager on its directory): hits loaded from disk read back their prefix's KV and state, a hit is
as deep as the probe's (which sees every tier, host and disk included, without reading a file) or,
when the pools lack room for that, the device's own, and every file at the end holds its prefix's
values.
"""
import os
import shutil
import tempfile
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from hybridkv.request import RequestStatus
from hybridkv.snapshot_transfer import request_of
from hybridkv.cache_manager import HybridCacheManager
from hybridkv.errors import RequestTooLargeError
from hybridkv.sampling_params import SamplingParams
from hybridkv.memory.full_attention import NO_BLOCK
from hybridkv.scheduler.batch_builder import BatchBuilder
from hybridkv.scheduler.scheduler import ScheduledChunk
from hybridkv.request import Request
from hybridkv.plan import kv_bytes_per_block, state_bytes_per_slot
from hybridkv.specs import AttentionSpec, RecurrentSpec, with_cache_dtypes
from hybridkv.state_pool import CHECKPOINT, FREE, LIVE, NULL

EVENTS: Counter = Counter()  # what the runs exercised, so the test cannot pass by doing nothing
BASES = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [3, 3, 2, 2, 1, 1, 0, 0, 3, 3, 2, 2, 1, 1, 0, 0]]


def rolling(tokens):
    """r[n] summarises tokens[:n]: the stand-in for what a real model's KV and state depend on."""
    r = [7]
    for t in tokens:
        r.append((r[-1] * 31 + t + 1) % 1_000_003)
    return r


def values(t: torch.Tensor) -> torch.Tensor:
    """The pool tensor as float32 values: itself, or a quantized pool's bytes (codes and scales, a
    multiple of 4 per item) read as float32, so a test value fills them whole and comes back equal."""
    return t.view(torch.float32) if t.dtype == torch.uint8 else t


def kv_values(tokens, n):  # value at position p depends on tokens[0..p]
    return torch.tensor([v % 65521 + 1 for v in rolling(tokens[:n])[1:]], dtype=torch.float32)


def state_value(tokens, n):
    return float(rolling(tokens[:n])[-1] % 65519 + 2)


def held_from(group, rid):
    """Index of the request's first held block in an attention group (0 unless blocks left a window)."""
    ids = group.block_ids(rid)
    return next((i for i, b in enumerate(ids) if b != NO_BLOCK), len(ids))


def kv_of(mgr, group, r):
    """(first position, {layer: value per position from there to num_computed}) read back from
    the request's held blocks in one attention group."""
    out = {}
    n = r.num_computed_tokens
    mgr.loads.settle()
    first = held_from(group, r.request_id)
    for i, t in group.pool.kv.items():
        nb = -(-n // mgr.block_size)
        if nb == first:  # nothing computed, or a window of one token: no block to read
            continue
        g = values(t)[group.block_ids(r.request_id)[first:nb]]  # [nb - first, 2, bs, h, d]
        out[i] = g.permute(0, 2, 1, 3, 4).reshape((nb - first) * mgr.block_size, -1)[: n - first * mgr.block_size]
    return first * mgr.block_size, out


def write_step(mgr, rid, slot_mapping, start, end):
    """What a model step does: KV values at each attention group's slots (the lead group's are
    `slot_mapping`), the prefix's state in the live slot."""
    r = mgr.request(rid)
    vals = kv_values(r.token_ids, end)[start:end]
    bs = mgr.block_size
    mgr.loads.settle()  # as the model's reads through ModelCaches would (hybridkv/layer_loads.py)
    for group in mgr.attention_groups.values():
        slots = slot_mapping if group is mgr.attention else group.slot_mapping(rid, start, end)
        for s, v in zip(slots, vals.tolist()):
            if s < 0:
                continue
            b = s // bs
            rc = group.pool.refcount[b]
            assert rc == 1, f"write into block {b} of {group.name} with refcount {rc}"
            for t in group.pool.kv.values():
                values(t)[b, :, s % bs] = v
    slot = mgr.live_slot(rid)
    if slot:
        sv = state_value(r.token_ids, end)
        for t in list(mgr.conv_states.values()) + list(mgr.ssm_states.values()):
            values(t)[slot] = sv


def check_request_data(mgr, r):
    n = r.num_computed_tokens
    want = kv_values(r.token_ids, n)
    for group in mgr.attention_groups.values():
        first, kv = kv_of(mgr, group, r)
        window = getattr(group, "window", None)
        seen = 0 if window is None else max(first, n - window + 1)  # what the next token attends to
        if n:
            assert first <= group.first_needed_block(n) * mgr.block_size, "a block inside the window is gone"
        for i, got in kv.items():
            got = got[seen - first:]
            assert torch.equal(got, want[seen:, None].expand_as(got)), f"KV of request {r.request_id} layer {i} differs"
    slot = mgr.live_slot(r.request_id)
    if slot and n:
        sv = state_value(r.token_ids, n)
        for t in list(mgr.conv_states.values()) + list(mgr.ssm_states.values()):
            assert bool((values(t)[slot] == sv).all()), f"state of request {r.request_id} differs"


def check_conservation(mgr):
    running = [r for r in mgr.requests.values() if r.status == RequestStatus.RUNNING]
    for r in mgr.requests.values():
        if r.status != RequestStatus.RUNNING:
            assert all(g.block_ids(r.request_id) == [] for g in mgr.attention_groups.values())
            assert mgr.live_slot(r.request_id) == 0 and (r.swapped is not None) == (r.status == RequestStatus.SWAPPED)
    for w, group in mgr.attention_groups.items():
        pool, window = group.pool, w
        want = [0] * pool.num_blocks
        for r in running:
            ids = group.block_ids(r.request_id)
            assert len(ids) * mgr.block_size >= r.num_computed_tokens
            for b in ids:
                if b != NO_BLOCK:
                    want[b] += 1
            if ids:
                assert mgr.block_tables([r.request_id])[w][0, : len(ids)].tolist() == [max(b, 0) for b in ids]
            if window is not None:  # blocks that left the window were let go
                held = sum(b != NO_BLOCK for b in ids)
                assert held <= -(-window // mgr.block_size) + 1, (held, window, r.num_computed_tokens)
                EVENTS["sliding window held blocks bounded"] += held > 0
        assert pool.refcount == want
        assert set(pool.free) == {b for b in range(pool.num_blocks) if want[b] == 0}
    if mgr.recurrent is None:
        return
    states = mgr.recurrent.states
    live = [mgr.live_slot(r.request_id) for r in running]
    ckpt = [c.slot for c in mgr.recurrent.checkpoints.values()]
    assert len(set(live)) == len(live) and 0 not in live and len(set(ckpt)) == len(ckpt)
    assert not set(live) & set(ckpt)
    for s, kind in enumerate(states.kind):
        want_kind = NULL if s == 0 else LIVE if s in live else CHECKPOINT if s in ckpt else FREE
        assert kind == want_kind, f"slot {s} is {kind}, expected {want_kind}"
    assert states.num_free == states.kind.count(FREE)
    host = mgr.recurrent.host
    if host is not None:  # conservation per tier: one tier per key, the host's bytes within budget
        assert not set(mgr.recurrent.checkpoints) & set(host.entries), "a checkpoint in two tiers"
        assert host.used_bytes == sum(e.nbytes for e in host.entries.values())
        # swap holds host bytes too: exactly the swapped requests', within one budget with the entries
        assert set(host.swapped) == {r.request_id for r in mgr.requests.values() if r.status == RequestStatus.SWAPPED}
        assert host.swap_bytes == sum(host.swapped.values())
        kv = host.kv.used_bytes if host.kv is not None else 0  # the host KV tier shares the budget
        assert host.used_bytes + host.swap_bytes + kv <= host.budget_bytes
        if host.kv is not None:
            assert host.kv.used_bytes == sum(e.nbytes for e in host.kv.entries.values())
            for w, h in host.kv.entries:  # one tier at a time: a host KV block is not cached on the device
                assert h not in mgr.attention_groups[w].pool.cached, "a KV block in two tiers"


class ManagerMachine(RuleBasedStateMachine):
    force_host_tier = False
    force_caching = False  # (the pinned-turns machine: no pin without prefix caching)
    force_disk_tier = False

    @initialize(host_entries=st.sampled_from([0, 0, 0, 1, 4]),
                kind=st.sampled_from(["hybrid", "hybrid", "attention", "recurrent", "sliding", "sliding hybrid",
                                      "mixed", "mixed hybrid"]),
                window=st.sampled_from([1, 3, 5, 8]), bs=st.sampled_from([2, 4]),
                num_blocks=st.integers(6, 24), num_slots=st.integers(2, 6), caching=st.booleans(),
                policy=st.sampled_from(["none", "prompt_end", "every_n_blocks", "branch_points"]),
                eviction=st.sampled_from(["lru", "flop"]), other_bs=st.sampled_from([1, 3, 4]))
    def setup(self, host_entries, kind, window, bs, num_blocks, num_slots, caching, policy, eviction, other_bs):
        specs = {}
        if kind != "recurrent":
            specs[1] = AttentionSpec(1, 2, torch.float32, window if kind.startswith(("sliding", "mixed")) else None)
        if kind.startswith("mixed"):  # a full-attention layer beside the sliding one: two groups
            specs[3] = AttentionSpec(2, 1, torch.float32)
        if kind not in ("attention", "sliding"):
            specs[0] = RecurrentSpec((2, 2), (3,), torch.float32)
            specs[2] = RecurrentSpec((2, 1), (), torch.float32)
        # a third of the runs keep int8 pools (codes and scales, moved as bytes); chosen from a drawn
        # number rather than drawn, so the derandomized runs' other draws stay as they were
        quant = "int8" if num_blocks % 3 == 0 else None
        specs = with_cache_dtypes(specs, quant, quant)
        EVENTS["quantized pools"] += quant is not None
        kw = dict(enable_prefix_caching=caching, checkpoint_policy=policy, checkpoint_eviction=eviction,
                  fingerprint="sm", checkpoint_every_n=2)
        if self.force_host_tier:
            host_entries, caching = max(host_entries, 1), True
        if self.force_host_tier or self.force_caching:
            kw["enable_prefix_caching"] = True
        host = host_entries * state_bytes_per_slot(specs)
        if self.force_host_tier:  # room for KV blocks too (the host KV tier; pure attention gets a tier)
            host += host_entries * 3 * kv_bytes_per_block(specs, bs)
        if self.force_disk_tier:
            kw.update(enable_prefix_caching=True, disk_cache_dir=tempfile.mkdtemp(prefix="sm-disk-"))
        self.make = lambda: HybridCacheManager(specs, bs, num_blocks, num_slots, host_cache_bytes=host, **kw)
        self.mgr = self.make()
        self.other = HybridCacheManager(specs, other_bs, num_blocks * bs, 3, **kw)
        self.batches = BatchBuilder(self.mgr, "cpu")
        self.next_id = 0
        self.expected_ckpt = {}  # block hash -> state value of that prefix
        self.expected_kv = {}  # block hash -> the KV value of each of its positions

    def ids(self, status):
        return sorted(r for r, s in self.mgr.requests.items() if s.status == status)

    def record_prefix_states(self, r):
        bs = self.mgr.block_size
        for i, h in enumerate(r.block_hashes[: r.num_computed_tokens // bs]):
            self.expected_ckpt[h] = state_value(r.token_ids, (i + 1) * bs)
            if h not in self.expected_kv:
                self.expected_kv[h] = kv_values(r.token_ids, (i + 1) * bs)[i * bs:]

    def run_chunk(self, rid, n):
        """One scheduled chunk: cut at a due checkpoint, allocate, write, commit, checkpoint."""
        mgr = self.mgr
        r = mgr.request(rid)
        start = r.num_computed_tokens
        end = min(start + n, len(r.token_ids))
        due = mgr.prefix_cache.checkpoint_due(rid, start, end)
        end = due or end
        def memory():
            return [(list(g.block_ids(rid)), g.pool.num_free, list(g.pool.refcount))
                    for g in mgr.attention_groups.values()]
        before = memory()
        slots = mgr.allocate(rid, end - start)
        EVENTS["step"] += 1
        if slots is None:
            EVENTS["allocate refused"] += 1
            EVENTS["allocate refused with two attention groups"] += len(before) > 1
            assert before == memory(), "failed allocate changed state"
            return False
        assert len(slots) == end - start
        ids = mgr.block_ids(rid)
        EVENTS["copy-on-write"] += bool(start % mgr.block_size and ids) and ids[start // mgr.block_size] not in before[0][0]
        self.check_batch(rid, start, end, slots)
        write_step(mgr, rid, slots, start, end)
        mgr.commit(rid, end - start)
        self.record_prefix_states(r)
        if due is not None:
            EVENTS["checkpoint stored"] += mgr.prefix_cache.checkpoint(rid)
        return True

    def check_batch(self, rid, start, end, slots):
        """The packed batch of this one chunk: positions, lengths, and every group's slots derived
        from its block table equal the slots the manager's memories hand out."""
        mgr, r = self.mgr, self.mgr.request(rid)
        batch = self.batches.build([ScheduledChunk(r, start, end - start, slots)])
        assert batch.input_ids.tolist() == r.token_ids[start:end]
        assert batch.positions.tolist() == list(range(start, end)) and batch.seq_lens.tolist() == [end]
        assert batch.slot_mapping.tolist() == slots
        assert batch.has_initial_state.tolist() == [start > 0]
        assert batch.state_slots.tolist() == [mgr.live_slot(rid)]
        if len(mgr.attention_groups) > 1:
            for w, g in mgr.attention_groups.items():
                assert batch.kv_groups[w].slot_mapping.tolist() == g.slot_mapping(rid, start, end)
                EVENTS["batch slots checked per group"] += 1

    def probe_prefix(self, prompt, salt):
        """prefix_cache.usable_tokens is the largest position whose every piece some tier holds (each
        attention group's blocks there on the device, in the host KV tier or on disk; a state there on
        the device, the host or the disk), and changes nothing. Returns (the probe's tokens, the
        largest position every kind accepts on the device alone)."""
        mgr = self.mgr
        before = mgr.stats()
        got = mgr.prefix_cache.usable_tokens(prompt, salt)
        assert mgr.stats() == before
        want = device = 0
        if mgr.prefix_cache.enabled and len(prompt) > mgr.block_size:
            hashes = mgr.prefix_cache.prompt_hashes(prompt, salt)
            limit = min(len(hashes), (len(prompt) - 1) // mgr.block_size)
            device = max(m for m in range(limit + 1) if all(k.usable_prefix(hashes, m) == m for k in mgr.kinds))
            want = max(m for m in range(limit + 1) if self.every_tier_holds(hashes, m))
            want, device = want * mgr.block_size, device * mgr.block_size
        assert got == want, (got, want)
        EVENTS["probe found a prefix"] += got > 0
        EVENTS["probe found a prefix in a lower tier"] += got > device
        if got > device:
            reach = next(mgr.prefix_cache.tiers.reaches(hashes, limit))
            EVENTS["a probed hit mixes host and disk KV"] += any(reach.host_kv.values()) and any(reach.disk_kv.values())
        return got, device

    def every_tier_holds(self, hashes, m):
        """Brute force: every piece of a hit after m blocks is in some tier (m = 0: always)."""
        if m == 0:
            return True
        mgr, bs, disk, host_kv = self.mgr, self.mgr.block_size, self.mgr.disk, self.mgr.prefix_cache.host_kv
        for w, g in mgr.attention_groups.items():
            for i in range(g.first_needed_block(m * bs), m):
                if not (hashes[i] in g.pool.cached or host_kv is not None and (w, hashes[i]) in host_kv.entries
                        or disk is not None and disk.store.has(disk.kv_name(w, i, hashes[i]))):
                    return False
        rec, key = mgr.recurrent, hashes[m - 1]
        return rec is None or key in rec.checkpoints or rec.host is not None and key in rec.host.entries or \
            disk is not None and disk.store.has(disk.state_name(key, m * bs))

    @rule(base=st.integers(0, 1), plen=st.integers(1, 20), suffix=st.lists(st.integers(0, 3), max_size=3),
          max_tokens=st.integers(0, 12), salt=st.sampled_from([None, None, "t2"]), first=st.integers(1, 12),
          limit_new=st.booleans())
    def admit(self, base, plen, suffix, max_tokens, salt, first, limit_new):
        mgr = self.mgr
        prompt = (BASES[base] * 2)[:plen] + suffix
        rid = self.next_id
        self.next_id += 1
        num_new = first if limit_new else None
        probed, device = self.probe_prefix(prompt, salt)
        try:
            can = mgr.can_admit(Request(None, prompt, max_tokens=max_tokens, cache_salt=salt), num_new_tokens=num_new)
        except RequestTooLargeError:
            assert any(g._blocks_to_hold(len(prompt) + max_tokens) > g.num_blocks
                       for g in mgr.attention_groups.values())
            return
        r = Request(rid, prompt, max_tokens=max_tokens, cache_salt=salt)
        ahead = mgr.disk is not None and mgr.disk.reader is not None and rid % 2 == 0
        if ahead:  # every other admission promotes what the reader thread read, reading nothing itself
            sync = self.read_ahead(r)
        hit = mgr.admit(r, num_new_tokens=num_new)
        assert not ahead or mgr.disk.counters.sync_reads == sync, "the admission read what was read ahead"
        assert (hit is not None) == can
        if hit is None:
            return
        assert 0 <= hit < len(prompt) and hit % mgr.block_size == 0
        # the probe's depth, unless the pools lack room for it (then the device's own hit)
        assert device <= hit <= probed, (device, hit, probed)
        if mgr.disk is None and mgr.prefix_cache.host_kv is None:
            assert hit == probed, "admit takes the hit the probe announced"
        EVENTS["a lower tier deepened a hit as probed"] += hit == probed > device
        EVENTS["a lower tier's depth not taken (no room)"] += hit < probed
        EVENTS["prefix hit"] += hit > 0
        check_request_data(mgr, mgr.request(rid))  # the hit's blocks and copied state are this prefix's
        assert self.run_chunk(rid, min(first if limit_new else len(prompt), len(prompt) - hit)), \
            "allocate right after admit must succeed"

    def read_ahead(self, r):
        """The read-ahead rule until it lets r go (each job waited for: a condition wait): what the
        reader read is what the tiers list, so the admission then reads nothing on its own thread.
        Returns the count of reads on the step's thread."""
        pc, reader = self.mgr.prefix_cache, self.mgr.disk.reader
        sync = self.mgr.disk.counters.sync_reads
        while pc.waits_for_disk_read(r):
            EVENTS["disk read ahead"] += 1
            while reader.busy(r.request_id):
                reader.wait(30)
        assert self.mgr.disk.counters.sync_reads == sync and not reader.busy(r.request_id)
        return sync

    @precondition(lambda self: self.ids(RequestStatus.RUNNING))
    @rule(data=st.data(), n=st.integers(1, 8), tok=st.integers(0, 3))
    def step(self, data, n, tok):
        rid = data.draw(st.sampled_from(self.ids(RequestStatus.RUNNING)))
        r = self.mgr.request(rid)
        if r.num_computed_tokens == len(r.token_ids):  # decode: the sampled token comes first
            if len(r.token_ids) >= r.num_prompt_tokens + r.max_tokens:
                self.mgr.finish(rid)
                return
            self.mgr.append_tokens(rid, [tok])
        self.run_chunk(rid, n)

    @precondition(lambda self: self.ids(RequestStatus.RUNNING))
    @rule(tok=st.integers(0, 3))
    def decode_all(self, tok):
        """The engine's decode step: every running request one token short samples `tok` and
        decodes it through the batched verbs of a DecodeRows (one allocate, the model's writes, one
        commit, the checkpoints due under prefix_cache.batched_checkpoints); those its allocate leaves go one
        by one. Its answers equal the per-request verbs' (prefix_cache.checkpoint_due, allocate)."""
        mgr = self.mgr
        rids = []
        for rid in self.ids(RequestStatus.RUNNING):
            r = mgr.request(rid)
            if r.num_computed_tokens == len(r.token_ids) < r.num_prompt_tokens + r.max_tokens:
                mgr.append_tokens(rid, [tok])
            if len(r.token_ids) - r.num_computed_tokens == 1:
                rids.append(rid)
        if not rids:
            return
        starts = [mgr.request(rid).num_computed_tokens for rid in rids]
        want_due = [mgr.prefix_cache.checkpoint_due(rid, s, s + 1) is not None for rid, s in zip(rids, starts)]
        before = {rid: [list(g.block_ids(rid)) for g in mgr.attention_groups.values()] for rid in rids}
        slots, due, done = mgr.decode_rows([mgr.request(r) for r in rids]).allocate(starts)
        ready = [i for i, ok in enumerate(done) if ok]
        with mgr.prefix_cache.batched_checkpoints():
            for i in ready:
                rid, s = rids[i], starts[i]
                assert due[i] == want_due[i]
                assert mgr.allocate(rid, 1) == [slots[i]], "the batched allocate gave another slot than allocate"
                self.check_batch(rid, s, s + 1, [slots[i]])
                write_step(mgr, rid, [slots[i]], s, s + 1)
            assert mgr.decode_rows([mgr.request(rids[i]) for i in ready]).commit() == {}
            for i in ready:
                r = mgr.request(rids[i])
                assert r.num_computed_tokens == starts[i] + 1
                self.record_prefix_states(r)
                if due[i]:
                    EVENTS["checkpoint stored by a batched decode"] += mgr.prefix_cache.checkpoint(rids[i])
        EVENTS["batched decode"] += len(ready)
        EVENTS["batched decode allocated a block"] += sum(
            1 for i in ready if [len(b) for b in before[rids[i]]] != [len(g.block_ids(rids[i]))
                                                                        for g in mgr.attention_groups.values()])
        for i, ok in enumerate(done):
            if not ok:  # left as it was: the scheduler allocates it alone (preempting as needed)
                EVENTS["batched decode left one to allocate alone"] += 1
                assert before[rids[i]] == [list(g.block_ids(rids[i])) for g in mgr.attention_groups.values()]
                self.run_chunk(rids[i], 1)

    @precondition(lambda self: self.ids(RequestStatus.RUNNING))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.ids(RequestStatus.RUNNING)))
        child = self.next_id
        self.next_id += 1
        if self.mgr.fork(parent, self.mgr.request(parent).fork(child)):
            p, c = self.mgr.request(parent), self.mgr.request(child)
            cb, pb = self.mgr.block_ids(child), self.mgr.block_ids(parent)
            assert cb == pb[: len(cb)] and c.num_computed_tokens == p.num_computed_tokens
            EVENTS["fork"] += 1
            check_request_data(self.mgr, c)

    @precondition(lambda self: self.ids(RequestStatus.RUNNING))
    @rule(data=st.data())
    def explicit_checkpoint(self, data):
        rid = data.draw(st.sampled_from(self.ids(RequestStatus.RUNNING)))
        nc = self.mgr.request(rid).num_computed_tokens
        if nc and nc % self.mgr.block_size == 0:
            self.mgr.prefix_cache.checkpoint(rid)

    @precondition(lambda self: self.mgr.requests)
    @rule(data=st.data())
    def finish(self, data):
        self.mgr.finish(data.draw(st.sampled_from(sorted(self.mgr.requests))))

    @precondition(lambda self: self.ids(RequestStatus.RUNNING))
    @rule(data=st.data(), mode=st.sampled_from(["recompute", "swap"]))
    def preempt(self, data, mode):
        rid = data.draw(st.sampled_from(self.ids(RequestStatus.RUNNING)))
        used = self.mgr.preempt(rid, mode)
        if used != mode:  # a swap the host budget could not hold (memory/host_tier.py)
            assert mode == "swap" and used == "recompute" and self.mgr.recurrent.host is not None
            EVENTS["swap refused by the host budget"] += 1
        assert self.mgr.request(rid).status == (RequestStatus.WAITING if used == "recompute" else RequestStatus.SWAPPED)

    @precondition(lambda self: self.ids(RequestStatus.WAITING) or self.ids(RequestStatus.SWAPPED))
    @rule(data=st.data())
    def resume(self, data):
        rid = data.draw(st.sampled_from(self.ids(RequestStatus.WAITING) + self.ids(RequestStatus.SWAPPED)))
        was_swapped = self.mgr.request(rid).status == RequestStatus.SWAPPED
        nc = self.mgr.request(rid).num_computed_tokens
        got = self.mgr.resume(rid)
        if got is not None:
            EVENTS["resumed after swap" if was_swapped else "resumed by recompute"] += 1
            assert got == nc if was_swapped else got % self.mgr.block_size == 0
            check_request_data(self.mgr, self.mgr.request(rid))

    @precondition(lambda self: self.ids(RequestStatus.RUNNING))
    @rule(data=st.data())
    def migrate(self, data):
        """Export, import into a second manager (another block size), check, and move back home."""
        rid = data.draw(st.sampled_from(self.ids(RequestStatus.RUNNING)))
        snap = self.mgr.export_snapshot(rid)
        if self.other.import_snapshot(snap, request_of(snap, "away")):
            EVENTS["imported elsewhere"] += 1
            check_request_data(self.other, self.other.request("away"))
            self.other.finish("away")
        assert self.other.stats().kv_blocks_used == 0 and self.other.stats().slots_live == 0
        self.mgr.finish(rid)
        if self.mgr.import_snapshot(snap, request_of(snap)):
            check_request_data(self.mgr, self.mgr.request(rid))
        else:  # only when a fork still holds the blocks it released
            part = {"kv": snap.kv, "kv_start": snap.kv_start, "conv": snap.conv, "ssm": snap.ssm}
            nc = snap.num_computed_tokens
            assert not all(k.can_import(part, nc, len(snap.token_ids)) for k in self.mgr.kinds)

    @rule()
    def finish_all(self):
        for rid in sorted(self.mgr.requests):
            self.mgr.finish(rid)
        s = self.mgr.stats()
        assert s.kv_blocks_used == 0 and s.slots_live == 0 and s.running_requests == 0

    @invariant()
    def conservation_and_data(self):
        if not hasattr(self, "mgr"):
            return
        EVENTS["rule"] += 1
        if self.mgr.disk is not None:  # queued writes land before the next rule reads them
            self.mgr.disk.flush()
        EVENTS["checked with two attention groups"] += len(self.mgr.attention_groups) > 1
        check_conservation(self.mgr)
        for r in self.mgr.requests.values():
            if r.status == RequestStatus.RUNNING:
                check_request_data(self.mgr, r)
        for h, c in (self.mgr.recurrent.checkpoints.items() if self.mgr.recurrent else ()):  # never change
            for t in list(self.mgr.conv_states.values()) + list(self.mgr.ssm_states.values()):
                assert bool((values(t)[c.slot] == self.expected_ckpt[h]).all()), "a checkpoint's state changed"
        host = self.mgr.recurrent.host if self.mgr.recurrent else None
        for h, e in (host.entries.items() if host is not None else ()):  # a host copy is its prefix's state
            for t in list(e.conv.values()) + list(e.ssm.values()):
                assert bool((values(t) == self.expected_ckpt[h]).all()), "a host entry's state differs"
            EVENTS["host entry checked"] += 1
        host_kv = self.mgr.prefix_cache.host_kv
        for (w, h), e in (host_kv.entries.items() if host_kv is not None else ()):  # its block's values
            for x in e.kv.values():
                want = self.expected_kv[h].view(1, -1, *[1] * (values(x).dim() - 2)).expand_as(values(x))
                assert torch.equal(values(x), want), "a host KV entry holds other values"
            EVENTS["host KV entry checked"] += 1

    def teardown(self):
        if hasattr(self, "mgr"):
            host = self.mgr.stats().tiers.get("host")
            if host:
                EVENTS["host promotion"] += host.get("promotions", 0)
                EVENTS["host demotion"] += host.get("demotions", 0)
                EVENTS["host eviction"] += host.get("evictions", 0)
                EVENTS["host KV promotion"] += host.get("kv_promotions", 0)
                EVENTS["host KV demotion"] += host.get("kv_demotions", 0)
            self.finish_all()
            if self.mgr.disk is not None:
                self.count_disk_events()
                self.mgr.close()
                self.check_disk_files()
                shutil.rmtree(os.path.dirname(self.mgr.disk.store.dir), ignore_errors=True)

    def count_disk_events(self):
        disk = self.mgr.stats().tiers["disk"]
        assert disk["refused_corrupt"] == disk["write_errors"] == disk["dropped_writes"] == 0, disk
        EVENTS["disk hit"] += disk["hits"]
        EVENTS["disk state promotion"] += disk["promotions"]
        EVENTS["disk KV promotion"] += disk["kv_promotions"]
        EVENTS["disk write"] += disk["demotions"] + disk["kv_demotions"]
        EVENTS["disk read on the reader thread"] += disk["background_reads"]
        EVENTS["disk read on the step"] += disk["sync_reads"]
        assert self.mgr.disk.reader.staged_bytes == 0, "staged bytes outlived their requests"

    def check_disk_files(self):
        """Every file on disk decodes, and holds the values of its prefix (state) or block (KV)."""
        disk = self.mgr.disk
        for name in disk.store.names():
            kind, rest = name.split("-", 1)
            key = bytes.fromhex(rest.rsplit("-", 1)[1][:-len(".hkv")])
            position = int(rest.split("-")[0]) if kind == "state" else (int(rest.split("-")[1]) + 1) * self.mgr.block_size
            if kind == "state":
                t = disk.store.read(name, kind, key, position, disk._state_layout)
                want = [torch.full_like(values(x), self.expected_ckpt[key]) for x in t.values()]
            else:
                window = None if rest.startswith("full") else int(rest.split("-")[0][1:])
                t = disk.store.read(name, kind, key, position, disk._kv_layout[window])
                want = [self.expected_kv[key].view(1, -1, *[1] * (values(x).dim() - 2)).expand_as(values(x))
                        for x in t.values()]
            assert t is not None, name
            for x, w in zip(t.values(), want):
                assert torch.equal(values(x), w), f"disk entry {name} holds other values"
            EVENTS["disk file checked"] += 1

class HostTierMachine(ManagerMachine):
    """The same machine with a host tier on every run (and prefix caching on)."""

    force_host_tier = True


class DiskTierMachine(ManagerMachine):
    """The same machine with a disk tier on every run (in a fresh directory) and a rule that
    restarts the manager on it: every request ends, the manager is closed, and a new one on the
    same directory continues; hits it loads from disk are checked like any other (KV and state
    read back as the prefix's values), and at the end every file holds its prefix's values."""

    force_disk_tier = True

    @rule()
    def restart(self):
        self.finish_all()
        self.count_disk_events()
        self.mgr.close()
        self.mgr = self.make()
        self.batches = BatchBuilder(self.mgr, "cpu")
        EVENTS["restart"] += 1


@pytest.mark.slow  # long: 320 examples of 60 steps
def test_manager_state_machine():
    EVENTS.clear()
    # The runs depend on the hash order of the process (PYTHONHASHSEED), not only on the seed:
    # a checkpoint stored by a batched decode, and a batched decode that left a row to allocate
    # alone, appeared in some processes and not in others (CI twice; a local run once), so they
    # are counted but not required here; tests/memory/test_batched_decodes.py checks both against
    # the one-by-one verbs deterministically
    run_state_machine_as_test(ManagerMachine, settings=settings(
        max_examples=360, stateful_step_count=60, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))
    print(dict(EVENTS))
    assert EVENTS["rule"] >= 10_000, EVENTS
    for what in ["prefix hit", "allocate refused", "copy-on-write", "checkpoint stored", "resumed after swap",
                 "resumed by recompute", "imported elsewhere", "fork", "sliding window held blocks bounded",
                 "checked with two attention groups", "batch slots checked per group", "probe found a prefix",
                 "batched decode", "batched decode allocated a block", "quantized pools"]:
        assert EVENTS[what] > 0, f"the random runs never exercised {what}: {EVENTS}"


# long (~8 s: 100 examples of 50 steps); the fast tier keeps the host tier's unit tests
# (tests/memory/test_host_tier.py) and its engine tests (tests/engine/test_memory_tiers.py)
@pytest.mark.slow
def test_manager_state_machine_with_host_tier():
    EVENTS.clear()
    run_state_machine_as_test(HostTierMachine, settings=settings(
        max_examples=100, stateful_step_count=50, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))
    print(dict(EVENTS))
    for what in ["host demotion", "host promotion", "host eviction", "host entry checked", "prefix hit",
                 "swap refused by the host budget", "resumed after swap", "host KV demotion",
                 "host KV promotion", "host KV entry checked"]:
        assert EVENTS[what] > 0, f"the random runs never exercised {what}: {EVENTS}"


@pytest.mark.slow  # long (~35 s): 200 examples of 40 steps, files written and read
def test_manager_state_machine_with_disk_tier():
    EVENTS.clear()
    run_state_machine_as_test(DiskTierMachine, settings=settings(
        max_examples=200, stateful_step_count=40, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))
    print(dict(EVENTS))
    for what in ["restart", "disk write", "disk hit", "disk state promotion", "disk KV promotion",
                 "disk read ahead", "disk read on the reader thread", "disk read on the step",
                 "a lower tier deepened a hit as probed", "disk file checked", "prefix hit", "quantized pools"]:
        assert EVENTS[what] > 0, f"the random runs never exercised {what}: {EVENTS}"
