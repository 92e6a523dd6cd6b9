"""FusedLinear (models/fused_linear.py): one matmul equal to the separate linears, and it follows
a parameter that is replaced or reloaded in place."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.models.fused_linear import FusedLinear


def _outputs(fused, x):
    return F.linear(x, *fused.weight_bias()).split(fused.sizes, -1)


def test_fused_matches_separate_and_follows_new_weights():
    torch.manual_seed(0)
    lins = [nn.Linear(8, n) for n in (4, 6, 2)]
    fused = FusedLinear(lins)
    x = torch.randn(3, 8)
    for got, lin in zip(_outputs(fused, x), lins):
        assert torch.allclose(got, lin(x), atol=1e-6)
    with torch.no_grad():
        lins[1].weight.copy_(torch.randn(6, 8))  # in place: lands in the fused buffer
    assert torch.allclose(_outputs(fused, x)[1], lins[1](x), atol=1e-6)
    lins[2].weight = nn.Parameter(torch.randn(2, 8))  # replaced: the buffer is rebuilt
    lins[0].bias = nn.Parameter(torch.randn(4))
    for got, lin in zip(_outputs(fused, x), lins):
        assert torch.allclose(got, lin(x), atol=1e-6)


def test_mixed_bias_and_widths_are_refused():
    with pytest.raises(ValueError, match="one input width"):
        FusedLinear([nn.Linear(8, 2), nn.Linear(7, 2)])
    with pytest.raises(ValueError, match="all have a bias"):
        FusedLinear([nn.Linear(8, 2), nn.Linear(8, 2, bias=False)])
