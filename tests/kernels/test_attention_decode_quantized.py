"""The C decode attention over a quantized KV pool (kernels/attention_decode_quantized.py) against
the torch reference of the same arithmetic: the pool decoded by the layout's torch path, each
request's new token put back at full precision, attended by paged_attention_ref (and, value for
value, by the float C kernel on those decoded pages). Random inputs, NaN rows, int8 and fp8."""
import pytest
import torch

from hybridkv.cache_dtype import QuantLayout
from hybridkv.kernels import attention_decode_quantized as adq
from hybridkv.kernels.attention_decode_native import NativeDecodes, attend_decodes
from hybridkv.kernels.attention_ref import paged_attention_ref
from quantized_pages import case, reference_pages, written_pool


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("lens,bs,hkv,group,d,window,soft_cap,sinks", [
    ([1, 17, 40, 5], 16, 2, 2, 64, None, None, False),
    ([33, 8, 64], 8, 1, 4, 32, 12, None, True),
    ([3, 29], 16, 2, 1, 12, None, 30.0, False),  # head_dim not a multiple of 8: the plain loops
])
def test_quantized_decodes_match_the_reference(dtype, lens, bs, hkv, group, d, window, soft_cap, sinks):
    layout, pool, fresh, slots, q, table = case(lens, bs, hkv, group, d, dtype, seed=len(lens) + d)
    assert adq.usable(pool, layout)
    sink = torch.randn(hkv * group) if sinks else None
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    T = len(lens)
    qsl = torch.arange(T + 1, dtype=torch.int32)
    dec = NativeDecodes.build(list(range(T)), qsl.tolist(), seq_lens, table)
    before = pool.clone()
    out = torch.full_like(q, 7.0)
    adq.attend_decodes_quantized(q, pool, layout, fresh, slots, dec, 0.3, soft_cap, window, sink, out)
    assert torch.equal(pool, written_pool(layout, before, fresh, slots, bs))  # the new K/V, written once
    pages = reference_pages(layout, before, fresh, slots, bs)
    want = paged_attention_ref(q, pages, qsl, seq_lens, table, 0.3, sliding_window=window, soft_cap=soft_cap,
                               sinks=sink)
    assert not out.isnan().any()  # no NaN row (spare blocks, unwritten tails) is read
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    same = torch.full_like(q, 7.0)  # the float kernel on the decoded pages: the same values exactly
    attend_decodes(q, pages, dec, 0.3, soft_cap, window, sink, same)
    assert torch.equal(out, same)


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_a_nan_key_row_poisons_only_its_heads(dtype):
    """A K row holding a NaN (a NaN scale: the head's whole vector decodes to NaN) gives NaN for the
    query heads of that KV head in the request that reads it, as the float kernel on the decoded
    pages does (the reference's softmax turns a NaN row into zeros); every other output matches
    the reference."""
    lens, bs, hkv, group, d = [20, 9], 8, 2, 2, 16
    layout, pool, fresh, slots, q, table = case(lens, bs, hkv, group, d, dtype, seed=3)
    blk = int(table[0, 1])
    vals = layout.decode(pool[blk])
    vals[0, 2, 1, 5] = float("nan")  # request 0's key at position 10, KV head 1 (query heads 2, 3)
    pool[blk] = layout.encode(vals)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(3, dtype=torch.int32)
    dec = NativeDecodes.build([0, 1], qsl.tolist(), seq_lens, table)
    out = torch.zeros_like(q)
    adq.attend_decodes_quantized(q, pool, layout, fresh, slots, dec, 0.25, None, None, None, out)
    pages = reference_pages(layout, pool, fresh, slots, bs)
    same = torch.zeros_like(q)
    attend_decodes(q, pages, dec, 0.25, None, None, None, same)
    assert bool(out[0, 2:].isnan().all()) and not out[0, :2].isnan().any() and not out[1].isnan().any()
    assert torch.equal(out.isnan(), same.isnan()) and torch.equal(out.nan_to_num(), same.nan_to_num())
    want = paged_attention_ref(q, pages, qsl, seq_lens, table, 0.25)
    torch.testing.assert_close(out[0, :2], want[0, :2], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out[1], want[1], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_the_new_tokens_are_encoded_into_their_slots(dtype):
    """The pool after the call: the bytes of the layout's encode of each new K and V vector at its
    slot (a NaN vector too: it decodes to NaN), every other byte unchanged; a slot outside the pool:
    ValueError and nothing written."""
    lens, bs, hkv, d = [5, 16, 30], 8, 2, 16
    layout, pool, fresh, slots, q, table = case(lens, bs, hkv, 1, d, dtype, seed=5)
    fresh[1, 1, 0, 0, 3] = float("nan")
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    dec = NativeDecodes.build([0, 1, 2], [0, 1, 2, 3], seq_lens, table)
    got = pool.clone()
    adq.attend_decodes_quantized(q, got, layout, fresh, slots, dec, 0.3, None, None, None, torch.zeros_like(q))
    want = written_pool(layout, pool, fresh, slots, bs)
    ok = ~fresh[:, :, 0].isnan().any(-1)  # [T, 2, hkv]: vectors without a NaN
    for t, s in enumerate(slots.tolist()):
        for p in range(2):
            for h in range(hkv):
                a, b = got[s // bs, p, s % bs, h], want[s // bs, p, s % bs, h]
                if ok[t, p, h]:
                    assert torch.equal(a, b)
                else:
                    assert bool(layout.decode(a[None])[0].isnan().all())
                    got[s // bs, p, s % bs, h] = b  # (fp8's torch codes differ in a NaN row)
    assert torch.equal(got, want)
    bad = slots.clone()
    bad[2] = pool.shape[0] * bs  # past the pool
    again = pool.clone()
    with pytest.raises(ValueError, match="outside the pool"):
        adq.attend_decodes_quantized(q, again, layout, fresh, bad, dec, 0.3, None, None, None, torch.zeros_like(q))
    assert torch.equal(again, pool)


def test_refused_where_it_cannot_run():
    layout = QuantLayout("int8", (16,), 0)
    pool = layout.empty((4, 2, 8, 2))
    assert adq.usable(pool, layout)
    assert not adq.usable(pool[:, :, :4], layout)  # not contiguous
    assert not adq.usable(torch.zeros(4, 2, 8, 2, 16), layout)  # float pages
    assert not adq.usable(pool, QuantLayout("int8", (8,), 0))  # another row size


def test_the_op_writes_then_attends_and_refuses_without_writing():
    """ops.quantized_decode_attention: the new K/V written as the torch encode writes them, the output of
    the float kernel over the decoded pages holding the new tokens at full precision; None with
    nothing written for a q it cannot take."""
    from hybridkv.kernels import ops

    lens, bs, hkv, group, d = [4, 26, 9], 8, 2, 2, 16
    layout, pool, fresh, slots, q, table = case(lens, bs, hkv, group, d, "int8", seed=11)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    before = pool.clone()
    assert ops.quantized_decode_attention(q.double(), fresh, pool, layout, slots, table, seq_lens, 0.3, None, None,
                                          None, {}) is None
    assert torch.equal(pool, before)
    out = ops.quantized_decode_attention(q, fresh, pool, layout, slots, table, seq_lens, 0.3, None, None, None, {})
    assert torch.equal(pool, written_pool(layout, before, fresh, slots, bs)) and not torch.equal(pool, before)
    dec = NativeDecodes.build([0, 1, 2], [0, 1, 2, 3], seq_lens, table)
    same = torch.zeros_like(q)
    attend_decodes(q, reference_pages(layout, before, fresh, slots, bs), dec, 0.3, None, None, None, same)
    assert torch.equal(out, same)
