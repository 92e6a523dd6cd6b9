"""The C encode / decode of quantized cache rows (kernels/native/quantize.c) against the layout's
torch path (hybridkv/cache_dtype.py), on random inputs with rows of very different magnitudes:
the same bytes, the same values."""
import pytest
import torch

from hybridkv.cache_dtype import QuantLayout
from hybridkv.kernels import native_cpu, quantize


def needs_native():
    if not quantize.ENCODE.available():
        pytest.fail("the native quantize kernels did not build here")


def values(lead, shape, row_dim, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, *shape, generator=g)
    mag = [*lead, *(1 if d == row_dim else n for d, n in enumerate(shape))]
    x = x * torch.exp(torch.empty(mag).uniform_(-9, 9, generator=g))  # rows from ~1e-4 to ~1e4, subnormal codes too
    x.view(-1)[:3] = torch.tensor([0.0, -0.0, 1e-30])
    return x


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("shape,row_dim", [((8, 16, 32), 2), ((48, 3), 0), ((64,), 0), ((5, 7), 1),
                                           ((3, 5, 6), 1), ((2, 96), 1)])
def test_c_bytes_equal_the_torch_paths(dtype, shape, row_dim):
    needs_native()
    layout = QuantLayout(dtype, shape, row_dim)
    for seed in range(3):
        x = values((7,), shape, row_dim, seed)
        x[2] = 0.0  # an all-zero item
        raw = quantize.encode(layout, x)
        assert torch.equal(raw, layout.encode(x))
        assert torch.equal(quantize.decode(layout, raw), layout.decode(raw))


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_non_finite_rows_decode_to_nan_alone(dtype):
    needs_native()
    layout = QuantLayout(dtype, (4, 16), 1)
    x = values((3,), (4, 16), 1, 0)
    x[0, 1, 3], x[2, 3, 0] = float("nan"), float("-inf")
    got = quantize.decode(layout, quantize.encode(layout, x))
    want = layout.decode(layout.encode(x))
    assert bool(got[0, 1].isnan().all()) and bool(got[2, 3].isnan().all())
    keep = ~want.isnan()
    assert torch.equal(got[keep], want[keep]) and torch.equal(got.isnan(), want.isnan())


def test_every_fp8_code_round_trips_and_falls_back_without_native():
    """Each of the 254 finite e4m3 values (times a scale of 1) encodes to its own code; with native
    kernels off the torch path runs."""
    needs_native()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).to(torch.float32)
    finite = vals[~vals.isnan()]
    layout = QuantLayout("fp8_e4m3", (1,), 0)
    x = torch.stack([finite, torch.full_like(finite, 448.0)], dim=1).reshape(-1, 2, 1)  # rows of (v, 448)
    layout2 = QuantLayout("fp8_e4m3", (2,), 0)
    raw = quantize.encode(layout2, x.reshape(-1, 2))
    assert torch.equal(raw, layout2.encode(x.reshape(-1, 2)))
    assert torch.equal(quantize.decode(layout2, raw), x.reshape(-1, 2))
    with native_cpu.forced_off():
        assert torch.equal(quantize.encode(layout, x[:, 0]), layout.encode(x[:, 0]))
