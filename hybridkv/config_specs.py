"""Layer specs from a published config.json alone (no weights): what the planner needs to size caches.

    specs = load_specs("examples/configs/bamba-9b.json")     # {layer_idx: AttentionSpec | RecurrentSpec}

Supported `model_type`s: llama / qwen3 / mistral / qwen2 (attention everywhere; mistral's
`sliding_window` on every layer, qwen2/qwen3's only with `use_sliding_window`, on their
"sliding_attention" layers), bamba (Mamba2
beside attention at `attn_layer_indices`), jamba (Mamba1; attention where `i % attn_layer_period ==
attn_layer_offset`), qwen3_next (gated delta net; attention at `layer_types == "full_attention"`,
by default every `full_attention_interval`-th layer), granitemoehybrid (Mamba2 or attention per
`layer_types`), nemotron_h (Mamba2 / attention / MLP / MoE per `hybrid_override_pattern`; MLP and
MoE blocks keep nothing and get no key; the SSM state in `mamba_ssm_cache_dtype`), lfm2 /
lfm2_moe (short conv, window only, or attention per `layer_types`), falcon_h1 (attention AND
Mamba2 in every layer: key `i` and key `num_hidden_layers + i`), zamba2 / zamba (Mamba2 /
multi-head Mamba1 state at key `i` for every layer; the shared attention block's KV of each
hybrid layer i at key `num_hidden_layers + i`), olmo_hybrid (GDN or attention per
`layer_types`), qwen3_5 / qwen3_5_moe
(Qwen3-Next's GDN and attention per `layer_types`; the `_text` model types, or the published
multimodal config whose `text_config` holds them), mamba / falcon_mamba (Mamba1 state in every
layer, no attention), mamba2 (Mamba2 state in every layer, no attention) and recurrent_gemma
(RG-LRU conv window + float32 state, or attention with `attention_window_size`, per `block_types`
repeated), minimax (lightning attention: a `[heads, head_dim, head_dim]` state, no conv window;
or attention, per `layer_types`), kimi_linear (KDA: a conv window and a float32
`[heads, K, K]` state; or latent attention: ONE `kv_lora_rank + qk_rope_head_dim` vector per
token, `AttentionSpec(latent=True)`; per `layer_types`), bailing_hybrid (Ling 3: Kimi-Linear's
two kinds under the same names; `layer_types` by default MLA every `layer_group_size`-th layer),
lara_mini (Qwen3.5's GDN, or attention with `sliding_window` on "sliding_attention" layers and
none on "full_attention" ones, per `layer_types`), granitemoe_swa (attention only: `sliding_window`
on "sliding_attention" layers, none on "full_attention" ones), rwkv (RWKV-4, every layer a state:
the two token shifts `[2, hidden]` as the window part, the WKV num / den / max `[3,
attention_hidden_size]` in float32; no attention), zaya (every layer CCA attention: its KV at key
`i`, sliding on "hybrid_sliding" layers; at key `num_hidden_layers + i` its q|k conv window
`[(heads + kv heads) x head_dim, cca_time0 + cca_time1 - 2]` and delayed value `[kv heads x
head_dim / 2]`), inkling_text (relative-bias attention at key `i`, sliding layers with the `swa_*` head
shapes; at key `num_hidden_layers + i` the four short-conv windows `[2 x kv width + 2 x hidden,
conv_kernel_size - 1]` in float32, no SSM state), inkling2_text (the same two kinds and keys),
inkling2_loop_text (the same per virtual layer: each extra pass of the looped layers is one more,
`num_hidden_layers + (pass - 1) x loop layers + (i - loop start)`; KV at key v, windows at V + v),
and the published multimodal inkling_mm_model / inkling2 / inkling2_loop configs (their nested
`text_config`), glm5_next and qwen4_exp, and their _text configs (hybridkv/indexed_attention_specs.py).
For the families from granitemoehybrid on and the attention-only ones, fields a config.json omits take
transformers' config-class defaults
(`hf_config`), as they do when transformers loads it. Shapes follow the models in hybridkv.models,
and tests check them against those models' own `cache_specs()`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional

import torch

from hybridkv.indexed_attention_specs import BUILDERS as INDEXED_BUILDERS
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


def _mamba2(heads: int, head_dim: int, groups: int, d_state: int, d_conv: int, dtype: torch.dtype,
            state_dtype: Optional[torch.dtype] = None) -> RecurrentSpec:
    # The conv runs over x, B and C: d_inner + 2 x groups x d_state channels.
    conv_dim = heads * head_dim + 2 * groups * d_state
    return RecurrentSpec((conv_dim, d_conv - 1), (heads, head_dim, d_state), dtype, state_dtype)


def _bamba(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    mamba = _mamba2(cfg["mamba_n_heads"], cfg["mamba_d_head"], cfg["mamba_n_groups"],
                    cfg["mamba_d_state"], cfg["mamba_d_conv"], dtype)
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


def _json_floats(obj):
    """transformers writes inf / nan into config.json as {"__float__": "Infinity"}; undo that."""
    if isinstance(obj, Mapping):
        if set(obj) == {"__float__"} and obj["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(obj["__float__"].lower().replace("infinity", "inf"))
        return {k: _json_floats(v) for k, v in obj.items()}
    return [_json_floats(v) for v in obj] if isinstance(obj, list) else obj


def hf_config(cfg: Mapping):
    """transformers' config class for `cfg["model_type"]`, built from the dict as `from_pretrained`
    would: omitted fields get the class defaults, derived ones (head dims, layer types) are filled."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kind = cfg["model_type"]
    try:
        return CONFIG_MAPPING[kind].from_dict(_json_floats(cfg))
    except Exception as e:  # transformers' own validation: say which config and why
        raise ValueError(f"config of model_type {kind!r} is not valid for transformers' "
                         f"{CONFIG_MAPPING[kind].__name__}: {e}") from e


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _layer_kinds(names, table: Mapping[str, str], family: str) -> list[str]:
    """Each layer's kind by `table`; a ValueError naming the first layer type it does not know."""
    for i, t in enumerate(names):
        if t not in table:
            raise ValueError(f"{family} layer {i} has type {t!r}; expected one of {sorted(table)}")
    return [table[t] for t in names]


def _attention_only(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    # Mistral's window (class default 4096) is on every layer; Qwen2/3 set it to None unless
    # use_sliding_window, and then only their "sliding_attention" layers use it; Llama has none.
    window = getattr(c, "sliding_window", None) if cfg["model_type"] != "llama" else None
    types = getattr(c, "layer_types", None) or ["sliding_attention"] * c.num_hidden_layers
    kinds = _layer_kinds(types, {"sliding_attention": "s", "full_attention": "a"}, cfg["model_type"])
    return {i: AttentionSpec(c.num_key_value_heads, _head_dim(c), dtype, window if k == "s" else None)
            for i, k in enumerate(kinds)}


def _granitemoehybrid(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    kinds = _layer_kinds(c.layer_types, {"mamba": "m", "linear_attention": "m", "attention": "a",
                                         "full_attention": "a"}, "granitemoehybrid")
    attn = AttentionSpec(c.num_key_value_heads, _head_dim(c), dtype)
    mamba = _mamba2(c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state, c.mamba_d_conv, dtype)
    return {i: attn if k == "a" else mamba for i, k in enumerate(kinds)}


def _nemotron_h(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    kinds = _layer_kinds(c.layers_block_type, {
        "mamba": "m", "linear_attention": "m", "M": "m", "attention": "a", "full_attention": "a",
        "*": "a", "mlp": "-", "-": "-", "moe": "-", "E": "-"}, "nemotron_h")
    # The SSM state keeps the checkpoint's mamba_ssm_cache_dtype (vLLM honours it too).
    ssm = _DTYPES.get(str(getattr(c, "mamba_ssm_cache_dtype", "") or ""))
    state_dtype = ssm if ssm not in (None, dtype) else None
    attn = AttentionSpec(c.num_key_value_heads, c.head_dim, dtype)
    mamba = _mamba2(c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size, c.conv_kernel,
                    dtype, state_dtype)
    return {i: attn if k == "a" else mamba for i, k in enumerate(kinds) if k != "-"}


def _lfm2(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    kinds = _layer_kinds(c.layer_types, {"conv": "c", "full_attention": "a"}, "lfm2")
    attn = AttentionSpec(c.num_key_value_heads, _head_dim(c), dtype)
    conv = RecurrentSpec((c.hidden_size, c.conv_L_cache - 1), (), dtype)  # a window, no SSM state
    return {i: attn if k == "a" else conv for i, k in enumerate(kinds)}


def _lfm3(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    kinds = _layer_kinds(c.layer_types, {"conv": "c", "full_attention": "a", "sliding_attention": "s"}, "lfm3")
    conv = RecurrentSpec((c.hidden_size, c.conv_L_cache - 1), (), dtype)  # a window, no SSM state
    return {i: conv if k == "c" else AttentionSpec(c.num_key_value_heads, _head_dim(c), dtype,
                                                     c.sliding_window if k == "s" else None)
            for i, k in enumerate(kinds)}


def _falcon_h1(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    n = c.num_hidden_layers
    attn = AttentionSpec(c.num_key_value_heads, _head_dim(c), dtype)
    mamba = _mamba2(c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state, c.mamba_d_conv, dtype)
    return {**{i: attn for i in range(n)}, **{n + i: mamba for i in range(n)}}


def _zamba2(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    n, types = c.num_hidden_layers, list(c.layers_block_type)
    if len(types) != n:
        raise ValueError(f"zamba2 layers_block_type has {len(types)} entries but num_hidden_layers "
                         f"is {n}; give one type per layer")
    mamba = _mamba2(c.n_mamba_heads, c.mamba_headdim, c.mamba_ngroups, c.mamba_d_state, c.mamba_d_conv, dtype)
    attn = AttentionSpec(c.num_key_value_heads, c.attention_head_dim, dtype)
    specs: dict[int, LayerSpec] = {i: mamba for i in range(n)}
    specs.update({n + i: attn for i, t in enumerate(types) if t == "hybrid"})
    return specs


def _zamba(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    n, types = c.num_hidden_layers, list(c.layers_block_type)
    kinds = _layer_kinds(types, {"linear_attention": "m", "hybrid": "h"}, "zamba")
    if len(kinds) != n:
        raise ValueError(f"zamba layers_block_type has {len(kinds)} entries but num_hidden_layers "
                         f"is {n}; give one type per layer")
    d_inner, heads = c.mamba_expand * c.hidden_size, c.n_mamba_heads
    mamba = RecurrentSpec((d_inner, c.mamba_d_conv - 1), (heads, d_inner // heads, c.mamba_d_state), dtype)
    attn = AttentionSpec(c.num_key_value_heads, c.attention_head_dim, dtype)
    specs: dict[int, LayerSpec] = {i: mamba for i in range(n)}
    specs.update({n + i: attn for i, k in enumerate(kinds) if k == "h"})
    return specs


def _qwen3_5(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    c = getattr(c, "text_config", None) or c  # a published multimodal config nests the text model
    kinds = _layer_kinds(c.layer_types, {"linear_attention": "g", "full_attention": "a"}, cfg["model_type"])
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    gdn = RecurrentSpec((2 * nk * dk + nv * dv, c.linear_conv_kernel_dim - 1), (nv, dk, dv), dtype)
    attn = AttentionSpec(c.num_key_value_heads, _head_dim(c), dtype)
    return {i: attn if k == "a" else gdn for i, k in enumerate(kinds)}


def _olmo_hybrid(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    kinds = _layer_kinds(c.layer_types, {"linear_attention": "g", "full_attention": "a"}, "olmo_hybrid")
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    gdn = RecurrentSpec((2 * nk * dk + nv * dv, c.linear_conv_kernel_dim - 1), (nv, dk, dv), dtype)
    attn = AttentionSpec(c.num_key_value_heads, _head_dim(c), dtype)
    return {i: attn if k == "a" else gdn for i, k in enumerate(kinds)}


def _mamba(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    d_inner = c.intermediate_size
    spec = RecurrentSpec((d_inner, c.conv_kernel - 1), (d_inner, c.state_size), dtype)
    return {i: spec for i in range(c.num_hidden_layers)}


def _mamba2_only(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    spec = _mamba2(c.num_heads, c.head_dim, c.n_groups, c.state_size, c.conv_kernel, dtype)
    return {i: spec for i in range(c.num_hidden_layers)}


def _recurrent_gemma(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    n, pattern = c.num_hidden_layers, list(c.block_types)
    kinds = _layer_kinds((pattern * n)[:n], {"recurrent": "r", "attention": "a"}, "recurrent_gemma")
    attn = AttentionSpec(c.num_key_value_heads, c.head_dim, dtype, c.attention_window_size)
    # conv window over the LRU width; the RG-LRU state stays float32 as in transformers
    lru = RecurrentSpec((c.lru_width, c.conv1d_width - 1), (c.lru_width,), dtype,
                        None if dtype == torch.float32 else torch.float32)
    return {i: attn if k == "a" else lru for i, k in enumerate(kinds)}


def _minimax(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    kinds = _layer_kinds(c.layer_types, {"linear_attention": "l", "full_attention": "a"}, "minimax")
    head_dim = _head_dim(c)
    attn = AttentionSpec(c.num_key_value_heads, head_dim, dtype, c.sliding_window)
    # lightning attention: a [keys x values] matrix per head, no conv window
    lightning = RecurrentSpec((), (c.num_attention_heads, head_dim, head_dim), dtype)
    return {i: attn if k == "a" else lightning for i, k in enumerate(kinds)}


def _kimi_linear(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    kinds = _layer_kinds(c.layer_types, {"linear_attention": "k", "full_attention": "a"}, cfg["model_type"])
    h, d = c.linear_num_heads, c.linear_head_dim
    # KDA: conv window over q, k and v; the state stays float32 as in transformers
    kda = RecurrentSpec((3 * h * d, c.linear_conv_kernel_dim - 1), (h, d, d), dtype,
                        None if dtype == torch.float32 else torch.float32)
    # MLA: one latent (kv_lora_rank + rope dims) per token, not per-head keys and values
    mla = AttentionSpec(1, c.kv_lora_rank + c.qk_rope_head_dim, dtype, latent=True)
    return {i: mla if k == "a" else kda for i, k in enumerate(kinds)}


def _lara_mini(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    kinds = _layer_kinds(c.layer_types, {"linear_attention": "g", "sliding_attention": "s",
                                         "full_attention": "a"}, "lara_mini")
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    gdn = RecurrentSpec((2 * nk * dk + nv * dv, c.linear_conv_kernel_dim - 1), (nv, dk, dv), dtype)
    return {i: gdn if k == "g" else AttentionSpec(c.num_key_value_heads, _head_dim(c), dtype,
                                                    c.sliding_window if k == "s" else None)
            for i, k in enumerate(kinds)}


def _rwkv(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    spec = RecurrentSpec((2, c.hidden_size), (3, c.attention_hidden_size), dtype,
                         None if dtype == torch.float32 else torch.float32)
    return {i: spec for i in range(c.num_hidden_layers)}


def _zaya(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    n = c.num_hidden_layers
    kinds = _layer_kinds(c.layer_types, {"hybrid": "a", "hybrid_sliding": "s"}, "zaya")
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    cca = RecurrentSpec((q + kv, c.cca_time0 + c.cca_time1 - 2), (kv // 2,), dtype)
    specs: dict[int, LayerSpec] = {i: AttentionSpec(c.num_key_value_heads, c.head_dim, dtype,
                                                    c.sliding_window if k == "s" else None)
                                   for i, k in enumerate(kinds)}
    specs.update({n + i: cca for i in range(n)})
    return specs


def _inkling(cfg: Mapping, dtype: torch.dtype) -> dict[int, LayerSpec]:
    c = hf_config(cfg)
    c = getattr(c, "text_config", None) or c  # a published multimodal config nests the text model
    n = c.num_hidden_layers
    kinds = _layer_kinds(c.layer_types, {"hybrid": "a", "hybrid_sliding": "s"}, "inkling")
    # (layer, virtual layer): Inkling 2 Loop's extra passes over its looped layers are layers of their own
    start, end = getattr(c, "loop_layer_index_start", 0), getattr(c, "loop_layer_index_end", 0)
    extra = [(i, n + (p - 1) * (end - start) + i - start)
             for p in range(1, getattr(c, "loop_num_passes", 1)) for i in range(start, end)]
    visits = [(i, i) for i in range(n)] + extra
    specs: dict[int, LayerSpec] = {}
    for i, v in visits:
        p = "swa_" if kinds[i] == "s" else ""
        kv_heads, head_dim = getattr(c, f"{p}num_key_value_heads"), getattr(c, f"{p}head_dim")
        specs[v] = AttentionSpec(kv_heads, head_dim, dtype, c.sliding_window_size if kinds[i] == "s" else None)
        # the convs stay float32 whatever the compute dtype, as in transformers
        specs[len(visits) + v] = RecurrentSpec((2 * kv_heads * head_dim + 2 * c.hidden_size, c.conv_kernel_size - 1),
                                               (), torch.float32)
    return specs


_BUILDERS = {"bamba": _bamba, "jamba": _jamba, "qwen3_next": _qwen3_next,
             "granitemoehybrid": _granitemoehybrid, "nemotron_h": _nemotron_h, "lfm2": _lfm2, "lfm2_moe": _lfm2,
             "falcon_h1": _falcon_h1, "zamba2": _zamba2, "zamba": _zamba,
             **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), _qwen3_5),
             "mamba": _mamba, "falcon_mamba": _mamba, "mamba2": _mamba2_only,
             "recurrent_gemma": _recurrent_gemma, "olmo_hybrid": _olmo_hybrid, "minimax": _minimax,
             "kimi_linear": _kimi_linear, "bailing_hybrid": _kimi_linear,
             "gpt_oss": _attention_only,  # layer_types: sliding and full attention layers
             "granitemoe_swa": _attention_only, "rwkv": _rwkv, "zaya": _zaya,
             **dict.fromkeys(("inkling_text", "inkling_mm_model", "inkling2_text", "inkling2", "inkling2_loop_text",
                              "inkling2_loop"), _inkling),
             **{kind: (lambda cfg, dtype, b=b: b(hf_config(cfg), dtype)) for kind, b in INDEXED_BUILDERS.items()},
             "lfm3": _lfm3, "lara_mini": _lara_mini}


def specs_from_config(cfg: Mapping, dtype: Optional[torch.dtype] = None) -> dict[int, LayerSpec]:
    """`{cache_key: AttentionSpec | RecurrentSpec}` from a config dict; caches in `dtype` (default:
    the config's torch_dtype). Keys equal the model's `cache_specs()` keys: the layer index, plus
    `num_hidden_layers + i` for falcon_h1's Mamba halves, zamba2's attention sites, zaya's CCA
    states and inkling's conv windows (see the module docstring). Raises ValueError for a
    model_type it does not know or an invalid config."""
    dtype = dtype or config_dtype(cfg)
    kind = cfg["model_type"]
    if kind in ATTENTION_ONLY:
        return _attention_only(cfg, dtype)
    if kind not in _BUILDERS:
        raise ValueError(f"model_type {kind!r} has no spec builder; supported: "
                         f"{sorted(ATTENTION_ONLY + tuple(_BUILDERS))}")
    return _BUILDERS[kind](cfg, dtype)
