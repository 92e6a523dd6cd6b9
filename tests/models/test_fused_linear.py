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


def test_cpu_layout_is_transposed_with_the_same_values():
    """On CPU the buffer is [in, sum out] (parameters are transposed views of it); a single linear
    (o_proj, down_proj, lm_head) takes the same path. The products equal nn.Linear's up to the
    summation order."""
    torch.manual_seed(1)
    lins = [nn.Linear(16, n, bias=False) for n in (8, 24)]
    want = [lin.weight.detach().clone() for lin in lins]
    fused = FusedLinear(lins)
    weight, bias = fused.weight_bias()
    assert bias is None and weight.shape == (32, 16) and weight.t().is_contiguous()
    for lin, w in zip(lins, want):
        assert torch.equal(lin.weight, w) and lin.weight.data_ptr() != w.data_ptr()
    single = nn.Linear(16, 5)
    x = torch.randn(1, 16)
    ref = F.linear(x, single.weight.detach().clone(), single.bias.detach().clone())
    got = F.linear(x, *FusedLinear([single]).weight_bias())
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert single.weight.t().is_contiguous()
