"""The checks every model family passes against transformers' model of the same tiny checkpoint,
and the table of families they run over (tests/models/test_families.py: one test per check,
parametrized over FAMILIES), and the shipped built-in models as rows of their own (`builtin`). A
row names the tiny checkpoint and the few numbers where a family differs (chunk sizes, tolerances,
prompt lengths, memory-pressure budgets); a family's own checks live in tests/models/test_<family>.py.
Not collected by pytest: the module name does not start with `test_`.
"""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hybridkv.models import load_model
from hybridkv.models.tiny import make_tiny_checkpoint
from model_harness import Harness, assert_close_rel, assert_greedy_matches_hf, hf_logits

BS = 16
RAGGED_LENGTHS = (1, BS - 1, BS, BS + 1, 3 * BS + 5)  # one token, around a block edge, several blocks
ENGINE_LENGTHS = (1, BS - 1, BS + 1, 3 * BS + 5)
WINDOW = 24  # the tiny Mistral's sliding window (models/mistral.py): its edge falls inside a block


def routing_biases_randomised(path: Path, seed: int, suffix: str) -> Path:
    """Rewrite checkpoint `path` so every tensor whose name ends in `suffix` (a router's bias, which
    transformers' init leaves zero and 1-D noise in make_tiny_checkpoint does not reach: it touches
    parameters only) is N(0, 0.3^2) drawn from `seed`."""
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith(suffix):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.3
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def tiny_nemotron_h(family: str, path, seed: int = 0, **overrides) -> Path:
    """A tiny Nemotron-H checkpoint whose router correction biases are not all zero."""
    path = make_tiny_checkpoint(family, path, seed=seed, **overrides)
    return routing_biases_randomised(path, seed, "e_score_correction_bias")


def tiny_lfm2_moe(family: str, path, seed: int = 0, **overrides) -> Path:
    """A tiny LFM2-MoE checkpoint whose routing `expert_bias` buffers are not all zero."""
    path = make_tiny_checkpoint(family, path, seed=seed, **overrides)
    return routing_biases_randomised(path, seed, "expert_bias")


def tiny_zamba(family: str, path, seed: int = 0, **overrides) -> Path:
    """A tiny Zamba checkpoint whose Mamba scans matter: x_proj (-> dt, B, C) times 10. With
    transformers' init the scan's share of the logits is ~1e-3 (D x skips dominate), so a wrong
    state would hide inside the checks' tolerances; here removing the scans moves them ~10%."""
    path = make_tiny_checkpoint(family, path, seed=seed, **overrides)
    tensors = load_file(str(path / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("x_proj_weight"):
            tensors[name] = t * 10
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def tiny_lara_mini(family: str, path, seed: int = 0, **overrides) -> Path:
    """A tiny Lara Mini checkpoint whose GDN states matter: every A_log set to log(U(0.05, 1))
    (transformers' init: log(U(1, 16)), a decay that forgets within a few tokens). With that init,
    zeroing the states after 32 of 53 tokens moved the logits 0.78%; here ~78%."""
    path = make_tiny_checkpoint(family, path, seed=seed, **overrides)
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("linear_attn.A_log"):
            tensors[name] = (torch.rand(t.shape, generator=g) * 0.95 + 0.05).log()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def mamba2_scans_that_matter(path: Path, seed: int) -> Path:
    """Rewrite checkpoint `path` so its Mamba2 scans matter: every mixer's dt_bias set so
    softplus(dt_bias) lies in [0.1, 1] (transformers' init: [0.001, 0.1]) and the B and C rows of
    its in_proj times 3. Not through time_step_min: Zamba2 and others clamp dt to it in prefill but
    not in decode, so a larger one makes transformers' own two paths disagree."""
    from hybridkv.models.mamba2_mixer import Mamba2Mixer

    mixer = next(m for m in load_model(path).modules() if isinstance(m, Mamba2Mixer))
    rows = tuple(mixer.in_proj.weight.shape)  # z | x | B | C | dt
    bc = slice(2 * mixer.d_inner, 2 * mixer.d_inner + 2 * mixer.n_groups * mixer.d_state)
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(path / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("in_proj.weight") and tuple(t.shape) == rows:
            t = t.clone()
            t[bc] *= 3
            tensors[name] = t
        elif name.endswith("dt_bias") and tuple(t.shape) == (mixer.num_heads,):
            dt = torch.exp(torch.rand(t.shape, generator=g) * math.log(10) + math.log(0.1))
            tensors[name] = dt + torch.log(-torch.expm1(-dt))  # softplus^-1
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def tiny_zamba2(family: str, path, seed: int = 0, **overrides) -> Path:
    """A tiny Zamba2 checkpoint whose scans matter: with transformers' init, dropping them (y = D x)
    moves the logits 0.69% max (0.36% mean), where a wrong state could hide; here 13.8% (6.2%)."""
    return mamba2_scans_that_matter(make_tiny_checkpoint(family, path, seed=seed, **overrides), seed)


def tiny_nemotron_h_scans(family: str, path, seed: int = 0, **overrides) -> Path:
    """tiny_nemotron_h whose scans matter: dropping them moved the logits 1.5% max (0.37% mean)."""
    return mamba2_scans_that_matter(tiny_nemotron_h(family, path, seed=seed, **overrides), seed)


def tiny_granitemoe_swa(family: str, path, seed: int = 0, **overrides) -> Path:
    """A tiny GraniteMoeSWA checkpoint whose attention sinks are N(0, 0.3^2) (transformers' init:
    zero, plus make_tiny_checkpoint's N(0, 0.1^2) noise)."""
    path = make_tiny_checkpoint(family, path, seed=seed, **overrides)
    return routing_biases_randomised(path, seed, "self_attn.sinks")


def tiny_rwkv(family: str, path, seed: int = 0, **overrides) -> Path:
    """A tiny RWKV checkpoint whose tokens matter: the embeddings times 1e4 (std ~1). transformers'
    init (std 1e-4) puts them below the LayerNorm's eps, so pre_ln's bias made every position's
    logits nearly the same and greedy runs one repeated token."""
    path = make_tiny_checkpoint(family, path, seed=seed, **overrides)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["rwkv.embeddings.weight"] = tensors["rwkv.embeddings.weight"] * 1e4
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def tiny_zaya(family: str, path, seed: int = 0, **overrides) -> Path:
    """A tiny Zaya checkpoint whose attention, tokens and states matter: every key scale
    `qk_norm.temp` from U(1, 3) (transformers' init 0 plus make_tiny_checkpoint's N(0, 0.1^2) noise
    leaves softmax nearly uniform), the routers' `balancing_biases` N(0, 0.1^2) (init 0; the skip
    class's -1 is forced after loading by transformers and the engine alike), the embeddings times 3
    and the residual affines' and input's biases times 0.2 (with transformers' init their constant
    outweighed the tokens and greedy repeated one token). Zeroing the CCA windows after 32 of 53
    tokens then moves the next logits ~6%, the delayed values ~70%."""
    path = make_tiny_checkpoint(family, path, seed=seed, **overrides)
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("qk_norm.temp"):
            tensors[name] = torch.rand(t.shape, generator=g) * 2 + 1
        elif name.endswith("balancing_biases"):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.1
        elif name == "model.embed_tokens.weight":
            tensors[name] = t * 3
        elif name.endswith("input_hidden_states_bias") or ("residual_scale." in name and name.endswith("_bias")):
            tensors[name] = t * 0.2
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def tiny_inkling2(family: str, path, seed: int = 0, **overrides) -> Path:
    """A tiny Inkling 2 checkpoint (saved under the published names) whose 2-D parameters that
    transformers initialises to constants are random: the block-residual queries (`attn_res.*`,
    zero: uniform mixes) N(0, 1), the full layers' static conv taps (`static_w`, zero) N(0, 0.3^2),
    the clip scales (one) U(0.5, 1.5), and the routing biases (`mlp.gate.bias`, zero) N(0, 0.1^2)."""
    path = make_tiny_checkpoint(family, path, seed=seed, **overrides)
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if ".attn_res." in name or "message_input" in name:  # (Inkling 2 Loop's message queries too)
            tensors[name] = torch.randn(t.shape, generator=g)
        elif name.endswith("static_w"):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.3
        elif name.endswith("_l2_clip.scale"):
            tensors[name] = torch.rand(t.shape, generator=g) + 0.5
        elif name.endswith("mlp.gate.bias"):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.1
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def tiny_glm5_next(family: str, path, seed: int = 0, **overrides) -> Path:
    """A tiny GLM-5-Next checkpoint (the multimodal model, saved under the published names) whose
    indexer and hyper-connections are not at their constant init: the k-pool position offsets
    `index_kpool_compress_ape` (zero) N(0, 1), the k-pool gate `index_kpool_compress_gate` (ones)
    N(0, 0.3^2), the hyper-connection projections `hc_*_fn` times 10."""
    path = make_tiny_checkpoint(family, path, seed=seed, **overrides)
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("index_kpool_compress_ape"):
            tensors[name] = torch.randn(t.shape, generator=g)
        elif name.endswith("index_kpool_compress_gate"):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.3
        elif name.endswith(("hc_attn_fn", "hc_ffn_fn")):
            tensors[name] = t * 10
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def tiny_qwen4_exp(family: str, path, seed: int = 0, **overrides) -> Path:
    """A tiny Qwen4-Exp checkpoint whose PLE convolutions (transformers' init: zero) are N(0, 0.3^2),
    so the n-gram context and the dilated conv window both reach the logits."""
    path = make_tiny_checkpoint(family, path, seed=seed, **overrides)
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("ple.conv1d.weight"):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.3
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def builtin_checkpoint(name: str, path, seed: int = 0) -> Path:
    """The shipped folder of built-in model `name` (hybridkv/builtin_models/<name>, loaded as
    "hybridkv/<name>"); `path` and `seed` are unused: its trained weights are the case."""
    from hybridkv.models.loader import resolve_checkpoint

    return resolve_checkpoint("hybridkv/" + name)


@dataclass(frozen=True)
class PressureCase:
    """The engine under memory pressure: exactly `blocks` KV blocks of BS tokens and 3 live state
    slots (1 + 3 with the null slot), at most 3 running requests and 24 batched tokens."""

    blocks: int = 6
    # prompt lengths, each drawn as prompt(n, 50 + n); None: engine_fixtures.ragged_prompts(6, seed=5)
    lengths: Optional[tuple[int, ...]] = (1, BS - 1, BS + 1, 3 * BS + 5, 40)
    max_tokens: int = 12
    exact_blocks: bool = False  # also assert the engine holds exactly `blocks` KV blocks


@dataclass
class Family:
    """One row of the table: a tiny checkpoint and the numbers where the family's checks differ."""

    name: str  # the tiny checkpoint kind (hybridkv.models.tiny) and the test id
    seed: int
    overrides: dict = field(default_factory=dict)  # tiny_config overrides
    logits_len: int = 3 * BS + 5  # prompt length of the one-pass logits check
    ragged: tuple[int, ...] = RAGGED_LENGTHS  # prompt lengths of the ragged greedy batch
    chunks: tuple[int, ...] = (5, 16, 7, 1, 16)  # uneven prefill chunks (a 1 takes the decode path)
    chunk_tol: float = 1e-4
    engine: Optional[tuple[tuple[int, ...], int]] = None  # (prompt lengths, seed) for LLM.generate
    names: Optional[tuple[str, str]] = None  # (published tensor, stacked suffix) of transformers' names
    hf_attn: Optional[str] = None  # transformers' attn_implementation (None: its default)
    make: Callable[..., Path] = make_tiny_checkpoint
    pressure: Optional[PressureCase] = None  # check_engine_under_pressure, in both preemption modes
    prefix_migration: bool = False  # check_prefix_hit_and_migration
    prefix_hit: bool = False  # check_prefix_hit_resumes

    @property
    def builtin(self) -> bool:
        """A shipped, trained checkpoint (hybridkv/builtin_models), not a registered family's tiny one."""
        return self.make is builtin_checkpoint


FAMILIES = {f.name: f for f in [
    # attention only: each chunk reads the KV blocks written so far
    Family("llama", seed=1, overrides=dict(attention_bias=True), chunks=(5, 16, 7, 12), chunk_tol=1e-5),
    # prompts shorter than the window and 2-3 windows long; chunks cross the window edge, one is
    # wider than the window; eager attention applies transformers' sliding-window mask as is
    Family("mistral", seed=4, logits_len=3 * WINDOW + 5, ragged=(*RAGGED_LENGTHS, 3 * WINDOW + 5),
           chunks=(5, 16, 7, 1, WINDOW + 6, 3, 1, 16), chunk_tol=1e-5,
           engine=((1, BS - 1, WINDOW + 1, 3 * BS + 5, 3 * WINDOW + 5), 60), hf_attn="eager"),
    # recurrent families: chunks resume from the slot's conv window and SSM / GDN state
    Family("bamba", seed=2),
    Family("jamba", seed=3),
    Family("qwen3_next", seed=3),
    # chunks of 1 and 2 tokens are shorter than the conv window (k-1 = 2): the window carries over
    Family("lfm2", seed=3, chunks=(5, 16, 7, 1, 2, 14), engine=((1, 7, BS, BS + 1, 37), 20)),
    Family("granitemoehybrid", seed=3, engine=(ENGINE_LENGTHS, 40),
           names=("model.layers.0.block_sparse_moe.input_linear.weight",
                  "block_sparse_moe.experts.gate_up_proj")),
    Family("nemotron_h", seed=5, make=tiny_nemotron_h_scans, engine=(ENGINE_LENGTHS, 40),
           names=("backbone.layers.3.mixer.experts.0.up_proj.weight", "mixer.experts.up_proj")),
    Family("falcon_h1", seed=5, engine=(ENGINE_LENGTHS, 40)),  # two cache keys per layer
    # one KV cache per shared-block site; scans made to matter (tiny_zamba2)
    Family("zamba2", seed=2, make=tiny_zamba2, engine=(ENGINE_LENGTHS, 40)),
    # Qwen3-Next's layers with split GDN projections; dense, and MoE in every layer
    Family("qwen3_5", seed=6, engine=(ENGINE_LENGTHS, 40)),
    Family("qwen3_5_moe", seed=6, engine=(ENGINE_LENGTHS, 40),
           names=("model.layers.0.mlp.experts.0.gate_proj.weight", "mlp.experts.gate_up_proj")),
    # no attention at all: zero KV blocks, states only (engine checks in test_pure_recurrent.py)
    Family("mamba", seed=7, engine=(ENGINE_LENGTHS, 40)),
    Family("mamba2", seed=7, engine=(ENGINE_LENGTHS, 40)),
    Family("falcon_mamba", seed=7, engine=(ENGINE_LENGTHS, 40)),
    # RG-LRU state beside local attention (window 24, as the tiny Mistral's): chunks cross the
    # window edge and resume the conv window and the RG-LRU state
    Family("recurrent_gemma", seed=8, logits_len=3 * WINDOW + 5, ragged=(*RAGGED_LENGTHS, 3 * WINDOW + 5),
           chunks=(5, 16, 7, 1, WINDOW + 6, 3, 1, 16),
           engine=((1, BS - 1, WINDOW + 1, 3 * BS + 5, 3 * WINDOW + 5), 60), hf_attn="eager",
           pressure=PressureCase(blocks=5, lengths=(1, BS - 1, WINDOW + 1, 3 * BS + 5, 3 * WINDOW + 5), max_tokens=16)),
    # LFM2's layers with a dense feed-forward, then a sigmoid-routed MoE with an expert bias
    Family("lfm2_moe", seed=9, make=tiny_lfm2_moe, chunks=(5, 16, 7, 1, 2, 14), engine=(ENGINE_LENGTHS, 40),
           names=("model.layers.1.feed_forward.experts.0.w1.weight", "feed_forward.experts.gate_up_proj"),
           pressure=PressureCase(), prefix_migration=True),
    # multi-head Mamba1 + ONE shared attention block (its own KV cache per hybrid layer)
    Family("zamba", seed=10, make=tiny_zamba, engine=(ENGINE_LENGTHS, 40), pressure=PressureCase(),
           prefix_migration=True),
    # GDN (beta up to 2) beside post-norm attention with whole-projection q/k norms
    Family("olmo_hybrid", seed=12, engine=(ENGINE_LENGTHS, 40),
           names=("model.layers.0.linear_attn.q_conv1d.weight", "linear_attn.conv1d.weight"),
           pressure=PressureCase(), prefix_migration=True),
    # lightning attention (a decayed matrix state, no conv window) beside softmax attention, MoE
    Family("minimax", seed=9, engine=(ENGINE_LENGTHS, 40),
           names=("model.layers.0.block_sparse_moe.experts.0.w1.weight", "mlp.experts.gate_up_proj"),
           pressure=PressureCase(lengths=None), prefix_hit=True),
    # Kimi delta attention (per-channel gates) beside latent attention (pages hold one latent per
    # token); DeepSeek-V3 routing, its correction biases randomised as Nemotron-H's
    Family("kimi_linear", seed=11, make=tiny_nemotron_h, engine=(ENGINE_LENGTHS, 40),
           names=("model.layers.0.self_attn.q_conv1d.weight", "mlp.experts.gate_up_proj"),
           pressure=PressureCase(lengths=None, exact_blocks=True), prefix_hit=True),
    # Ling 3: KDA with a bounded forget gate beside gated, rotary latent attention; Ling's published
    # names (attention.dense, word_embeddings, split convs) in the saved checkpoint, whose routing
    # correction biases are saved as `expert_bias` (randomised as LFM2-MoE's)
    Family("bailing_hybrid", seed=13, make=tiny_lfm2_moe, engine=(ENGINE_LENGTHS, 40),
           names=("model.layers.0.attention.q_conv1d.weight", "mlp.experts.gate_up_proj"),
           pressure=PressureCase(lengths=None, exact_blocks=True), prefix_hit=True),
    # sliding and full attention layers alternate (two KV groups), attention sinks, clamped-SwiGLU MoE
    Family("gpt_oss", seed=14, logits_len=3 * WINDOW + 5, ragged=(*RAGGED_LENGTHS, 3 * WINDOW + 5),
           chunks=(5, 16, 7, 1, WINDOW + 6, 3, 1, 16), chunk_tol=1e-5,
           engine=((1, BS - 1, WINDOW + 1, 3 * BS + 5, 3 * WINDOW + 5), 60), hf_attn="eager"),
    # short conv beside sliding-window and full attention (two KV groups and conv slots), a rope per
    # layer type, a sigmoid gate per head, sandwich norms
    Family("lfm3", seed=15, logits_len=3 * WINDOW + 5, ragged=(*RAGGED_LENGTHS, 3 * WINDOW + 5),
           chunks=(5, 16, 7, 1, WINDOW + 6, 3, 1, 16), engine=((1, BS - 1, WINDOW + 1, 3 * BS + 5, 3 * WINDOW + 5), 60),
           hf_attn="eager"),
    # GDN beside sliding-window (rope) and full (no rope) attention, MoE with an ungated shared
    # expert; saved with the published fused GDN `in_proj` and `out_norm`
    Family("lara_mini", seed=16, make=tiny_lara_mini, logits_len=3 * WINDOW + 5, ragged=(*RAGGED_LENGTHS, 3 * WINDOW + 5),
           chunks=(5, 16, 7, 1, WINDOW + 6, 3, 1, 16), engine=((1, BS - 1, WINDOW + 1, 3 * BS + 5, 3 * WINDOW + 5), 60),
           names=("model.layers.0.linear_attn.in_proj.weight", "linear_attn.in_proj_qkv.weight"), hf_attn="eager",
           pressure=PressureCase(), prefix_migration=True),
    # sliding and full attention layers (two KV groups), sinks, a rope base per layer (one without),
    # Granite's multipliers, MoE beside a shared MLP
    Family("granitemoe_swa", seed=17, make=tiny_granitemoe_swa, logits_len=3 * WINDOW + 5,
           ragged=(*RAGGED_LENGTHS, 3 * WINDOW + 5), chunks=(5, 16, 7, 1, WINDOW + 6, 3, 1, 16),
           engine=((1, BS - 1, WINDOW + 1, 3 * BS + 5, 3 * WINDOW + 5), 60), hf_attn="eager",
           pressure=PressureCase(), prefix_migration=True),
    # RWKV-4: no attention; per layer two token shifts and the WKV num / den / max in one slot
    Family("rwkv", seed=18, make=tiny_rwkv, engine=(ENGINE_LENGTHS, 40), prefix_migration=True),
    # Zaya: CCA attention (a q/k conv window and a delayed value per slot, KV pages in a sliding or
    # full group), a float32 residual stream with affine joins, a top-1 router with a state across layers
    Family("zaya", seed=19, make=tiny_zaya, logits_len=3 * WINDOW + 5, ragged=(*RAGGED_LENGTHS, 3 * WINDOW + 5),
           chunks=(5, 16, 7, 1, WINDOW + 6, 3, 1, 16), engine=((1, BS - 1, WINDOW + 1, 3 * BS + 5, 3 * WINDOW + 5), 60),
           hf_attn="eager", pressure=PressureCase(), prefix_migration=True, prefix_hit=True),
    # Inkling: relative-bias attention (sliding with its own head shapes, and full with log scaling),
    # four short-conv windows per layer in a state slot, MoE with a shared expert in the routing
    Family("inkling", seed=20, logits_len=3 * WINDOW + 5, ragged=(*RAGGED_LENGTHS, 3 * WINDOW + 5),
           chunks=(5, 16, 7, 1, WINDOW + 6, 3, 1, 16), engine=((1, BS - 1, WINDOW + 1, 3 * BS + 5, 3 * WINDOW + 5), 60),
           hf_attn="eager", pressure=PressureCase(), prefix_migration=True, prefix_hit=True),
    # Inkling 2: Inkling's memory (KV + four conv windows per layer) with clipped projections, per-query
    # sinks, dynamic k/v convs on full layers, block attention residuals, softcapped experts and logits
    Family("inkling2", seed=21, make=tiny_inkling2, logits_len=3 * WINDOW + 5, ragged=(*RAGGED_LENGTHS, 3 * WINDOW + 5),
           chunks=(5, 16, 7, 1, WINDOW + 6, 3, 1, 16), engine=((1, BS - 1, WINDOW + 1, 3 * BS + 5, 3 * WINDOW + 5), 60),
           names=("model.llm.layers.1.mlp.experts.w13_weight", "mlp.experts.gate_up_proj"),
           hf_attn="eager", pressure=PressureCase(), prefix_migration=True, prefix_hit=True),
    # Inkling 2 Loop: Inkling 2 with layers 2-3 run twice per token (a KV group entry and conv windows
    # per pass), messages from the first pass gated into the second
    Family("inkling2_loop", seed=22, make=tiny_inkling2, logits_len=3 * WINDOW + 5, ragged=(*RAGGED_LENGTHS, 3 * WINDOW + 5),
           chunks=(5, 16, 7, 1, WINDOW + 6, 3, 1, 16), engine=((1, BS - 1, WINDOW + 1, 3 * BS + 5, 3 * WINDOW + 5), 60),
           hf_attn="eager", pressure=PressureCase(), prefix_migration=True, prefix_hit=True),
    # GLM-5-Next: KDA beside DSA (latent KV pages, the indexer's own pages of key | k-pool gate, a
    # top-k over pools of 4, one layer sharing the previous selection), hyper-connection streams
    Family("glm5_next", seed=23, make=tiny_glm5_next, engine=(ENGINE_LENGTHS, 40), hf_attn="eager",
           names=("model.language_model.layers.1.mlp.experts.0.gate_proj.weight", "mlp.experts.gate_up_proj"),
           pressure=PressureCase(), prefix_migration=True, prefix_hit=True),
    # Qwen4-Exp: GDN beside QSA attention (KV pages, the indexer's raw-key latent pages, a top-k over
    # block means of 4), PLE n-gram embeddings (a dilated conv window and the last two ids per slot),
    # gated hyper-connection streams
    Family("qwen4_exp", seed=24, make=tiny_qwen4_exp, engine=(ENGINE_LENGTHS, 40), hf_attn="eager",
           names=("model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight", "ple_embedding.ngram_embedding.weight"),
           pressure=PressureCase(), prefix_migration=True, prefix_hit=True),
    # the shipped built-in models (trained Bambas, bf16 weights computed in float32): their own
    # weights, not random ones, through every check and the engine
    Family("tiny-code", seed=0, make=builtin_checkpoint, engine=(ENGINE_LENGTHS, 40), prefix_hit=True),
    Family("tiny-code-draft", seed=0, make=builtin_checkpoint, engine=(ENGINE_LENGTHS, 40)),
]}


def prompt(n: int, seed: int) -> list[int]:
    """n token ids in [4, 128) drawn from `seed` (ids 0-3 are left to special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 128, (n,), generator=g).tolist()


def load_pair(path, attn_implementation: Optional[str] = None):
    """(our model, transformers' float32 model in eval mode), both from checkpoint dir `path`."""
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    config = AutoConfig.from_pretrained(path)
    # a multimodal family with no ForCausalLM class (GLM-5-Next): its whole model, run on text
    auto = AutoModelForCausalLM if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModelForImageTextToText
    hf = auto.from_pretrained(path, dtype=torch.float32, **kw).eval()
    return load_model(path), hf


def load_family(fam: Family, path) -> tuple[Path, object, object]:
    """(checkpoint dir, our model, transformers' model) for table row `fam`, written under `path`."""
    ckpt = fam.make(fam.name, path, seed=fam.seed, **fam.overrides)
    return (ckpt, *load_pair(ckpt, fam.hf_attn))


def check_prompt_logits(ours, hf, n: int = 3 * BS + 5, seed: int = 0) -> torch.Tensor:
    """One n-token prompt in one pass: logits [n, vocab] within 1e-4 x max|ref| of transformers'.
    Returns our logits for family-specific checks."""
    h = Harness(ours, block_size=BS)
    tokens = prompt(n, seed)
    logits = h.step([(h.add(tokens), len(tokens))], return_all_logits=True)
    assert logits.shape == (n, ours.vocab_size) and logits.dtype == torch.float32
    assert_close_rel(logits, hf_logits(hf, tokens))
    return logits


def check_ragged_batch_greedy(ours, hf, lengths=RAGGED_LENGTHS, steps: int = 20):
    """Prompts of `lengths` prefilled in ONE ragged batch, then `steps` greedy decodes together:
    every token is transformers' greedy choice, with no ties allowed."""
    h = Harness(ours, block_size=BS)
    prompts = [prompt(n, 10 + n) for n in lengths]
    seqs = [h.add(p) for p in prompts]
    h.prefill(seqs)
    generated = h.decode(seqs, steps)
    for p, g in zip(prompts, generated):
        assert assert_greedy_matches_hf(hf, p, g) == 0


def check_uneven_chunks_equal_one_pass(ours, chunks=(5, 16, 7, 1, 16), tol: float = 1e-4):
    """A prompt of sum(chunks) tokens prefilled in those uneven chunks (a one-token chunk takes the
    decode path), while another request rides along (first prefilling, then decoding), gives
    the logits of one pass over the whole prompt within rtol = atol = `tol`."""
    tokens = prompt(sum(chunks), 3)
    one = Harness(ours, block_size=BS, seed=1)
    ref = one.step([(one.add(tokens), len(tokens))], return_all_logits=True)
    h = Harness(ours, block_size=BS, seed=2)
    seq, other = h.add(tokens), h.add(prompt(9, 4))
    got = []
    for n in chunks:
        # each chunk resumes from the slot's state and the KV blocks written so far
        work = [(seq, n)] + ([(other, len(other.tokens) - other.num_computed)]
                             if other.num_computed < len(other.tokens) else [])
        got.append(h.step(work, return_all_logits=True)[:n])
        if other.num_computed == len(other.tokens):
            other.tokens.append(7)
    assert sum(t.shape[0] for t in got) == len(tokens) == seq.num_computed
    torch.testing.assert_close(torch.cat(got), ref, rtol=tol, atol=tol)


def check_state_checkpoint_at_block_boundary(ours, hf):
    """A state checkpoint taken at a block boundary, copied into a fresh slot after the original
    went on, continues exactly like the uninterrupted run, which is transformers' greedy output.
    The full KV blocks before the boundary are shared (for attention-only models that is all)."""
    h = Harness(ours, block_size=BS)
    tokens = prompt(2 * BS + 6, 5)
    full = h.add(tokens)
    h.prefill([full])
    full_prompt_logits = full.last_logits.clone()
    want = h.decode([full], 12)[0]
    assert assert_greedy_matches_hf(hf, tokens, want) == 0

    base = h.add(tokens)
    h.step([(base, 2 * BS)])  # stop exactly at a block boundary
    ckpt = h.checkpoint(base)  # state copied into a fresh slot, full blocks shared
    h.prefill([base])  # the original goes on; the checkpoint copy must not change
    h.decode([base], 3)
    fork = h.checkpoint(ckpt)  # copy-on-hit: continue from a copy of the checkpoint
    fork.tokens += tokens[2 * BS:]
    h.prefill([fork])
    # logits too, not only greedy tokens: a wrong state can leave short greedy runs unchanged
    torch.testing.assert_close(fork.last_logits, full_prompt_logits, rtol=1e-4, atol=1e-4)
    assert h.decode([fork], 12)[0] == want


def check_engine_generate(path, hf, lengths=(1, BS - 1, BS + 1, 3 * BS + 5), seed: int = 40,
                          max_tokens: int = 12):
    """`LLM(path).generate` of prompts of `lengths` (seeds `seed + n`): `max_tokens` greedy tokens
    each, all transformers' greedy choices; afterwards no KV block, slot or request is left."""
    from engine_fixtures import assert_no_leaks  # the engine only here: model checks need none of it
    from hybridkv import LLM, SamplingParams

    prompts = [prompt(n, seed + n) for n in lengths]
    llm = LLM(str(path), memory_budget_bytes=16 << 20)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert len(o.outputs[0].token_ids) == max_tokens
        assert assert_greedy_matches_hf(hf, p, list(o.outputs[0].token_ids)) == 0
    assert_no_leaks(llm)


def check_transformers_names_load_the_same(ours, hf, path: Path, tmp_path: Path, published: str,
                                           stacked_suffix: str):
    """The checkpoint at `path` holds the published tensor name `published`; a copy re-saved with
    transformers' in-memory state dict (which has a key ending in `stacked_suffix`, e.g. stacked
    experts) loads into a model whose logits equal `ours` bit for bit."""
    assert published in load_file(str(path / "model.safetensors"))
    shutil.copytree(path, tmp_path / "ckpt")
    state = {k: v.clone() for k, v in hf.state_dict().items()}  # clone: tied tensors share memory
    assert any(k.endswith(stacked_suffix) for k in state)
    save_file(state, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    again = load_model(tmp_path / "ckpt")
    tokens = prompt(BS + 3, 9)
    a, b = Harness(ours), Harness(again)
    torch.testing.assert_close(a.step([(a.add(tokens), len(tokens))], return_all_logits=True),
                               b.step([(b.add(tokens), len(tokens))], return_all_logits=True),
                               rtol=0, atol=0)


def check_engine_under_pressure(path, ours, hf, case: PressureCase, mode: str):
    """`LLM.generate` under `case`'s tight budget with preemption `mode` ("recompute" or "swap"):
    requests are preempted (KV blocks and states together) at least once in that mode and resume
    to transformers' greedy tokens; afterwards no KV block, slot or request is left."""
    from engine_fixtures import assert_no_leaks, greedy, ragged_prompts, tight_budget
    from hybridkv import LLM

    if case.lengths is None:
        prompts = ragged_prompts(6, ours.vocab_size, seed=5)
    else:
        prompts = [prompt(n, 50 + n) for n in case.lengths]
    llm = LLM(str(path), memory_budget_bytes=tight_budget(ours.cache_specs(), BS, blocks=case.blocks, slots=1 + 3),
              max_num_seqs=3, max_num_batched_tokens=24, preemption_mode=mode, checkpoint_share=0.0)
    if case.exact_blocks:
        assert llm.stats()["kv_blocks_total"] == case.blocks
    outs = llm.generate(prompts, greedy(case.max_tokens), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert assert_greedy_matches_hf(hf, p, o.outputs[0].token_ids) == 0
    assert llm.stats()["preemptions"][mode] > 0
    assert_no_leaks(llm)


def check_burst_computes_the_shared_prefix_once(path, hf):
    """Three prompts sharing 40 tokens arrive together: the followers wait for the leader's
    checkpoint at 2 blocks of BS (every kind's memory there) and resume at it; all outputs are
    transformers' greedy tokens and nothing leaks."""
    from engine_fixtures import assert_no_leaks, greedy
    from hybridkv import LLM

    llm = LLM(str(path), memory_budget_bytes=4 << 20)
    shared = prompt(40, 41)
    prompts = [shared + prompt(3 + i, 42 + i) for i in range(3)]
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 2 * BS, 2 * BS]
    assert llm.stats()["burst_waits"] >= 2
    for p, o in zip(prompts, outs):
        assert assert_greedy_matches_hf(hf, p, o.outputs[0].token_ids) == 0
    assert_no_leaks(llm)


def check_tensor_parallel_refused_by_name(path, architecture: str):
    """LLM(path, tensor_parallel_size=2) raises a ValueError naming the architecture."""
    import pytest

    from hybridkv import LLM

    with pytest.raises(ValueError, match=f"tensor_parallel_size=2 is not supported for {architecture}"):
        LLM(str(path), tensor_parallel_size=2)


def check_prefix_hit_and_migration(path, hf):
    """Two prompts sharing 40 tokens: the second hits the first's prompt-end checkpoint (2 blocks of
    BS), is exported mid-decode through snapshot bytes and imported into an engine with block size 8,
    where it finishes; both outputs are transformers' greedy tokens and neither engine leaks."""
    from engine_fixtures import assert_no_leaks, greedy
    from hybridkv import LLM
    from hybridkv.scheduler.snapshot_io import snapshot_from_bytes, snapshot_to_bytes

    src = LLM(str(path), memory_budget_bytes=4 << 20, checkpoint_policy="prompt_end",
              max_num_batched_tokens=32)
    shared = prompt(40, 61)
    first, second = shared + prompt(3, 62), shared + prompt(6, 63)
    a = src.generate([first], greedy(8), use_tqdm=False)[0]
    rid = src.add_request(second, greedy(12))
    for _ in range(4):  # the suffix past the hit, then decodes
        src.step()
    snap = snapshot_from_bytes(snapshot_to_bytes(src.export_request(rid)))
    assert snap.num_computed_tokens > snap.num_prompt_tokens
    dst = LLM(str(path), memory_budget_bytes=4 << 20, block_size=8)  # another block size
    dst.import_request(snap)
    out = None
    while dst.has_unfinished_requests():
        out = next((o for o in dst.step() if o.finished), out)
    assert src.stats()["prefix_hit_tokens"] == 2 * BS
    for p, o in ((first, a), (second, out)):
        assert assert_greedy_matches_hf(hf, p, o.outputs[0].token_ids) == 0
    assert_no_leaks(src)
    assert_no_leaks(dst)


def check_prefix_hit_resumes(path, hf):
    """Two prompts sharing 40 tokens, one after the other: the first has no hit, the second resumes
    from the first's prompt-end checkpoint (2 blocks of BS: shared KV pages, a copied state); both
    are transformers' greedy tokens and nothing leaks."""
    from engine_fixtures import assert_no_leaks, greedy
    from hybridkv import LLM

    llm = LLM(str(path), memory_budget_bytes=8 << 20, checkpoint_policy="prompt_end")
    shared = prompt(40, 31)
    first, second = shared + prompt(5, 32), shared + prompt(9, 33)
    a = llm.generate([first], greedy(8), use_tqdm=False)[0]
    b = llm.generate([second], greedy(8), use_tqdm=False)[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 2 * BS
    assert llm.stats()["prefix_hit_tokens"] == 2 * BS
    for p, o in ((first, a), (second, b)):
        assert assert_greedy_matches_hf(hf, p, o.outputs[0].token_ids) == 0
    assert_no_leaks(llm)


def check_migration_mid_decode(path, hf, check_snapshot: Callable, block_size: int = 32):
    """Four prompts (1, BS-1, BS+1, 3BS+5 tokens) run 5 steps; the middle two are exported
    mid-decode through snapshot bytes (each checked by `check_snapshot(snap)`, the family's layout)
    and imported into an engine of `block_size`; every request finishes with transformers' greedy
    tokens, 2 migrations out and 2 in, and neither engine leaks."""
    from engine_fixtures import assert_no_leaks, greedy
    from hybridkv import LLM
    from hybridkv.scheduler.snapshot_io import snapshot_from_bytes, snapshot_to_bytes

    src = LLM(str(path), memory_budget_bytes=8 << 20, max_num_batched_tokens=32)
    dst = LLM(str(path), memory_budget_bytes=8 << 20, block_size=block_size)  # another block size
    prompts = [prompt(n, 90 + n) for n in (1, BS - 1, BS + 1, 3 * BS + 5)]
    ids = [src.add_request(p, greedy(12)) for p in prompts]
    for _ in range(5):  # prefill (the long prompt in two chunks) and a few decodes
        src.step()
    for i in ids[1:3]:
        snap = snapshot_from_bytes(snapshot_to_bytes(src.export_request(i)))
        assert snap.num_computed_tokens > snap.num_prompt_tokens  # mid-decode
        check_snapshot(snap)
        dst.import_request(snap)
    done = {}
    for llm in (src, dst):
        while llm.has_unfinished_requests():
            for o in llm.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
    for p, i in zip(prompts, ids):
        assert assert_greedy_matches_hf(hf, p, done[i]) == 0
    assert src.stats()["migrations"]["out"] == 2 and dst.stats()["migrations"]["in"] == 2
    assert_no_leaks(src)
    assert_no_leaks(dst)


def generate_holding_the_window(llm, tokens: list[int], max_tokens: int):
    """Run one request of `tokens` for `max_tokens` greedy tokens on `llm` (a model with sliding
    layers of WINDOW beside full attention): while it decodes, its sliding group holds at most
    ceil(WINDOW / BS) + 1 blocks (and reaches that), its full group every block so far. Returns
    the finished output, for the caller's comparison with transformers."""
    from engine_fixtures import greedy

    mgr = llm.manager
    sliding, full = mgr.attention_groups[WINDOW], mgr.attention_groups[None]
    rid = llm.add_request(tokens, greedy(max_tokens))
    peak, out = 0, None
    while llm.has_unfinished_requests():
        out = next((o for o in llm.step() if o.finished), out)
        if rid in mgr.requests:
            r = mgr.request(rid)
            if r.num_computed_tokens > r.num_prompt_tokens:
                assert len(sliding.held_blocks(rid)) <= -(-WINDOW // BS) + 1
                assert len(full.held_blocks(rid)) >= -(-r.num_computed_tokens // BS)
                peak = max(peak, len(sliding.held_blocks(rid)))
    assert peak == -(-WINDOW // BS) + 1
    assert out.request_id == rid and len(out.outputs[0].token_ids) == max_tokens
    return out
