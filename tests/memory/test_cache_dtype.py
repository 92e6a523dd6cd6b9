"""The quantized cache dtypes' codes and scales (hybridkv/cache_dtype.py) against a torch reference
of the same arithmetic written here, on random inputs with rows of very different magnitudes."""
import pytest
import torch

from hybridkv.cache_dtype import QuantLayout, check_cache_dtype, conv_layout, kv_layout, state_layout


def rows_of_many_magnitudes(lead, shape, row_dim, seed=0):
    """Random values whose rows (along row_dim) differ in scale by up to 1e4."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, *shape, generator=g)
    mag_shape = [*lead, *(1 if d == row_dim else n for d, n in enumerate(shape))]
    return x * torch.exp(torch.empty(mag_shape).uniform_(-4.6, 4.6, generator=g))


def reference(x, dtype, row_dim_abs):
    """Per row: scale = amax / top; code = round-to-nearest of x / scale in the code type."""
    top = 127.0 if dtype == "int8" else 448.0
    scale = x.abs().amax(dim=row_dim_abs, keepdim=True) / top
    q = x / torch.where(scale > 0, scale, torch.ones_like(scale))
    if dtype == "int8":
        q = q.round().clamp(-127, 127)
    else:
        q = q.to(torch.float8_e4m3fn).to(torch.float32)
    return q * scale


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("shape,row_dim", [((8, 16, 32), 2), ((48, 3), 0), ((64,), 0), ((5, 7), 1)])
def test_decode_of_encode_is_the_reference_rounding(dtype, shape, row_dim):
    layout = QuantLayout(dtype, shape, row_dim)
    x = rows_of_many_magnitudes((6,), shape, row_dim)
    raw = layout.encode(x)
    assert raw.dtype == torch.uint8 and raw.shape == (6, layout.nbytes)
    got = layout.decode(raw)
    want = reference(x, dtype, 1 + row_dim)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    # each row's largest value survives (to float32 rounding of amax / top x top); the bytes: one a
    # value (padded to 4) + a scale a row
    torch.testing.assert_close(got.abs().amax(dim=1 + row_dim), x.abs().amax(dim=1 + row_dim), rtol=1e-6, atol=0)
    n_rows = x[0].numel() // shape[row_dim]
    assert layout.nbytes == -(-x[0].numel() // 4) * 4 + 4 * n_rows


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_error_bound_per_row(dtype):
    """int8: within half a step (scale / 2) of every value; fp8 e4m3: within 1/16 of a value's
    magnitude for values above 2^-6 of the row's maximum (below, the subnormal range's step)."""
    layout = QuantLayout(dtype, (4, 64), 1)
    x = rows_of_many_magnitudes((10,), (4, 64), 1, seed=3)
    err = (layout.decode(layout.encode(x)) - x).abs()
    amax = x.abs().amax(dim=2, keepdim=True)
    if dtype == "int8":
        assert bool((err <= amax / 127 / 2 * (1 + 1e-5)).all())
    else:
        big = x.abs() >= amax * 2 ** -6
        assert bool((err[big] <= x.abs()[big] / 16 * (1 + 1e-5)).all())


def test_zero_rows_and_non_finite_rows_stay_in_their_row():
    layout = QuantLayout("int8", (3, 8), 1)
    x = torch.randn(2, 3, 8)
    x[0, 1] = 0.0
    x[1, 2, 5] = float("nan")
    x[1, 0, 0] = float("inf")
    got = layout.decode(layout.encode(x))
    assert torch.equal(got[0, 1], torch.zeros(8))
    assert bool(got[1, 2].isnan().all()) and bool(got[1, 0].isnan().all())
    torch.testing.assert_close(got[0, 0], reference(x[0, 0:1], "int8", 1)[0])
    assert bool(torch.isfinite(got[1, 1]).all())


def test_stochastic_rounding_is_unbiased_and_seeded():
    layout = QuantLayout("int8", (256,), 0)
    x = torch.randn(1, 256)
    g = torch.Generator().manual_seed(0)
    mean = torch.stack([layout.decode(layout.encode(x, g)) for _ in range(400)]).mean(0)
    step = x.abs().max() / 127
    nearest = (layout.decode(layout.encode(x)) - x).abs().mean()
    assert float((mean - x).abs().mean()) < float(nearest) / 4  # the mean of many draws beats one rounding
    assert float((mean - x).abs().max()) < float(step) / 4
    a = layout.encode(x, torch.Generator().manual_seed(5))
    assert torch.equal(a, layout.encode(x, torch.Generator().manual_seed(5)))


def test_layouts_per_kind_and_names():
    assert kv_layout(None, 64) is None and kv_layout("int8", 64).shape == (64,)
    assert conv_layout("int8", (48, 3)).row_dim == 0  # a time step across the channels
    assert conv_layout("int8", (2, 96)).row_dim == 1
    assert state_layout("fp8_e4m3", (8, 16, 32)).row_dim == 2
    assert state_layout("int8", ()) is None and conv_layout("int8", ()) is None
    assert check_cache_dtype("kv_cache_dtype", "auto") is None
    assert check_cache_dtype("kv_cache_dtype", "fp8_e4m3") == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype='fp16'.*int8"):
        check_cache_dtype("kv_cache_dtype", "fp16")
    with pytest.raises(ValueError, match="quantized cache dtype"):
        QuantLayout("int4", (8,), 0)
