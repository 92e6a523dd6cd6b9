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
@pytest.mark.parametrize("width", [16, 32])  # 32: the C copy compiled for rows of 32
def test_non_finite_rows_decode_to_nan_alone(dtype, width):
    needs_native()
    layout = QuantLayout(dtype, (4, width), 1)
    x = values((3,), (4, width), 1, 0)
    x[0, 1, 3], x[2, 3, 0] = float("nan"), float("-inf")
    got = quantize.decode(layout, quantize.encode(layout, x))
    want = layout.decode(layout.encode(x))
    assert bool(got[0, 1].isnan().all()) and bool(got[2, 3].isnan().all())
    keep = ~want.isnan()
    assert torch.equal(got[keep], want[keep]) and torch.equal(got.isnan(), want.isnan())


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("shape,row_dim", [((24, 3), 0), ((40, 8), 0), ((2, 37, 5), 1), ((24, 9), 0)])
def test_interleaved_rows_with_non_finite_values(dtype, shape, row_dim):
    """Rows interleaved in their item (a conv window's time steps: B of [A][L][B] up to 8 go through the
    vector sweeps, 9 through the row-by-row loop): the C bytes are the torch path's, and a row with a NaN
    or an infinity decodes to NaN alone."""
    needs_native()
    layout = QuantLayout(dtype, shape, row_dim)
    x = values((5,), shape, row_dim, 4)
    assert torch.equal(quantize.encode(layout, x), layout.encode(x))
    x = x.movedim(1 + row_dim, -1)  # [items, ..., L]: a row is x[i, ..., :]
    x[1, ..., 2, 3] = float("nan")
    x[3, ..., 0, 0] = float("inf")
    x = x.movedim(-1, 1 + row_dim)
    got = quantize.decode(layout, quantize.encode(layout, x))
    want = layout.decode(layout.encode(x))
    assert int(got.isnan().sum()) == 2 * shape[row_dim] * (shape[0] if row_dim and len(shape) == 3 else 1)
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


def _pool(layout, items, seed):
    """A pool of `items` encoded random items, [items, nbytes] (rows of very different magnitudes)."""
    return layout.encode(values((items,), layout.shape, layout.row_dim, seed))


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("shape,row_dim,group", [((8, 16, 32), 2, 1), ((48, 3), 0, 1), ((5, 7), 1, 3),
                                                 ((64,), 0, 4)])
def test_gather_decode_equals_decoding_the_indexed_items(dtype, shape, row_dim, group):
    """decode_gather reads runs of items in place: the values of the torch decode of those items."""
    needs_native()
    layout = QuantLayout(dtype, shape, row_dim)
    pool = _pool(layout, 40, 1).view(10, 4, layout.nbytes)  # any leading shape: items in order
    pool.view(40, -1)[7] = layout.encode(torch.full((1, *shape), float("nan")))[0]  # a NaN item
    src = torch.tensor([36, 0, 7, 20, 5]) if group == 1 else torch.tensor([37 - group, 0, 6, 20])
    out = torch.full((src.numel() * group, *shape), 123.0)
    got = quantize.decode_gather(layout, pool, src, group, out)
    want = layout.decode(pool.view(40, -1)[(src[:, None] + torch.arange(group)).reshape(-1)])
    assert got is out
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert bool(got.isnan().any()) == (7 in (src[:, None] + torch.arange(group)).reshape(-1).tolist())
    with native_cpu.forced_off():  # the torch path: the same values
        again = quantize.decode_gather(layout, pool, src, group, torch.zeros_like(out))
    assert torch.equal(again.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("shape,row_dim,group", [((8, 16, 32), 2, 1), ((48, 3), 0, 1), ((5, 7), 1, 3),
                                                 ((64,), 0, 2)])
def test_encode_scatter_equals_encoding_into_the_indexed_items(dtype, shape, row_dim, group):
    """encode_scatter writes runs of x's items into the pool's items: the bytes of the torch encode
    put there by indexing; every other item of the pool unchanged. A row holding a NaN: a NaN scale
    and the codes of quantize.encode (fp8's torch path writes +-0 and NaN codes there instead of
    0: the row decodes to NaN either way)."""
    needs_native()
    layout = QuantLayout(dtype, shape, row_dim)
    x = values((12,), shape, row_dim, 2)
    x[3].view(-1)[5] = float("nan")  # a row with a NaN
    x[4] = 0.0
    src = torch.tensor([0, 9, 3]) if group == 1 else torch.tensor([0, 9 - group, 3])
    dst = torch.tensor([30, 2, 11]) if group == 1 else torch.tensor([30, 2, 11])
    pool = _pool(layout, 40, 3)
    want = pool.clone()
    rows = x.reshape(12, -1)[(src[:, None] + torch.arange(group)).reshape(-1)].reshape(-1, *shape)
    want[(dst[:, None] + torch.arange(group)).reshape(-1)] = layout.encode(rows)
    c_rows = quantize.encode(layout, rows)
    nan_items = rows.reshape(rows.shape[0], -1).isnan().any(1)
    assert bool(nan_items.any()) == (3 in (src[:, None] + torch.arange(group)).reshape(-1).tolist())
    assert torch.equal(c_rows[~nan_items], want[(dst[:, None] + torch.arange(group)).reshape(-1)][~nan_items])
    want[(dst[:, None] + torch.arange(group)).reshape(-1)] = c_rows
    if bool(nan_items.any()):  # the NaN's row, and only it, decodes to NaN, as from the torch bytes
        got_nan, want_nan = layout.decode(c_rows[nan_items]), layout.decode(layout.encode(rows[nan_items]))
        assert int(got_nan.isnan().sum()) == shape[row_dim] and torch.equal(got_nan.isnan(), want_nan.isnan())
        assert torch.equal(got_nan.nan_to_num(), want_nan.nan_to_num())
    got = pool.clone()
    quantize.encode_scatter(layout, x, src, got.view(8, 5, -1), dst, group)
    assert torch.equal(got, want)
    with native_cpu.forced_off():  # the torch path
        again = pool.clone()
        quantize.encode_scatter(layout, x, src, again, dst, group)
    torch_want = pool.clone()
    torch_want[(dst[:, None] + torch.arange(group)).reshape(-1)] = layout.encode(rows)
    assert torch.equal(again, torch_want)


def test_gather_and_scatter_refuse_runs_outside():
    needs_native()
    layout = QuantLayout("int8", (4, 8), 1)
    pool = _pool(layout, 6, 4)
    before = pool.clone()
    with pytest.raises(IndexError):
        quantize.decode_gather(layout, pool, torch.tensor([0, 5]), 2, torch.empty(4, 4, 8))
    with pytest.raises(IndexError):
        quantize.decode_gather(layout, pool, torch.tensor([-1]), 1, torch.empty(1, 4, 8))
    x = values((3,), (4, 8), 1, 5)
    with pytest.raises(IndexError):
        quantize.encode_scatter(layout, x, torch.tensor([0, 2]), pool, torch.tensor([0, 1]), 2)  # leaves x
    with pytest.raises(IndexError):
        quantize.encode_scatter(layout, x, torch.tensor([0]), pool, torch.tensor([5]), 2)  # leaves the pool
    assert torch.equal(pool, before)  # nothing written
