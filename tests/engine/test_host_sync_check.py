"""NoHostSync flags every kind of host sync a captured step must not have, and nothing else."""
import pytest
import torch

from hybridkv.scheduler.host_sync_check import HostSyncError, NoHostSync

X = torch.tensor([0.5, -1.0, 2.0, 0.0])
COUNTS = torch.tensor([1, 0, 2, 1])

PLANTED = {
    "item": lambda: X.sum().item(),
    "tolist": lambda: X.tolist(),
    "int": lambda: int(X[2]),
    "float": lambda: float(X[0]),
    "bool": lambda: bool(X[0] > 0),
    "numpy": lambda: X.numpy(),
    "python index": lambda: [1, 2, 3][COUNTS[0]],
    "nonzero": lambda: torch.nonzero(X),
    "boolean mask": lambda: X[X > 0],
    "masked_select": lambda: torch.masked_select(X, X > 0),
    "unique": lambda: torch.unique(COUNTS),
    "unique_consecutive": lambda: torch.unique_consecutive(COUNTS),
    "equal": lambda: torch.equal(X, X),
    "repeat_interleave": lambda: torch.repeat_interleave(X, COUNTS),
    "host data": lambda: X + torch.tensor([1.0, 2.0, 3.0, 4.0]),
    "device to host copy": lambda: torch.empty(4, device="meta").to("cpu"),
    "device to host copy_": lambda: torch.empty(4).copy_(torch.empty(4, device="meta")),
    "host to device copy": lambda: X.to("meta"),
    "host to device copy_": lambda: torch.empty(4, device="meta").copy_(X),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_each_host_sync_is_caught(name):
    with pytest.raises(HostSyncError, match="host sync inside a step"):
        with NoHostSync():
            PLANTED[name]()


def test_capturable_ops_pass_and_give_the_same_values():
    idx = torch.tensor([2, 0, 3])
    expected = (torch.repeat_interleave(X, COUNTS), X[idx], torch.where(X > 0, X, 0.0).cumsum(0),
                torch.sort(X).values, torch.topk(X, 2).indices)
    with NoHostSync():
        got = (torch.repeat_interleave(X, COUNTS, output_size=4), X[idx],
               torch.where(X > 0, X, 0.0).cumsum(0), torch.sort(X).values, torch.topk(X, 2).indices)
        y = torch.zeros(5)
        y.index_copy_(0, idx, X[:3])
        y[idx] = X[:3]
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert torch.equal(y[idx], X[:3])


def test_allow_lets_a_named_op_through_and_modes_leave_on_exit():
    with NoHostSync(allow={torch.Tensor.item, torch.ops.aten.item.default,
                           torch.ops.aten._local_scalar_dense.default}):
        assert X[2].item() == 2.0
    assert X.tolist() == [0.5, -1.0, 2.0, 0.0]  # outside: nothing is checked
    with pytest.raises(HostSyncError):
        with NoHostSync():
            X.tolist()
    assert X.sum().item() == 1.5  # the modes are gone after an error too
