"""The Triton row encode and decode (kernels/quant_rows_triton.py), interpreted, against the torch path
of hybridkv/cache_dtype.py, byte for byte: rows of values spread over many magnitudes, rows whose
products land on ties (x.5 for int8, halfway between e4m3 values for fp8, in the subnormal range
too), an all-zero row, and rows holding a NaN or an infinity (they decode to NaN)."""
import pytest
import torch
import triton
import triton.language as tl

from hybridkv.cache_dtype import QuantLayout
from hybridkv.kernels import quantize
from hybridkv.kernels.quant_rows_triton import decode_codes, encode_codes, row_amax, row_scale

pytestmark = pytest.mark.slow  # interpreted Triton


@triton.jit
def _encode_decode_rows(x_ptr, raw_ptr, raw_scale_ptr, fp8_values_ptr, y_ptr, L: tl.constexpr, L_PAD: tl.constexpr,
                        NBYTES: tl.constexpr, CODE_BYTES: tl.constexpr, FP8: tl.constexpr):
    """Row r of x [R, L] -> its item of raw [R, NBYTES], then decoded from those bytes into y [R, L]."""
    r = tl.program_id(0)
    offs = tl.arange(0, L_PAD)
    ok = offs < L
    x = tl.load(x_ptr + r * L + offs, mask=ok, other=0.0)
    amax, bad = row_amax(x, 0)
    scale, inv = row_scale(amax, bad, 448.0 if FP8 else 127.0)
    tl.store(raw_ptr + r * NBYTES + offs, encode_codes(x, inv, FP8), mask=ok)
    tl.store(raw_scale_ptr + r * (NBYTES // 4) + CODE_BYTES // 4, scale)
    codes = tl.load(raw_ptr + r * NBYTES + offs, mask=ok, other=0)
    tl.store(y_ptr + r * L + offs, decode_codes(codes, scale, fp8_values_ptr, FP8), mask=ok)


def rows(dtype, L, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, L, generator=g) * torch.exp(torch.empty(64, 1).uniform_(-30, 30, generator=g))
    top = 127.0 if dtype == "int8" else 448.0
    x[0] = 0.0
    x[1, 3], x[2, 0], x[3, 5] = float("nan"), float("inf"), -float("inf")
    x[4] = torch.linspace(-top, top, L)  # scale 1: the codes are the values rounded
    if dtype == "int8":
        x[5] = (torch.arange(L) - L // 2) + 0.5  # exact ties, even and odd neighbours
        x[5, 0] = top
    else:
        grid = quantize.fp8_values_table()[:0x7F].unique()  # the non-negative e4m3 values, then their midpoints
        mid = (grid[:-1] + grid[1:]) / 2
        x[5] = mid[torch.randint(0, len(mid), (L,), generator=g)] * torch.where(torch.rand(L, generator=g) < 0.5, -1, 1)
        x[5, 0] = top
        x[6] = mid[:L] if len(mid) >= L else x[6]  # the smallest midpoints: subnormal ties
        x[6, 0] = top
    return x


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("L", [37, 64])
def test_rows_encode_to_the_torch_bytes_and_decode_to_its_values(dtype, L):
    x = rows(dtype, L, seed=L)
    layout = QuantLayout(dtype, (L,), 0)
    raw = torch.zeros(x.shape[0], layout.nbytes, dtype=torch.uint8)
    y = torch.zeros_like(x)
    _encode_decode_rows[(x.shape[0],)](x, raw, raw.view(torch.float32), quantize.fp8_values_table(), y, L=L,
                                       L_PAD=triton.next_power_of_2(L), NBYTES=layout.nbytes,
                                       CODE_BYTES=layout.code_bytes, FP8=dtype == "fp8_e4m3")
    want = layout.encode(x)
    bad = torch.zeros(x.shape[0], dtype=torch.bool)
    bad[1:4] = True
    assert torch.equal(raw[~bad], want[~bad])  # codes, padding and scales
    assert bool(layout.decode(raw[bad]).isnan().all()) and bool(y[bad].isnan().all())  # (their codes: unspecified)
    assert torch.equal(y[~bad], layout.decode(want[~bad]))
