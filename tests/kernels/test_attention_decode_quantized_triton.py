"""The Triton decode attention over a quantized KV pool (kernels/attention_decode_quantized_triton.py),
interpreted, against the torch reference of the same arithmetic: the new K/V encoded by the layout's
torch path (the same bytes), the pool decoded by it with each request's new token put back at full
precision, attended by paged_attention_ref (within fp32 tolerance; and against the CPU's C kernel).
Random inputs of many magnitudes, blocks handed out shuffled, ragged lengths, GQA, window, soft cap,
sinks, split-KV, NaN rows, int8 and fp8. Tiny shapes: the interpreter is slow."""
import pytest
import torch

from hybridkv.cache_dtype import QuantLayout
from hybridkv.kernels import attention_decode_quantized_triton as adqt
from hybridkv.kernels import ops
from hybridkv.kernels.attention_decode_quantized_triton import quantized_decode_attention_triton
from hybridkv.kernels.attention_ref import paged_attention_ref
from quantized_pages import case, reference_pages, written_pool

pytestmark = pytest.mark.slow  # interpreted Triton


def run(q, fresh, pool, layout, slots, table, lens, scale, soft_cap=None, window=None, sinks=None):
    return quantized_decode_attention_triton(q, fresh, pool, layout, slots, table, torch.tensor(lens, dtype=torch.int32),
                                             scale, soft_cap, window, sinks, {})


@pytest.mark.parametrize("splits", [None, 4], ids=["by-rule", "4-splits"])
@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("lens,bs,hkv,group,d,window,soft_cap,sinks", [
    ([1, 17, 140, 5], 16, 2, 2, 32, None, None, False),
    ([33, 8, 64], 8, 1, 4, 32, 12, None, True),  # a window that starts inside a tile
    ([3, 29], 16, 2, 1, 12, None, 30.0, False),  # head_dim not a power of two
])
def test_quantized_decodes_match_the_reference(dtype, lens, bs, hkv, group, d, window, soft_cap, sinks, splits,
                                               monkeypatch):
    """Split-KV too (4 shares of the keys, some of them empty, merged: share 0 holds the new token
    and the sink)."""
    monkeypatch.setattr(adqt, "FORCE_SPLITS", splits)
    layout, pool, fresh, slots, q, table = case(lens, bs, hkv, group, d, dtype, seed=len(lens) + d)
    sink = torch.randn(hkv * group) * 2 if sinks else None
    before = pool.clone()
    out = run(q, fresh, pool, layout, slots, table, lens, 0.3, soft_cap, window, sink)
    assert torch.equal(pool, written_pool(layout, before, fresh, slots, bs))  # the new K/V, the torch bytes
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    want = paged_attention_ref(q, reference_pages(layout, before, fresh, slots, bs), qsl, seq_lens, table, 0.3,
                               sliding_window=window, soft_cap=soft_cap, sinks=sink)
    assert out.dtype == torch.float32 and not out.isnan().any()  # no NaN row (spare blocks, tails) is read
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    cpu = before.clone()  # the CPU's C kernel, the same op on the same inputs
    same = ops.quantized_decode_attention(q, fresh, cpu, layout, slots, table, seq_lens, 0.3, soft_cap, window,
                                          sink, {})
    assert torch.equal(cpu, pool)
    torch.testing.assert_close(out, same, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_a_nan_row_poisons_only_its_heads_and_a_nan_token_decodes_to_nan(dtype):
    """A key row holding a NaN (a NaN scale: its whole vector decodes to NaN) gives NaN for the query
    heads of that KV head in the request that reads it (as the C kernel); every other output matches
    the reference. A new V vector holding a NaN is written as a row that decodes to NaN, every other
    byte as the torch encode writes it; read at full precision, it makes NaN only its own column of
    its heads' outputs (as the reference)."""
    lens, bs, hkv, group, d = [20, 9], 8, 2, 2, 16
    layout, pool, fresh, slots, q, table = case(lens, bs, hkv, group, d, dtype, seed=3)
    blk = int(table[0, 1])
    vals = layout.decode(pool[blk])
    vals[0, 2, 1, 5] = float("nan")  # request 0's key at position 10, KV head 1 (query heads 2, 3)
    pool[blk] = layout.encode(vals)
    fresh[1, 1, 0, 0, 3] = float("nan")  # request 1's new V, head 0
    before = pool.clone()
    out = run(q, fresh, pool, layout, slots, table, lens, 0.25)
    assert bool(out[0, 2:].isnan().all()) and not out[0, :2].isnan().any()
    assert torch.equal(out[1].isnan().nonzero()[:, 1].unique(), torch.tensor([3]))
    assert torch.equal(out[1].isnan().nonzero()[:, 0].unique(), torch.tensor([0, 1]))
    want = written_pool(layout, before, fresh, slots, bs)
    s = int(slots[1])
    assert bool(layout.decode(pool[s // bs, 1, s % bs, 0][None]).isnan().all())
    pool[s // bs, 1, s % bs, 0] = want[s // bs, 1, s % bs, 0]  # (a NaN row's codes are not specified)
    assert torch.equal(pool, want)
    pages = reference_pages(layout, before, fresh, slots, bs)
    ref = paged_attention_ref(q, pages, torch.arange(3, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                              table, 0.25)
    torch.testing.assert_close(out[0, :2], ref[0, :2], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out[1], ref[1], rtol=2e-5, atol=2e-5, equal_nan=True)


def test_the_op_runs_it_on_the_triton_backend_and_refuses_without_writing(monkeypatch):
    """HYBRIDKV_BACKEND=triton: ops.quantized_decode_attention is this kernel (CUDA's column). Inputs it
    does not take (fresh not fp32, a pool of another row size): None, and the pool untouched."""
    lens, bs, hkv, group, d = [4, 26, 9], 8, 2, 2, 16
    layout, pool, fresh, slots, q, table = case(lens, bs, hkv, group, d, "int8", seed=11)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    monkeypatch.setenv("HYBRIDKV_BACKEND", "triton")
    before = pool.clone()
    assert ops.quantized_decode_attention(q, fresh.double(), pool, layout, slots, table, seq_lens, 0.3, None, None,
                                          None, {}) is None
    assert ops.quantized_decode_attention(q, fresh, pool, QuantLayout("int8", (8,), 0), slots, table, seq_lens, 0.3,
                                          None, None, None, {}) is None
    assert torch.equal(pool, before)
    out = ops.quantized_decode_attention(q, fresh, pool, layout, slots, table, seq_lens, 0.3, None, None, None, {})
    assert torch.equal(pool, written_pool(layout, before, fresh, slots, bs))
    want = paged_attention_ref(q, reference_pages(layout, before, fresh, slots, bs),
                               torch.arange(4, dtype=torch.int32), seq_lens, table, 0.3)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
