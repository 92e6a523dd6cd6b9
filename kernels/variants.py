"""What the engine launches: every Triton kernel variant, in one table.

A variant is one call of a public Triton launcher with inputs whose dtypes and shapes pick one
compiled specialization (dtype, head dim, GQA group, decode / prefill, window, softcap, block
size, state dtype, ...). The launcher itself picks tile sizes and warps, so compiling a variant
compiles exactly what the engine would. Two users:
- tests/kernels/test_compile_sm90.py compiles each variant for sm_90 (kernels/sm90_compile.py);
- benchmarks/gpu_kernels.py launches each on the GPU as its warm-up: no timing sees a JIT compile.

Adding a kernel is one `Entry` in ENGINE_KERNELS: its public op (the name of its input builder in
INPUTS; a new op also adds one builder there), the module and function of the Triton launcher,
the axes of its variants (first value of each = the default), and `edges` (extra combinations the
default subset must hold: the largest tiles). A module not yet written is left out, and reported
by `missing_entries()`.

Levels of `engine_variants(level)`, each a superset of the one before:
- "default" (CI, about a minute cold on one core): every dtype and every edge of each entry once,
  paired round-robin, so each kernel compiles in fp16, bf16 and fp32 (fp16 / bf16 only where an
  entry's `default_dtypes` says fp32 is too slow to compile) and its largest tiles compile;
- "cover": every dtype x (the edges, and each axis value changed alone from the defaults);
- "full": every dtype x the whole product of the axes (hours on one core; use --jobs).
"""
from __future__ import annotations

import dataclasses
import importlib
import itertools
import math
from typing import Callable

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
}


@dataclasses.dataclass(frozen=True, eq=False)
class Entry:
    """One Triton launcher and the axes of the variants the engine launches through it."""
    op: str
    module: str  # under hybridkv.kernels
    function: str
    axes: dict  # axis -> values; the first value is the default
    edges: tuple = ()  # dicts of axis values the default subset must also hold
    dtypes: tuple = DTYPES
    default_dtypes: tuple | None = None  # the default level's dtypes when not all (slow compiles)


_CONV_AXES = {"dim": (256, 40), "width": (4, 3, 2), "bias": (True, False),
              "activation": ("silu", None)}

ENGINE_KERNELS = [
    Entry("paged_attention", "paged_attention_kernel", "paged_attention_triton",
          {"head_dim": (128, 64, 80, 96, 256), "group": (4, 1, 2, 8, 16),
           "mode": ("decode", "prefill", "split_decode"), "feature": ("plain", "window", "softcap"),
           "block_size": (16, 32)},
          # round-robin order: the largest tiles land on bf16 and fp16 (spills count there)
          edges=({"head_dim": 256, "group": 1, "mode": "prefill", "feature": "softcap"},
                 {"head_dim": 64, "group": 16, "mode": "prefill"},
                 {"head_dim": 256, "group": 8, "mode": "split_decode", "feature": "softcap"},
                 {"head_dim": 256, "group": 8, "mode": "prefill", "feature": "window",
                  "block_size": 32})),
    Entry("write_kv", "write_kv_kernel", "write_kv_triton",
          {"head_dim": (128, 64, 256), "kv_heads": (8, 1, 2, 32), "block_size": (16, 32)}),
    Entry("write_latent", "latent_write_kernel", "write_latent_triton",
          {"dim": (576, 80), "block_size": (16, 32)}),  # 512 + 64: Kimi-Linear's latent
    Entry("causal_conv1d", "conv1d", "causal_conv1d_triton", _CONV_AXES),
    Entry("conv1d_update", "conv1d", "conv1d_update_triton", _CONV_AXES),
    Entry("mamba1_state_update", "mamba1", "mamba1_state_update_triton",
          {"d_inner": (512, 48), "n_state": (16, 8, 64), "state_dtype": ("float32", "same")}),
    Entry("mamba2_state_update", "mamba2", "mamba2_state_update_triton",
          {"heads": (8, 4), "head_dim": (64, 32, 128), "n_state": (128, 16, 64, 256),
           "groups": (1, 2), "dt_limit": (False, True), "state_dtype": ("float32", "same")},
          edges=({"head_dim": 128, "n_state": 256},)),
    Entry("mamba2_chunk_scan", "ssd_prefill", "mamba2_chunk_scan_triton",
          {"heads": (8, 4), "head_dim": (64, 32), "n_state": (128, 16, 64, 256),
           "groups": (1, 2), "chunk_size": (256, 128), "state_dtype": ("float32", "same")},
          # fp32 (a check path) compiles for ~85 s and spills 74 KB: only in "cover" and "full"
          edges=({"n_state": 256, "groups": 2},), default_dtypes=(torch.float16, torch.bfloat16)),
    Entry("gdn_state_update", "gdn", "gdn_state_update_triton",
          {"heads": (4, 2), "v_heads": (8, 4), "k_dim": (128, 64, 256), "v_dim": (128, 64, 256),
           "state_dtype": ("float32", "same")},
          edges=({"k_dim": 256, "v_dim": 256},)),
    Entry("mamba1_scan", "mamba1_prefill", "mamba1_scan_triton",
          {"d_inner": (512, 48), "n_state": (16, 8, 64), "state_dtype": ("float32", "same")},
          edges=({"n_state": 64},)),
    Entry("gdn_chunk_scan", "gdn_prefill", "gdn_chunk_scan_triton",
          {"heads": (4, 2), "v_heads": (8, 4), "k_dim": (128, 64, 256), "v_dim": (128, 64, 256),
           "chunk_size": (64,), "state_dtype": ("float32", "same")},
          # fp32 (a check path: exact fp32 dots) compiles for ~6 min and spills: "cover" and "full"
          edges=({"k_dim": 256, "v_dim": 256},), default_dtypes=(torch.float16, torch.bfloat16)),
    Entry("lightning_chunk_scan", "lightning_prefill", "lightning_chunk_scan_triton",
          {"heads": (8, 4), "k_dim": (128, 64, 256), "v_dim": (128, 64, 256), "chunk_size": (64,),
           "state_dtype": ("float32", "same")},
          edges=({"k_dim": 256, "v_dim": 256},)),
    Entry("kda_chunk_scan", "kda_prefill", "kda_chunk_scan_triton",
          {"heads": (8, 4), "k_dim": (128, 64, 256), "v_dim": (128, 64, 256),
           "chunk_size": (16, 64), "state_dtype": ("float32", "same")},
          edges=({"k_dim": 256, "v_dim": 256, "chunk_size": 64},)),
    Entry("fused_moe", "fused_moe_kernel", "fused_moe_triton",  # tokens 1: BLOCK_M 16; 64: BLOCK_M 64
          {"tokens": (64, 1), "experts": (8, 64), "top_k": (2, 8), "inter": (128, 96),
           "gated": (True, False)}),
]


@dataclasses.dataclass(frozen=True, eq=False)
class Variant:
    """One launch of one entry: a dtype and a value per axis."""
    entry: Entry
    dtype: torch.dtype
    dims: tuple  # sorted (axis, value) pairs

    @property
    def op(self) -> str:
        return self.entry.op

    @property
    def name(self) -> str:
        parts = [f"{k}={v}" for k, v in self.dims]
        return f"{self.op}[{str(self.dtype).replace('torch.', '')},{','.join(parts)}]"

    @property
    def spills_matter(self) -> bool:
        """Spills count against the fp16 / bf16 paths (the served ones); fp32 is a check path."""
        return self.dtype in (torch.float16, torch.bfloat16)

    def launcher(self):
        mod = importlib.import_module(f"hybridkv.kernels.{self.entry.module}")
        return getattr(mod, self.entry.function)

    def inputs(self, device, seed=0):
        gen = torch.Generator(device=device).manual_seed(seed)
        return INPUTS[self.op](dict(self.dims), self.dtype, device, gen)

    def launch(self, device):
        """Run the launcher once on fresh random inputs on `device` (compiles it if needed)."""
        args, kwargs = self.inputs(device)
        return self.launcher()(*args, **kwargs)


def _is_present(entry: Entry) -> bool:
    try:
        return hasattr(importlib.import_module(f"hybridkv.kernels.{entry.module}"), entry.function)
    except ModuleNotFoundError:
        return False


def missing_entries() -> list[str]:
    """Entries whose launcher is not written yet ('module.function')."""
    return [f"{e.module}.{e.function}" for e in ENGINE_KERNELS if not _is_present(e)]


LEVELS = ("default", "cover", "full")


def _entry_variants(entry: Entry, level: str) -> list[Variant]:
    names = list(entry.axes)
    default = {k: v[0] for k, v in entry.axes.items()}
    edges = [default] + [{**default, **edge} for edge in entry.edges]
    if level == "default":  # every dtype and every edge once, paired round-robin
        dtypes = entry.default_dtypes or entry.dtypes
        n = max(len(dtypes), len(edges))
        pairs = [(dtypes[i % len(dtypes)], edges[i % len(edges)]) for i in range(n)]
    else:
        if level == "full":
            combos = [dict(zip(names, vals)) for vals in itertools.product(*entry.axes.values())]
        else:  # cover: each axis value once against the defaults, and the edges
            combos = edges + [{**default, k: v} for k in names for v in entry.axes[k][1:]]
        pairs = [(dtype, dims) for dtype in entry.dtypes for dims in combos]
    out, seen = [], set()
    for dtype, dims in pairs:
        v = Variant(entry, dtype, tuple(sorted(dims.items(), key=lambda kv: kv[0])))
        if v.name not in seen:
            seen.add(v.name)
            out.append(v)
    return out


def engine_variants(level: str = "default") -> list[Variant]:
    """Every variant of every written launcher at `level` (see the module docstring)."""
    if level not in LEVELS:
        raise ValueError(f"variant level {level!r} is not one of {LEVELS}")
    return [v for e in ENGINE_KERNELS if _is_present(e) for v in _entry_variants(e, level)]
