"""What the engine launches: every Triton kernel variant, in one table.

A variant is one call of a public Triton launcher with inputs whose dtypes and shapes pick one
compiled specialization (dtype, head dim, GQA group, decode / prefill, window, softcap, block
size, state dtype, ...). The launcher itself picks tile sizes and warps, so compiling a variant
compiles exactly what the engine would. Two users:
- tests/kernels/test_compile_sm90.py compiles each variant for sm_90 (kernels/sm90_compile.py);
- benchmarks/gpu_kernels.py launches each on the GPU as its warm-up: no timing sees a JIT compile.

Adding a kernel is one `Entry` in ENGINE_KERNELS: its public op (the name of its input builder in
variant_inputs.INPUTS; a new op also adds one builder there), the module and function of the Triton launcher,
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

import torch

from .variant_inputs import INPUTS

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    # quantized caches, read and written in place: fp32 compute (the only one the codes path takes)
    Entry("quantized_decode_attention", "attention_decode_quantized_triton", "quantized_decode_attention_triton",
          {"head_dim": (128, 64, 256), "group": (4, 1, 8), "feature": ("plain", "window", "softcap", "sinks"),
           "cache": ("int8", "fp8_e4m3"), "block_size": (16, 32), "keys": (40, 2048)},
          edges=({"head_dim": 256, "group": 8, "cache": "fp8_e4m3", "feature": "softcap"},
                 {"keys": 2048, "feature": "sinks"}), dtypes=(torch.float32,)),
    Entry("mamba2_mixer_decode_q", "mamba2_quantized_triton", "mamba2_mixer_decode_q_triton",
          {"heads": (8, 4), "head_dim": (64, 32), "n_state": (128, 16, 256), "groups": (1, 2),
           "cache": ("int8", "fp8_e4m3")},
          edges=({"n_state": 256, "cache": "fp8_e4m3"},), dtypes=(torch.float32,)),
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
