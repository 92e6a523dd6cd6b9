"""The inputs each op's Triton variants launch with (kernels/variants.py lists the variants): one
builder per public op, `(dims, dtype, device, gen) -> (args, kwargs)`, small random tensors whose
shapes and dtypes pick the compiled specialization a variant names. The quantized-cache kernels get
a layout-like record (`_RowLayout`): kernels import nothing of the memory side (hybridkv.cache_dtype).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

def _randn(gen, device, dtype, *shape):
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def _slots(gen, device, batch):
    """batch distinct live slots out of batch + 2 (slot 0 is the null slot)."""
    return (torch.randperm(batch + 1, generator=gen, device=device)[:batch] + 1).to(torch.int32)


def _state_dtype(dims, dtype):
    return torch.float32 if dims.get("state_dtype") == "float32" else dtype


def paged_attention_inputs(dims, dtype, device, gen):
    """Decode: one token per request over ragged contexts; prefill: whole prompts."""
    hkv, d, bs = 2, dims["head_dim"], dims["block_size"]
    hq = hkv * dims["group"]
    reqs = [(20, 40), (33, 33)] if dims["mode"] == "prefill" else [(1, 40), (1, 17)]
    need = [math.ceil(s / bs) for _, s in reqs]
    kv = _randn(gen, device, dtype, sum(need) + 1, 2, bs, hkv, d)
    table = torch.zeros(len(reqs), max(need), dtype=torch.int32, device=device)
    first = 1
    for r, n in enumerate(need):
        table[r, :n] = torch.arange(first, first + n, dtype=torch.int32, device=device)
        first += n
    q = _randn(gen, device, dtype, sum(n for n, _ in reqs), hq, d)
    qsl = torch.tensor([0] + [n for n, _ in reqs], device=device).cumsum(0).to(torch.int32)
    lens = torch.tensor([s for _, s in reqs], dtype=torch.int32, device=device)
    feature = dims["feature"]
    kwargs = {"sliding_window": 24 if feature == "window" else None,
              "soft_cap": 30.0 if feature == "softcap" else None,
              "max_query_len": max(n for n, _ in reqs), "max_seq_len": max(s for _, s in reqs)}
    if dims["mode"] == "split_decode":  # split-KV decode and its merge pass (split_kv.py)
        kwargs["num_kv_splits"] = 4
    return (q, kv, qsl, lens, table, d ** -0.5), kwargs


def write_kv_inputs(dims, dtype, device, gen):
    hkv, d, bs, t = dims["kv_heads"], dims["head_dim"], dims["block_size"], 5
    cache = _randn(gen, device, dtype, 4, 2, bs, hkv, d)
    slots = torch.randperm(4 * bs, generator=gen, device=device)[:t]
    slots[1] = -1
    return (_randn(gen, device, dtype, t, hkv, d), _randn(gen, device, dtype, t, hkv, d), cache,
            slots), {}


def write_latent_inputs(dims, dtype, device, gen):
    """Latent pages [blocks, 1, bs, 1, kv_lora_rank + rope_dim] (MLA: Kimi-Linear, Ling 3)."""
    d, bs, t = dims["dim"], dims["block_size"], 5
    slots = torch.randperm(4 * bs, generator=gen, device=device)[:t]
    slots[1] = -1
    return (_randn(gen, device, dtype, t, d), _randn(gen, device, dtype, 4, 1, bs, 1, d), slots), {}


def _conv_common(dims, dtype, device, gen, batch):
    dim, kw = dims["dim"], dims["width"]
    conv_state = _randn(gen, device, dtype, batch + 2, dim, kw - 1)
    bias = _randn(gen, device, dtype, dim) if dims["bias"] else None
    return conv_state, _randn(gen, device, dtype, dim, kw), bias, _slots(gen, device, batch)


def causal_conv1d_inputs(dims, dtype, device, gen):
    conv_state, w, bias, slots = _conv_common(dims, dtype, device, gen, 3)
    lens = [1, 17, 5]
    qsl = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    init = torch.tensor([True, False, True], device=device)
    x = _randn(gen, device, dtype, sum(lens), dims["dim"])
    return (x, conv_state, w, bias, qsl, slots, init, dims["activation"]), {}


def conv1d_update_inputs(dims, dtype, device, gen):
    conv_state, w, bias, slots = _conv_common(dims, dtype, device, gen, 3)
    x = _randn(gen, device, dtype, 3, dims["dim"])
    return (x, conv_state, w, bias, slots, dims["activation"]), {}


def mamba1_state_update_inputs(dims, dtype, device, gen):
    b, di, n = 3, dims["d_inner"], dims["n_state"]
    r = lambda *s: _randn(gen, device, dtype, *s)  # noqa: E731
    state = _randn(gen, device, _state_dtype(dims, dtype), b + 2, di, n)
    A = -torch.rand(di, n, generator=gen, device=device).add(0.5)
    return (state, r(b, di), r(b, di), A, r(b, n), r(b, n), torch.ones(di, device=device),
            r(b, di), r(di), _slots(gen, device, b)), {}


def mamba2_state_update_inputs(dims, dtype, device, gen):
    b, h, p, n, g = 3, dims["heads"], dims["head_dim"], dims["n_state"], dims["groups"]
    r = lambda *s: _randn(gen, device, dtype, *s)  # noqa: E731
    state = _randn(gen, device, _state_dtype(dims, dtype), b + 2, h, p, n)
    A = -torch.rand(h, generator=gen, device=device).add(0.5)
    kwargs = {"dt_limit": (0.0, 100.0)} if dims["dt_limit"] else {}
    return (state, r(b, h, p), r(b, h), A, r(b, g, n), r(b, g, n), torch.ones(h, device=device),
            None, r(h), _slots(gen, device, b)), kwargs


def mamba2_chunk_scan_inputs(dims, dtype, device, gen):
    """Ragged prompts of 1, chunk + 1 and 5 tokens, the second continuing its slot's state."""
    h, p, n, g, chunk = dims["heads"], dims["head_dim"], dims["n_state"], dims["groups"], \
        dims["chunk_size"]
    lens = [1, chunk + 1, 5]
    t = sum(lens)
    r = lambda *s: _randn(gen, device, dtype, *s)  # noqa: E731
    state = _randn(gen, device, _state_dtype(dims, dtype), 5, h, p, n)
    qsl = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    init = torch.tensor([False, True, False], device=device)
    A = -torch.rand(h, generator=gen, device=device).add(0.5)
    return (state, r(t, h, p), r(t, h), A, r(t, g, n), r(t, g, n), torch.ones(h, device=device),
            None, r(h), qsl, _slots(gen, device, 3), init), {"chunk_size": chunk}


def mamba1_scan_inputs(dims, dtype, device, gen):
    """Ragged prompts of 1, 17 and 5 tokens, the second continuing its slot's state."""
    di, n, lens = dims["d_inner"], dims["n_state"], [1, 17, 5]
    t = sum(lens)
    r = lambda *s: _randn(gen, device, dtype, *s)  # noqa: E731
    state = _randn(gen, device, _state_dtype(dims, dtype), 5, di, n)
    A = -torch.rand(di, n, generator=gen, device=device).add(0.5)
    qsl = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    init = torch.tensor([False, True, False], device=device)
    return (state, r(t, di), r(t, di), A, r(t, n), r(t, n), torch.ones(di, device=device),
            r(t, di), r(di), qsl, _slots(gen, device, 3), init), {}


def gdn_chunk_scan_inputs(dims, dtype, device, gen):
    """Ragged prompts of 1, chunk + 1 and 5 tokens, the second continuing its slot's state."""
    h, hv, k, v, chunk = dims["heads"], dims["v_heads"], dims["k_dim"], dims["v_dim"], \
        dims["chunk_size"]
    lens = [1, chunk + 1, 5]
    t = sum(lens)
    r = lambda *s: _randn(gen, device, dtype, *s)  # noqa: E731
    state = _randn(gen, device, _state_dtype(dims, dtype), 5, hv, k, v)
    g = -torch.rand(t, hv, generator=gen, device=device).to(dtype)
    beta = torch.rand(t, hv, generator=gen, device=device).to(dtype)
    qsl = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    init = torch.tensor([False, True, False], device=device)
    return (state, r(t, h, k), r(t, h, k), r(t, hv, v), g, beta, qsl, _slots(gen, device, 3),
            init), {"chunk_size": chunk}


def gdn_state_update_inputs(dims, dtype, device, gen):
    b, h, hv, k, v = 3, dims["heads"], dims["v_heads"], dims["k_dim"], dims["v_dim"]
    r = lambda *s: _randn(gen, device, dtype, *s)  # noqa: E731
    state = _randn(gen, device, _state_dtype(dims, dtype), b + 2, hv, k, v)
    g = -torch.rand(b, hv, generator=gen, device=device).to(dtype)
    beta = torch.rand(b, hv, generator=gen, device=device).to(dtype)
    return (state, r(b, h, k), r(b, h, k), r(b, hv, v), g, beta, _slots(gen, device, b)), {}


def lightning_chunk_scan_inputs(dims, dtype, device, gen):
    """Ragged prompts of 1, chunk + 1 and 5 tokens, the second continuing its slot's state."""
    h, k, v, chunk = dims["heads"], dims["k_dim"], dims["v_dim"], dims["chunk_size"]
    lens = [1, chunk + 1, 5]
    t = sum(lens)
    r = lambda *s: _randn(gen, device, dtype, *s)  # noqa: E731
    state = _randn(gen, device, _state_dtype(dims, dtype), 5, h, k, v)
    slope = torch.rand(h, generator=gen, device=device)
    qsl = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    init = torch.tensor([False, True, False], device=device)
    return (state, r(t, h, k), r(t, h, k), r(t, h, v), slope, qsl, _slots(gen, device, 3),
            init), {"chunk_size": chunk}


def kda_chunk_scan_inputs(dims, dtype, device, gen):
    """Ragged prompts of 1, chunk + 1 and 5 tokens, the second continuing its slot's state."""
    h, k, v, chunk = dims["heads"], dims["k_dim"], dims["v_dim"], dims["chunk_size"]
    lens = [1, chunk + 1, 5]
    t = sum(lens)
    r = lambda *s: _randn(gen, device, dtype, *s)  # noqa: E731
    state = _randn(gen, device, _state_dtype(dims, dtype), 5, h, k, v)
    g = -torch.rand(t, h, k, generator=gen, device=device).to(dtype)
    beta = torch.rand(t, h, generator=gen, device=device).to(dtype)
    qsl = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    init = torch.tensor([False, True, False], device=device)
    return (state, r(t, h, k), r(t, h, k), r(t, h, v), g, beta, qsl, _slots(gen, device, 3),
            init), {"chunk_size": chunk}


def fused_moe_inputs(dims, dtype, device, gen):
    t, e, k, i, h = dims["tokens"], dims["experts"], dims["top_k"], dims["inter"], 256
    logits = torch.randn(t, e, generator=gen, device=device)
    weights, ids = torch.topk(logits.softmax(-1), k)
    rows = 2 * i if dims["gated"] else i  # gated: silu(gate) * up; not: relu2(up) (Nemotron-H)
    kwargs = {} if dims["gated"] else {"activation": "relu2", "gated": False}
    return (_randn(gen, device, dtype, t, h), _randn(gen, device, dtype, e, rows, h),
            _randn(gen, device, dtype, e, h, i), weights.to(dtype), ids), kwargs


@dataclasses.dataclass(frozen=True)
class _RowLayout:
    """What a quantized-cache kernel reads of a hybridkv.cache_dtype.QuantLayout: its dtype, item
    shape, and bytes (codes padded to 4, then a float32 scale per row: `scales` of them)."""
    dtype: str
    shape: tuple
    scales: int

    @property
    def code_bytes(self) -> int:
        return -(-math.prod(self.shape) // 4) * 4

    @property
    def nbytes(self) -> int:
        return self.code_bytes + 4 * self.scales


def _quantized_pool(gen, device, layout, *lead):
    """Random codes with positive scales (fp8 codes may be NaN ones: these inputs are only launched)."""
    pool = torch.randint(0, 256, (*lead, layout.nbytes), generator=gen, device=device, dtype=torch.int32)
    pool = pool.to(torch.uint8)
    scales = pool.view(torch.float32)[..., layout.code_bytes // 4:]
    scales.copy_(torch.rand(scales.shape, generator=gen, device=device) + 0.01)
    return pool


def quantized_decode_attention_inputs(dims, dtype, device, gen):
    """One new token per request over ragged contexts of a quantized KV pool, blocks in order (a
    longest context of 2048 keys: split-KV and its merge)."""
    hkv, d, bs = 2, dims["head_dim"], dims["block_size"]
    lens = [dims["keys"], 17]
    need = [math.ceil(s / bs) for s in lens]
    layout = _RowLayout(dims["cache"], (d,), 1)
    pool = _quantized_pool(gen, device, layout, sum(need) + 1, 2, bs, hkv)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32, device=device)
    first = 1
    for r, n in enumerate(need):
        table[r, :n] = torch.arange(first, first + n, dtype=torch.int32, device=device)
        first += n
    slots = torch.tensor([int(table[r, (s - 1) // bs]) * bs + (s - 1) % bs for r, s in enumerate(lens)],
                         device=device)
    feature = dims["feature"]
    q = _randn(gen, device, dtype, len(lens), hkv * dims["group"], d)
    fresh = torch.randn(len(lens), 2, 1, hkv, d, generator=gen, device=device)
    sinks = torch.randn(hkv * dims["group"], generator=gen, device=device) if feature == "sinks" else None
    return (q, fresh, pool, layout, slots, table, torch.tensor(lens, dtype=torch.int32, device=device), d ** -0.5,
            30.0 if feature == "softcap" else None, 24 if feature == "window" else None, sinks, {}), {}


def mamba2_mixer_decode_q_inputs(dims, dtype, device, gen):
    """A Mamba2 layer's decode over quantized conv and SSM pools, batch 3 of 5 slots."""
    b, h, p, n, g, k = 3, dims["heads"], dims["head_dim"], dims["n_state"], dims["groups"], 4
    conv_dim = h * p + 2 * g * n
    conv_layout = _RowLayout(dims["cache"], (conv_dim, k - 1), k - 1)
    ssm_layout = _RowLayout(dims["cache"], (h, p, n), h * p)
    r = lambda *s: _randn(gen, device, dtype, *s)  # noqa: E731
    return (r(b, h * p + conv_dim + h), _slots(gen, device, b)), dict(
        conv_pool=_quantized_pool(gen, device, conv_layout, b + 2), conv_layout=conv_layout,
        ssm_pool=_quantized_pool(gen, device, ssm_layout, b + 2), ssm_layout=ssm_layout, num_heads=h, head_dim=p,
        n_groups=g, conv_weight=r(conv_dim, k), conv_bias=r(conv_dim), A_log=r(h), dt_bias=r(h), D=r(h),
        norm_weight=r(h * p), norm_group=h * p // g, eps=1e-5, norm_mode=1, cache={})


INPUTS: dict[str, Callable] = {  # public op -> (dims, dtype, device, gen) -> (args, kwargs)
    "paged_attention": paged_attention_inputs,
    "write_kv": write_kv_inputs,
    "write_latent": write_latent_inputs,
    "causal_conv1d": causal_conv1d_inputs,
    "conv1d_update": conv1d_update_inputs,
    "mamba1_state_update": mamba1_state_update_inputs,
    "mamba2_state_update": mamba2_state_update_inputs,
    "mamba2_chunk_scan": mamba2_chunk_scan_inputs,
    "gdn_state_update": gdn_state_update_inputs,
    "mamba1_scan": mamba1_scan_inputs,
    "gdn_chunk_scan": gdn_chunk_scan_inputs,
    "lightning_chunk_scan": lightning_chunk_scan_inputs,
    "kda_chunk_scan": kda_chunk_scan_inputs,
    "fused_moe": fused_moe_inputs,
    "quantized_decode_attention": quantized_decode_attention_inputs,
    "mamba2_mixer_decode_q": mamba2_mixer_decode_q_inputs,
}
