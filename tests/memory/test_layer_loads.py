"""hybridkv/layer_loads.py: writes from the host run (CPU) or are waited on (CUDA) just before the
layer they fill is read; everything else settles them first."""
import pytest
import torch

from hybridkv.block_pool import BlockPool
from hybridkv.layer_loads import LayerLoads, LoadedLayers
from hybridkv.specs import AttentionSpec, RecurrentSpec
from hybridkv.state_pool import StatePool


def writer(log, t, value):
    def write():
        log.append(value)
        t.fill_(value)
    return write


def test_a_layers_writes_run_exactly_at_its_wait_and_settle_runs_the_rest():
    loads, log = LayerLoads(), []
    a, b = torch.zeros(2), torch.zeros(2)
    charged = []
    loads.load({0: writer(log, a, 1.0), 1: writer(log, b, 2.0)}, charged.append)
    assert log == [] and loads.pending and not a.any() and not b.any()
    loads.wait(1)
    assert log == [2.0] and not a.any() and bool((b == 2).all())
    loads.wait(1)  # nothing left for it
    assert log == [2.0]
    loads.settle()
    assert log == [2.0, 1.0] and bool((a == 1).all()) and not loads.pending
    assert len(charged) == 2 and all(s >= 0 for s in charged)  # each write's time, told when it ran


def test_reading_a_layer_through_loaded_layers_waits_on_that_layer_alone():
    loads, log = LayerLoads(), []
    tensors = {0: torch.zeros(3), 1: torch.zeros(3)}
    view = LoadedLayers(tensors, loads)
    loads.load({0: writer(log, tensors[0], 5.0), 1: writer(log, tensors[1], 6.0)})
    assert bool((view[0] == 5).all()) and log == [5.0] and not tensors[1].any()
    assert 1 in view and len(view) == 2 and list(view) == [0, 1]
    assert bool((view[1] == 6).all()) and not loads.pending


def rec_pool(**kw) -> StatePool:
    spec = RecurrentSpec(conv_shape=(3, 2), state_shape=(2, 2), dtype=torch.float32)
    return StatePool({0: spec, 1: spec}, 5, **kw)


def host(value):
    return ({i: torch.full((3, 2), value) for i in (0, 1)}, {i: torch.full((2, 2), value) for i in (0, 1)})


def test_a_second_promotion_into_the_same_slot_before_the_layer_runs_wins():
    p = rec_pool()
    p.from_host(2, *host(1.0))
    p.from_host(2, *host(2.0))  # (the slot freed and promoted into again, before any layer ran)
    assert not p.conv[0][2].any()  # nothing written yet
    p.loads.wait(0)
    assert bool((p.conv[0][2] == 2).all()) and bool((p.ssm[0][2] == 2).all()) and not p.conv[1][2].any()
    p.loads.wait(1)
    assert bool((p.ssm[1][2] == 2).all())


@pytest.mark.parametrize("read", ["copy", "to_host", "free"])
def test_state_pool_moves_and_reads_settle_pending_writes_first(read):
    p = rec_pool()
    p.allocate(), p.allocate()
    p.from_host(2, *host(3.0))
    if read == "copy":
        p.copy(2, 3)
        assert bool((p.ssm[1][3] == 3).all()) and bool((p.conv[0][3] == 3).all())
    elif read == "to_host":
        conv, ssm = p.to_host(2)
        assert bool((conv[1] == 3).all()) and bool((ssm[0] == 3).all())
    else:
        p.free(2)
    assert not p.loads.pending


def test_deferred_checkpoint_copies_of_a_promoted_slot_read_the_promoted_state():
    p = rec_pool()
    p.from_host(1, *host(4.0))
    with p.deferred_copies():
        p.copy(1, 3)
    assert bool((p.conv[1][3] == 4).all()) and bool((p.ssm[0][3] == 4).all())


def test_block_pool_scatter_waits_per_layer_and_gather_and_copy_settle_it():
    spec = AttentionSpec(num_kv_heads=1, head_dim=2, dtype=torch.float32)
    p = BlockPool({0: spec, 3: spec}, 6, 4)
    data = {i: torch.full((2, 2, 4, 1, 2), float(i + 1)) for i in (0, 3)}
    p.scatter([1, 4], data)
    assert not p.kv[0].any() and not p.kv[3].any()
    p.loads.wait(3)
    assert bool((p.kv[3][[1, 4]] == 4).all()) and not p.kv[0].any()
    p.scatter([2], {i: torch.full((1, 2, 4, 1, 2), 9.0) for i in (0, 3)})
    out = p.gather([1, 2])
    assert bool((out[0][0] == 1).all()) and bool((out[0][1] == 9).all()) and bool((out[3][1] == 9).all())
    p.scatter([5], {i: torch.full((1, 2, 4, 1, 2), 7.0) for i in (0, 3)})
    p.copy_block(5, 0)
    assert bool((p.kv[0][0] == 7).all()) and not p.loads.pending


def test_immediate_loads_write_at_once(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_IMMEDIATE_LOADS", "1")
    p = rec_pool()
    p.from_host(2, *host(1.5))
    assert not p.loads.pending and bool((p.conv[1][2] == 1.5).all())
