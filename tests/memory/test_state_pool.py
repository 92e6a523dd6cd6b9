"""StatePool: per-layer conv and state tensors, null slot 0, live/checkpoint kinds, copies, host."""
import contextlib
import random

import pytest
import torch

from hybridkv.specs import RecurrentSpec
from hybridkv.state_pool import CHECKPOINT, FREE, LIVE, NULL, StatePool


def pool(n=4):
    specs = {0: RecurrentSpec((6, 3), (2, 4, 8), torch.float16, torch.float32),  # Mamba2-like
             2: RecurrentSpec((5, 2), (), torch.float32)}  # short conv: window only
    return StatePool(specs, n)


def test_shapes_and_dtypes():
    p = pool()
    assert p.conv[0].shape == (4, 6, 3) and p.conv[0].dtype == torch.float16
    assert p.ssm[0].shape == (4, 2, 4, 8) and p.ssm[0].dtype == torch.float32
    assert p.conv[2].shape == (4, 5, 2) and 2 not in p.ssm


def test_kinds_null_slot_and_exhaustion():
    p = pool()
    assert p.kind == [NULL, FREE, FREE, FREE]
    a, b, c = p.allocate(LIVE), p.allocate(CHECKPOINT), p.allocate(LIVE)
    assert sorted([a, b, c]) == [1, 2, 3] and p.allocate() is None
    assert p.count(LIVE) == 2 and p.count(CHECKPOINT) == 1
    p.free(b)
    assert p.kind[b] == FREE and p.allocate(CHECKPOINT) == b
    p.mark(a, CHECKPOINT)
    assert p.count(CHECKPOINT) == 2
    with pytest.raises(RuntimeError):
        p.free(0)
    p.free(c)
    with pytest.raises(RuntimeError):
        p.free(c)


def test_copy_and_host_roundtrip():
    p = pool()
    for t in list(p.conv.values()) + list(p.ssm.values()):
        t.copy_(torch.randn(t.shape).to(t.dtype))
    p.copy(1, 3)
    conv, ssm = p.to_host(3)
    assert torch.equal(conv[0], p.conv[0][1]) and torch.equal(ssm[0], p.ssm[0][1]) and set(ssm) == {0}
    p.from_host(2, conv, ssm)
    p.loads.settle()  # (the writes wait for each layer's turn: hybridkv/layer_loads.py)
    assert torch.equal(p.conv[2][2], p.conv[2][1]) and torch.equal(p.ssm[0][2], p.ssm[0][1])
    assert not torch.equal(p.conv[0][0], p.conv[0][1])  # other slots untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_copies", [3, 12])  # few: one copy per slot; many: small slots gathered
def test_copies_on_byte_rows_equal_torch_copies(dtype, num_copies):
    """The CPU path (numpy views of the tensors' bytes) and the torch path (the GPU's) copy the
    same slots as torch indexing one copy at a time, deferred or not; every other slot untouched."""
    specs = {0: RecurrentSpec((4, 3), (3, 8, 8), dtype),  # 96 B and 768 B slots (fp32): gathered
             1: RecurrentSpec((5, 2), (40, 64), dtype),  # 10 KiB ssm slots: copied one by one
             3: RecurrentSpec((7, 3), (), dtype)}
    rng = random.Random(num_copies)
    for deferred in (False, True):
        rows, tensors = StatePool(specs, 32), StatePool(specs, 32)
        tensors._rows = None  # the torch path, as on a GPU
        assert rows._rows is not None and len(rows._rows) == 5
        for t, u in zip(rows._tensors(), tensors._tensors()):
            t.copy_(torch.randn(t.shape).to(dtype))
            u.copy_(t)
        ref = [t.clone() for t in rows._tensors()]
        live = rng.sample(range(1, 32), 8)
        free = [s for s in range(1, 32) if s not in live]
        copies = [(rng.choice(live), rng.choice(free)) for _ in range(num_copies)]
        for pool in (rows, tensors):
            with pool.deferred_copies() if deferred else contextlib.nullcontext():
                for src, dst in copies:
                    pool.copy(src, dst)
        for src, dst in copies:
            for t in ref:
                t[dst].copy_(t[src])
        for t, u, r in zip(rows._tensors(), tensors._tensors(), ref):
            assert torch.equal(t, r) and torch.equal(u, r)
