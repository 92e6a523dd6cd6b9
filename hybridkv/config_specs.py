"""Layer specs from a published config.json alone (no weights): what the planner needs to size caches.

    specs = load_specs("examples/configs/bamba-9b.json")     # {layer_idx: AttentionSpec | RecurrentSpec}

Supported `model_type`s: llama / qwen3 / mistral (attention everywhere), bamba (Mamba2 beside
attention at `attn_layer_indices`), jamba (Mamba1; attention where `i % attn_layer_period ==
attn_layer_offset`), qwen3_next (gated delta net; attention at `layer_types == "full_attention"`,
by default every `full_attention_interval`-th layer). Shapes follow the models in hybridkv.models,
and tests check them against those models' own `cache_specs()`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional

import torch

from hybridkv.specs import AttentionSpec, LayerSpec, RecurrentSpec

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ATTENTION_ONLY = ("llama", "qwen3", "mistral", "qwen2")


def load_config(path: str | Path) -> dict:
    """The JSON object in `path` (a config.json or one of examples/configs/*.json)."""
    with open(path) as f:
        cfg = json.load(f)
    if "model_type" not in cfg:
        raise ValueError(f"{path}: no 'model_type' field; expected a Hugging Face config.json")
    return cfg


def load_specs(path: str | Path, dtype: Optional[torch.dtype] = None) -> dict[int, LayerSpec]:
    """`{layer_idx: spec}` for the config at `path`; see `specs_from_config`."""
    return specs_from_config(load_config(path), dtype)


def config_dtype(cfg: Mapping) -> torch.dtype:
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if name not in _DTYPES:
        raise ValueError(f"config dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _attention(cfg: Mapping, dtype: torch.dtype) -> AttentionSpec:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return AttentionSpec(kv_heads, head_dim, dtype, cfg.get("sliding_window"))


def _bamba(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    heads, head_dim = cfg["mamba_n_heads"], cfg["mamba_d_head"]
    d_state, groups = cfg["mamba_d_state"], cfg["mamba_n_groups"]
    # The conv runs over x, B and C: d_inner + 2 x groups x d_state channels.
    conv_dim = heads * head_dim + 2 * groups * d_state
    mamba = RecurrentSpec((conv_dim, cfg["mamba_d_conv"] - 1), (heads, head_dim, d_state), dtype)
    attn = set(cfg.get("attn_layer_indices") or ())
    return {i: _attention(cfg, dtype) if i in attn else mamba for i in range(cfg["num_hidden_layers"])}


def _jamba(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    d_inner = cfg["mamba_expand"] * cfg["hidden_size"]
    mamba = RecurrentSpec((d_inner, cfg["mamba_d_conv"] - 1), (d_inner, cfg["mamba_d_state"]), dtype)
    period, offset = cfg["attn_layer_period"], cfg["attn_layer_offset"]
    return {i: _attention(cfg, dtype) if i % period == offset else mamba for i in range(cfg["num_hidden_layers"])}


def _qwen3_next(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(n)]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    # The conv runs over q, k and v.
    gdn = RecurrentSpec((2 * nk * dk + nv * dv, cfg["linear_conv_kernel_dim"] - 1), (nv, dk, dv), dtype)
    return {i: _attention(cfg, dtype) if types[i] == "full_attention" else gdn for i in range(n)}


def specs_from_config(cfg: Mapping, dtype: Optional[torch.dtype] = None) -> dict[int, LayerSpec]:
    """`{layer_idx: AttentionSpec | RecurrentSpec}` from a config dict; caches in `dtype`
    (default: the config's torch_dtype). Raises ValueError for a model_type it does not know."""
    dtype = dtype or config_dtype(cfg)
    kind = cfg["model_type"]
    if kind in ATTENTION_ONLY:
        return {i: _attention(cfg, dtype) for i in range(cfg["num_hidden_layers"])}
    builders = {"bamba": _bamba, "jamba": _jamba, "qwen3_next": _qwen3_next}
    if kind not in builders:
        raise ValueError(f"model_type {kind!r} has no spec builder; supported: "
                         f"{sorted(ATTENTION_ONLY + tuple(builders))}")
    return builders[kind](cfg, dtype)
