"""write_kv: the reference against a per-token loop, the Triton kernel (interpreted) against the
reference, and the round trip write_kv -> paged_attention against SDPA on contiguous KV."""
import pytest
import torch
import torch.nn.functional as F

import hybridkv.kernels as K
from hybridkv.kernels.attention_ref import paged_attention_ref, write_kv_ref
from hybridkv.kernels.write_kv_kernel import write_kv_triton


def make_inputs(t, bs, hkv, d, dtype, seed=0, num_blocks=6):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=g).to(dtype)
    # a strided k (a slice of a wider tensor), as a fused qkv projection hands it over
    k = torch.randn(t, hkv, 2 * d, generator=g).to(dtype)[..., :d]
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * bs, generator=g)[:t].long()
    slots[::3] = -1  # padding rows
    return k, v, cache, slots


def loop_oracle(k, v, cache, slots):
    out = cache.clone()
    bs = cache.shape[2]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[s // bs, 0, s % bs] = k[t]
            out[s // bs, 1, s % bs] = v[t]
    return out


@pytest.mark.parametrize("bs", [16, 32])
def test_ref_matches_loop(bs):
    k, v, cache, slots = make_inputs(11, bs, 2, 64, torch.float32, seed=bs)
    want = loop_oracle(k, v, cache, slots)
    got = write_kv_ref(k, v, cache, slots)
    assert got is cache
    assert torch.equal(cache, want)


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bs,hkv,d", [(16, 2, 64), (32, 1, 128), (16, 3, 80)])
def test_triton_matches_ref(dtype, bs, hkv, d):
    k, v, cache, slots = make_inputs(13, bs, hkv, d, dtype, seed=d)
    want = write_kv_ref(k, v, cache.clone(), slots)
    before = cache.clone()
    write_kv_triton(k, v, cache, slots)
    assert torch.equal(cache, want)  # a copy: bit-exact
    assert not torch.equal(cache, before)


@pytest.mark.slow  # interpreted Triton
def test_public_api_dispatches(monkeypatch):
    k, v, cache, slots = make_inputs(9, 16, 2, 64, torch.float16, seed=4)
    want = loop_oracle(k, v, cache, slots)
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        c = cache.clone()
        K.write_kv(k, v, c, slots)
        assert torch.equal(c, want), backend


def test_round_trip_through_block_table_matches_sdpa():
    # slots from the design's formula: block_table[r, pos // bs] * bs + pos % bs
    g = torch.Generator().manual_seed(1)
    bs, hkv, group, d, seq = 16, 2, 4, 64, 37
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    cache = torch.randn(8, 2, bs, hkv, d, generator=g)
    q = torch.randn(seq, hkv * group, d, generator=g)
    k = torch.randn(seq, hkv, d, generator=g)
    v = torch.randn(seq, hkv, d, generator=g)
    pos = torch.arange(seq)
    slots = table[0, pos // bs].long() * bs + pos % bs
    K.write_kv(k[:30], v[:30], cache, slots[:30])  # prefill of 30 tokens
    K.write_kv(k[30:], v[30:], cache, slots[30:])  # then 7 more
    out = paged_attention_ref(q[-7:], cache, torch.tensor([0, 7], dtype=torch.int32),
                              torch.tensor([seq], dtype=torch.int32), table, d ** -0.5)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True, enable_gqa=True).transpose(0, 1)[-7:]
    assert (out - want).abs().max() / want.abs().max() < 1e-5


def test_shape_error_names_expected_shape():
    k, v, cache, slots = make_inputs(5, 16, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="expected"):
        write_kv_ref(k[:, :1], v, cache, slots)
    with pytest.raises(ValueError, match="expected"):
        write_kv_triton(k, v[:4], cache, slots)


def _transformers_rotary(x, cos, sin):
    """x [T, H, D] rotated on its first cos.shape[-1] dims by transformers' Llama rotary."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rot = cos.shape[-1]
    xr = x[..., :rot].transpose(0, 1)[None]  # [1, H, T, rot]
    y, _ = apply_rotary_pos_emb(xr, xr, cos[None], sin[None])
    return torch.cat((y[0].transpose(0, 1), x[..., rot:]), -1)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("rot", [64, 32, 0])
def test_rope_write_kv_matches_rotary_and_write(native, rot):
    """kernels.rope_write_kv (the C loop; with native kernels off: None, so the layer runs the torch
    path) against transformers' rotary + write_kv_ref, on strided q/k/v rows, partial rotary and
    padding slots."""
    from hybridkv.kernels import native_cpu

    g = torch.Generator().manual_seed(rot)
    T, hq, hkv, d, bs, nb = 9, 4, 2, 64, 16, 5
    wide = torch.randn(T, (hq + 2 * hkv) * d + 8, generator=g)
    qkv = wide[:, 8:]  # rows with a stride, as a column slice would have
    pos = torch.randint(0, 500, (T,), generator=g).float()
    freqs = pos[:, None] * (1.0 / 10000 ** (torch.arange(0, rot, 2).float() / max(rot, 1)))[None]
    emb = torch.cat((freqs, freqs), -1)
    rope = (emb.cos(), emb.sin()) if rot else None
    cache = torch.randn(nb, 2, bs, hkv, d, generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:T].long()
    slots[::4] = -1
    q, k, v = qkv.view(T, hq + 2 * hkv, d).split([hq, hkv, hkv], 1)
    want_q, want_k = (q, k) if rope is None else (_transformers_rotary(q, *rope), _transformers_rotary(k, *rope))
    want_cache = write_kv_ref(want_k, v, cache.clone(), slots)
    if not native:
        with native_cpu.forced_off():
            assert K.rope_write_kv(qkv, rope, hq, hkv, d, cache, slots) is None
        return
    plans, second = {}, cache.clone()
    got = K.rope_write_kv(qkv, rope, hq, hkv, d, cache, slots, plans)
    assert got is not None, "the C loop must build and run on CPU float32"
    torch.testing.assert_close(got, want_q, rtol=0, atol=0)  # the same roundings: bit-exact
    torch.testing.assert_close(cache, want_cache, rtol=0, atol=0)
    again = K.rope_write_kv(qkv, rope, hq, hkv, d, second, slots, plans)  # a second layer of the step
    assert torch.equal(again, want_q) and torch.equal(second, want_cache)
    bad = slots.clone()
    bad[1] = nb * bs  # past the pool
    with pytest.raises(IndexError, match="past the KV pool"):
        K.rope_write_kv(qkv, rope, hq, hkv, d, cache, bad)
