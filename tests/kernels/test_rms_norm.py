"""kernels/rms_norm.py: the C rows against the torch formulas (transformers' RMSNorm arithmetic) on
random inputs, both with native kernels on and forced off."""
import pytest
import torch

from native_paths import native_or_torch
from hybridkv.kernels import rms_norm as rn
from hybridkv.models.norms import GatedRMSNorm, RMSNorm


def _plain(x, w, eps, plus_one):
    """transformers' LlamaRMSNorm / Qwen3NextRMSNorm in float32."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return h * (1.0 + w) if plus_one else w * h


def _gated(y, z, w, eps, group, before):
    """transformers' MambaRMSNormGated (before=False) / Qwen3-Next's gated norm (before=True)."""
    def norm(h):
        g = h.view(*h.shape[:-1], -1, group)
        return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view(h.shape)
    if before:
        out = w * norm(y)
        return out if z is None else out * torch.nn.functional.silu(z)
    return w * norm(y if z is None else y * torch.nn.functional.silu(z))


path = native_or_torch("rms_norm")


def _weight(d, g):
    return torch.randn(d, generator=g) * 0.5 + 1.0


@pytest.mark.parametrize("plus_one", [False, True])
def test_rms_norm_rows(path, plus_one):
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 256), (7, 64), (3, 5, 48)]:
        x = torch.randn(*shape, generator=g) * 3
        w = _weight(shape[-1], g)
        torch.testing.assert_close(rn.rms_norm(x, w, 1e-5, plus_one), _plain(x, w, 1e-5, plus_one),
                                   rtol=2e-6, atol=2e-6)
    x = torch.randn(6, 96, generator=g)[:, 16:80]  # strided rows (a column slice of a wider output)
    w = _weight(64, g)
    torch.testing.assert_close(rn.rms_norm(x, w, 1e-6, plus_one), _plain(x, w, 1e-6, plus_one),
                               rtol=2e-6, atol=2e-6)


def test_add_rms_norm(path):
    g = torch.Generator().manual_seed(1)
    for n, d in [(1, 256), (33, 64)]:
        h, delta = torch.randn(n, d, generator=g), torch.randn(n, 2 * d, generator=g)[:, :d]
        w = _weight(d, g)
        h0 = h.clone()
        s, out = rn.add_rms_norm(h, delta, w, 1e-5)
        torch.testing.assert_close(s, h0 + delta, rtol=0, atol=0)
        torch.testing.assert_close(out, _plain(h0 + delta, w, 1e-5, False), rtol=2e-6, atol=2e-6)
        assert torch.equal(h, h0)  # the inputs stay as they were


@pytest.mark.parametrize("before", [False, True])
def test_gated_rms_norm(path, before):
    g = torch.Generator().manual_seed(2)
    # (600 x 512: past the size where the C loop hands over to torch)
    for shape, group in [((1, 512), 512), ((9, 128), 32), ((2, 3, 64), 16), ((600, 512), 256)]:
        y, z = torch.randn(*shape, generator=g) * 2, torch.randn(*shape, generator=g) * 2
        norm = GatedRMSNorm(shape[-1], group, eps=1e-5, norm_before_gate=before)
        with torch.no_grad():
            norm.weight.copy_(_weight(shape[-1], g))
            for gate in (z, None):
                torch.testing.assert_close(norm(y, gate), _gated(y, gate, norm.weight, 1e-5, group, before),
                                           rtol=3e-6, atol=3e-6)


def test_model_norm_modules_and_fallbacks(path):
    """RMSNorm.forward / add_forward on float32, bfloat16 and autograd inputs (the latter two
    always the torch formulas)."""
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(_weight(64, g))
        h, delta = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
        s, out = norm.add_forward(h, delta)
        torch.testing.assert_close(out, _plain(h + delta, norm.weight, 1e-6, False), rtol=2e-6, atol=2e-6)
        hb, db = h.bfloat16(), delta.bfloat16()
        sb, ob = RMSNorm(64, eps=1e-6).bfloat16().add_forward(hb, db)
        assert sb.dtype == ob.dtype == torch.bfloat16
        torch.testing.assert_close(ob.float(), _plain((hb + db).float(), torch.ones(64), 1e-6, False),
                                   rtol=2e-2, atol=2e-2)
    x = torch.randn(3, 64, generator=g, requires_grad=True)
    norm(x).sum().backward()  # the torch path: gradients flow
    assert x.grad is not None and torch.isfinite(x.grad).all()
