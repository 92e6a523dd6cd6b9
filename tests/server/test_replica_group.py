"""ReplicaGroup (server/replica_group.py): snapshots sent rank to rank over gloo arrive bit-equal,
in order, with the header counting the bytes; a receive from a rank that sends nothing gives up
within its timeout. Two ranks in one process (a thread each), 127.0.0.1 only."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from hybridkv.server.replica_group import ReplicaGroup, SnapshotHeader, host_store
from hybridkv.snapshot import RequestSnapshot


def _groups(timeout: float = 20.0) -> list[ReplicaGroup]:
    store = host_store(30)
    groups: list = [None, None]

    def join(rank: int) -> None:
        groups[rank] = ReplicaGroup.join(store.port, rank, 2, 30, timeout)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(groups), "the two ranks did not meet"
    groups.append(store)  # keep the store alive as long as the groups
    return groups


def _snapshot(seed: int) -> RequestSnapshot:
    g = torch.Generator().manual_seed(seed)
    return RequestSnapshot(
        f"req-{seed}", [5, 6, 7, 8 + seed], 3, 4, 16,
        kv={1: torch.randn(2, 4, 2, 8, generator=g), 3: torch.randn(2, 3, 2, 8, generator=g).to(torch.bfloat16)},
        conv={0: torch.randn(32, 3, generator=g)}, ssm={0: torch.randn(4, 8, 16, generator=g).transpose(1, 2)},
        fingerprint="fp", block_size=16, sampling_state={"params": {"max_tokens": 16}}, kv_start={3: 1})


def test_snapshots_arrive_bit_equal_and_in_order():
    r0, r1, _ = _groups()
    snaps = [_snapshot(1), _snapshot(2)]
    sent = [r0.send_snapshot(s, 1) for s in snaps]  # both posted before either is received
    for (header, _), want in zip(sent, snaps):
        assert isinstance(header, SnapshotHeader) and header.src == 0
        assert header.snapshot.kv == {} and header.snapshot.ssm == {}  # the pipe carries no tensor
        assert header.nbytes == sum(t.numel() * t.element_size() for k in ("kv", "conv", "ssm")
                                    for t in getattr(want, k).values())
        got = r1.recv_snapshot(header)
        for kind in ("kv", "conv", "ssm"):
            a, b = getattr(got, kind), getattr(want, kind)
            assert a.keys() == b.keys()
            for layer in a:
                assert a[layer].dtype == b[layer].dtype and torch.equal(a[layer], b[layer])
        assert (got.req_id, got.token_ids, got.kv_start, got.sampling_state) == \
               (want.req_id, want.token_ids, want.kv_start, want.sampling_state)
    assert all(pending.wait() for _, pending in sent)


def test_a_receive_that_nothing_answers_gives_up_within_its_timeout():
    r0, r1, _ = _groups(timeout=1.0)
    header, _ = r0.send_snapshot(_snapshot(3), 1)
    r1.recv_snapshot(header)
    never_sent = SnapshotHeader(header.snapshot, [("ssm", 9, (4,), torch.float32)], 0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        r1.recv_snapshot(never_sent)
    assert time.monotonic() - t0 < 10
