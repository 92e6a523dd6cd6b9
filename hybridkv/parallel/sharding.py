"""Cut a loaded model to one tensor-parallel rank's shard, as vLLM does, in place.

- Attention: q/k/v column-parallel by heads (KV heads replicated when fewer than ranks), o_proj
  row-parallel, then an all-reduce. Per-head q/k norms and the output gate follow their heads.
- Gated MLP: gate/up column-parallel, down row-parallel + all-reduce.
- Sparse MoE: every expert's intermediate dimension is split (all experts on every rank, so
  routing is unchanged); the shared expert likewise; ONE all-reduce after routed + gated shared
  (the gate is a per-token scalar, so it commutes with the sum).
- Mamba2: heads split (z, x, dt, A, D, conv channels, norm weight and SSM state with them); B/C
  groups split with them, or replicated when one group serves all heads and no grouped norm spans
  ranks. Out_proj row-parallel + all-reduce.
- GDN (Qwen3-Next, Qwen3.5): key heads split, each with its value heads; conv channels (q | k | v) and the
  state follow; out_proj row-parallel + all-reduce.
- Mamba1 (Mamba, FalconMamba, Jamba): inner channels split (in_proj's x | z, conv, dt_proj's rows,
  A, D, conv and SSM state). x_proj is row-parallel over those channels: its output dt | B | C is
  all-reduced right away, BEFORE the dt / B / C norms (a norm of a partial sum is not the norm of
  the sum), then every rank holds the full dt | B | C. Out_proj row-parallel + all-reduce.
- Plain MLPs of other families (Nemotron-H's relu2 up/down, GraniteMoeHybrid's input_linear
  a | b / output_linear) and Nemotron-H's MoE (stacked up/down experts split like SparseMoE's; its
  latent fc1 replicated, fc2 applied to the partial sum with its bias on rank 0) likewise.
- Short conv (LFM2): channels split (in_proj's B | C | x, the depthwise conv and its window);
  out_proj row-parallel + all-reduce.
- Embeddings and lm_head are replicated (every rank computes the full logits; rank 0 samples).
Row-parallel biases stay on rank 0 only (they are added once by the sum).
Returns each cache layer's CacheShard, so pools can gather and scatter KV and state shards.
One parameter's cut is param_cuts.py's; each row-parallel layer sums its own output over ranks
(models/row_parallel.py), given the group's all-reduce here.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from hybridkv.models.attention import PagedAttention
from hybridkv.models.gdn_mixer import GatedDeltaNetMixer
from hybridkv.models.granitemoehybrid import SharedMLP
from hybridkv.models.mamba1_mixer import Mamba1Mixer
from hybridkv.models.mamba2_mixer import Mamba2Mixer
from hybridkv.models.mlp import GatedMLP
from hybridkv.models.moe import SparseMoE
from hybridkv.models.nemotron_h import NemotronHMLP, NemotronHMoE
from hybridkv.models.qwen3_5 import SplitProjectionGDN
from hybridkv.models.short_conv import ShortConv
from hybridkv.models.zamba2_shared import Zamba2SharedAttention, Zamba2SharedMLP
from hybridkv.specs import AttentionSpec

from .param_cuts import column, keep, rebuild_fused, row, sum_over_ranks, zero_unless_rank0
from .shard_layout import CacheShard, ShardLayout, split_count

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "BambaForCausalLM", "Qwen3NextForCausalLM",
                           "Mamba2ForCausalLM", "MambaForCausalLM", "FalconMambaForCausalLM",
                           "JambaForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM",
                           "NemotronHForCausalLM", "GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM",
                           "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Zamba2ForCausalLM")


def check_supported(architecture: str, size: int) -> None:
    if size != 1 and architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size={size} is not supported for {architecture}; tensor "
                         f"parallelism covers {', '.join(SUPPORTED_ARCHITECTURES)} (use "
                         f"tensor_parallel_size=1 for this family)")


def shard_attention(m: PagedAttention, rank: int, size: int, all_reduce: Callable) -> CacheShard:
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    heads = split_count("num_attention_heads", H, size)
    kv = split_count("num_key_value_heads", Hkv, size, replicate=True)
    column(m.q_proj, ShardLayout.of((H, heads, m.q_proj.out_features // H)), rank, size)
    kv_rows = ShardLayout.of((Hkv, kv, D))
    column(m.k_proj, kv_rows, rank, size)
    column(m.v_proj, kv_rows, rank, size)
    row(m.o_proj, ShardLayout.of((H, heads, D)), rank, size)
    m.num_heads, m.num_kv_heads = H // size, Hkv // kv
    rebuild_fused(m)
    sum_over_ranks(m, all_reduce)
    return CacheShard(kv=ShardLayout.of((Hkv, kv)))


def shard_mlp(m: GatedMLP, rank: int, size: int, all_reduce: Callable | None) -> None:
    inter = m.gate_proj.out_features
    split_count("intermediate_size", inter, size)
    cols = ShardLayout.of((inter, size))
    column(m.gate_proj, cols, rank, size)
    column(m.up_proj, cols, rank, size)
    row(m.down_proj, cols, rank, size)
    rebuild_fused(m)
    if all_reduce is not None:
        sum_over_ranks(m, all_reduce)


def shard_moe(m: SparseMoE, rank: int, size: int, all_reduce: Callable) -> None:
    e = m.experts
    inter = e.down_proj.shape[2]
    split_count("moe_intermediate_size", inter, size)
    keep(e, "gate_up_proj", ShardLayout.of((inter, size), (inter, size)), rank, size, 1)
    keep(e, "down_proj", ShardLayout.of((inter, size)), rank, size, 2)
    if m.shared_expert is not None:
        shard_mlp(m.shared_expert, rank, size, None)  # summed with the routed experts below
    sum_over_ranks(m, all_reduce)


def shard_up_down_mlp(m: NemotronHMLP, rank: int, size: int, all_reduce: Callable | None) -> None:
    inter = m.up_proj.out_features
    split_count("intermediate_size", inter, size)
    cols = ShardLayout.of((inter, size))
    column(m.up_proj, cols, rank, size)
    row(m.down_proj, cols, rank, size)
    if all_reduce is not None:
        sum_over_ranks(m, all_reduce)


def shard_shared_mlp(m: SharedMLP, rank: int, size: int, all_reduce: Callable) -> None:
    inter = m.output_linear.in_features
    split_count("shared_intermediate_size", inter, size)
    column(m.input_linear, ShardLayout.of((inter, size), (inter, size)), rank, size)  # a | b
    row(m.output_linear, ShardLayout.of((inter, size)), rank, size)
    sum_over_ranks(m, all_reduce)


def shard_nemotron_moe(m: NemotronHMoE, rank: int, size: int, all_reduce: Callable) -> None:
    e = m.experts
    inter = e.up_proj.shape[1]
    split_count("moe_intermediate_size", inter, size)
    cols = ShardLayout.of((inter, size))
    keep(e, "up_proj", cols, rank, size, 1)
    keep(e, "down_proj", cols, rank, size, 2)
    if m.fc2_latent_proj is not None and m.fc2_latent_proj.bias is not None:
        zero_unless_rank0(m.fc2_latent_proj, "bias", rank)
    shard_up_down_mlp(m.shared_experts, rank, size, None)  # summed with the routed experts below
    sum_over_ranks(m, all_reduce)


def shard_mamba2(m: Mamba2Mixer, rank: int, size: int, all_reduce: Callable) -> CacheShard:
    H, P, G, N = m.num_heads, m.head_dim, m.n_groups, m.d_state
    heads = split_count("mamba num_heads", H, size)
    groups = split_count("mamba n_groups", G, size, replicate=m.norm is None)
    xbc = ShardLayout.of((H, heads, P), (G, groups, N), (G, groups, N))
    zxbcdt = ShardLayout.of((H, heads, P), (H, heads, P), (G, groups, N), (G, groups, N), (H, heads))
    column(m.in_proj, zxbcdt, rank, size)
    keep(m.conv1d, "weight", xbc, rank, size, 0)
    if m.conv1d.bias is not None:
        keep(m.conv1d, "bias", xbc, rank, size, 0)
    per_head = ShardLayout.of((H, heads))
    for name in ("dt_bias", "A_log", "D"):
        keep(m, name, per_head, rank, size, 0)
    if m.norm is not None:
        keep(m.norm, "weight", ShardLayout.of((H, heads, P)), rank, size, 0)
    row(m.out_proj, ShardLayout.of((H, heads, P)), rank, size)
    m.num_heads, m.n_groups = H // size, G // groups
    m.d_inner = m.num_heads * P
    m.conv_dim = m.d_inner + 2 * m.n_groups * N
    m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = m.conv_dim
    m._mup = None
    sum_over_ranks(m, all_reduce)
    return CacheShard(conv=xbc, state=per_head)


def shard_gdn(m: GatedDeltaNetMixer, rank: int, size: int, all_reduce: Callable) -> CacheShard:
    HK, HV, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    k = split_count("linear_num_key_heads", HK, size)
    r = HV // HK
    conv = ShardLayout.of((HK, k, dk), (HK, k, dk), (HV, k, dv))
    if isinstance(m, SplitProjectionGDN):  # Qwen3.5: q | k | v (the conv's order), z, b, a apart
        column(m.in_proj_qkv, conv, rank, size)
        column(m.in_proj_z, ShardLayout.of((HV, k, dv)), rank, size)
        column(m.in_proj_b, ShardLayout.of((HV, k)), rank, size)
        column(m.in_proj_a, ShardLayout.of((HV, k)), rank, size)
    else:  # Qwen3-Next: [q k v z] and [b a] interleaved per key head
        column(m.in_proj_qkvz, ShardLayout.of((HK, k, 2 * dk + 2 * r * dv)), rank, size)
        column(m.in_proj_ba, ShardLayout.of((HK, k, 2 * r)), rank, size)
    keep(m.conv1d, "weight", conv, rank, size, 0)
    v_heads = ShardLayout.of((HV, k))
    for name in ("dt_bias", "A_log"):
        keep(m, name, v_heads, rank, size, 0)
    row(m.out_proj, ShardLayout.of((HV, k, dv)), rank, size)
    m.num_k_heads, m.num_v_heads = HK // size, HV // size
    m.key_dim, m.value_dim = m.num_k_heads * dk, m.num_v_heads * dv
    m.conv_dim = 2 * m.key_dim + m.value_dim
    m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = m.conv_dim
    sum_over_ranks(m, all_reduce)
    return CacheShard(conv=conv, state=v_heads)


def shard_zamba2_attention(m: Zamba2SharedAttention, rank: int, size: int, all_reduce: Callable) -> CacheShard:
    """A shared block's attention: as any attention, plus each site's q/k/v adapter (down
    replicated, up column-parallel by the heads it adds to)."""
    heads = split_count("num_attention_heads", m.num_heads, size)
    kv = split_count("num_key_value_heads", m.num_kv_heads, size, replicate=True)
    q_rows = ShardLayout.of((m.num_heads, heads, m.q_proj.out_features // m.num_heads))
    kv_rows = ShardLayout.of((m.num_kv_heads, kv, m.head_dim))
    if m.use_adapters:
        for adapters, rows in ((m.linear_q_adapter_list, q_rows), (m.linear_k_adapter_list, kv_rows),
                               (m.linear_v_adapter_list, kv_rows)):
            for adapter in adapters:
                if isinstance(adapter, nn.Sequential):
                    column(adapter[1], rows, rank, size)
    return shard_attention(m, rank, size, all_reduce)


def shard_zamba2_mlp(m: Zamba2SharedMLP, rank: int, size: int, all_reduce: Callable) -> None:
    inter = m.down_proj.in_features
    split_count("intermediate_size", inter, size)
    gate_up = ShardLayout.of((inter, size), (inter, size))
    column(m.gate_up_proj, gate_up, rank, size)
    for adapter in m.gate_up_proj_adapter_list:
        if isinstance(adapter, nn.Sequential):
            column(adapter[1], gate_up, rank, size)
    row(m.down_proj, ShardLayout.of((inter, size)), rank, size)
    sum_over_ranks(m, all_reduce)


def shard_mamba1(m: Mamba1Mixer, rank: int, size: int, all_reduce: Callable) -> CacheShard:
    inner = m.d_inner
    split_count("mamba intermediate_size (d_inner)", inner, size)
    channels = ShardLayout.of((inner, size))
    column(m.in_proj, ShardLayout.of((inner, size), (inner, size)), rank, size)  # x | z
    keep(m.conv1d, "weight", channels, rank, size, 0)
    if m.conv1d.bias is not None:
        keep(m.conv1d, "bias", channels, rank, size, 0)
    row(m.x_proj, channels, rank, size)
    column(m.dt_proj, channels, rank, size)
    for name in ("A_log", "D"):
        keep(m, name, channels, rank, size, 0)
    row(m.out_proj, channels, rank, size)
    m.d_inner = inner // size
    m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = m.d_inner
    sum_over_ranks(m, all_reduce)
    return CacheShard(conv=channels, state=channels)


def shard_short_conv(m: ShortConv, rank: int, size: int, all_reduce: Callable) -> CacheShard:
    width = m.hidden_size
    split_count("short-conv hidden_size", width, size)
    channels = ShardLayout.of((width, size))
    column(m.in_proj, ShardLayout.of((width, size), (width, size), (width, size)), rank, size)  # B | C | x
    keep(m.conv, "weight", channels, rank, size, 0)
    if m.conv.bias is not None:
        keep(m.conv, "bias", channels, rank, size, 0)
    row(m.out_proj, channels, rank, size)
    m.hidden_size = width // size  # the conv width (and its window's), not the model's
    m.conv.in_channels = m.conv.out_channels = m.conv.groups = m.hidden_size
    sum_over_ranks(m, all_reduce)
    return CacheShard(conv=channels)


MIXER_SHARDERS = {PagedAttention: shard_attention, Mamba2Mixer: shard_mamba2, GatedDeltaNetMixer: shard_gdn,
                  SplitProjectionGDN: shard_gdn, Mamba1Mixer: shard_mamba1, ShortConv: shard_short_conv,
                  Zamba2SharedAttention: shard_zamba2_attention}


def shard_model(model, rank: int, size: int, all_reduce: Callable) -> dict[int, CacheShard]:
    """Cut `model` (a HybridModel, loaded whole) to rank's shard in place; returns
    {cache layer index: its CacheShard}. ValueError for a family or a shape that cannot be
    split over `size` ranks (naming the value), before anything is cut."""
    check_supported(model.architecture, size)
    full_specs = model.cache_specs()
    order = []  # modules holding cache layers, in layer order
    moe_shared = set()
    plan = []
    for mod in model.modules():
        if isinstance(mod, SparseMoE):
            plan.append((shard_moe, mod))
            if mod.shared_expert is not None:
                moe_shared.add(id(mod.shared_expert))
        elif isinstance(mod, NemotronHMoE):
            plan.append((shard_nemotron_moe, mod))
            moe_shared.add(id(mod.shared_experts))
        elif isinstance(mod, GatedMLP) and id(mod) not in moe_shared:
            plan.append((shard_mlp, mod))
        elif isinstance(mod, NemotronHMLP) and id(mod) not in moe_shared:
            plan.append((shard_up_down_mlp, mod))
        elif isinstance(mod, SharedMLP):
            plan.append((shard_shared_mlp, mod))
        elif isinstance(mod, Zamba2SharedMLP):
            plan.append((shard_zamba2_mlp, mod))
        elif type(mod) in MIXER_SHARDERS:
            plan.append((MIXER_SHARDERS[type(mod)], mod))
            order.append(mod)
    # the k-th attention module holds the k-th attention cache layer (by index), the k-th mixer
    # the k-th recurrent one (Falcon-H1 numbers its Mamba layers after all its attention layers);
    # a shared block's attention (Zamba2) holds the KV cache of each of its use sites
    cache_layers = {id(m): list(keys) for m, keys in _shared_attention_sites(model)}
    for is_attention in (True, False):
        shared = {i for keys in cache_layers.values() for i in keys} if is_attention else set()
        indices = sorted(i for i, spec in full_specs.items()
                         if isinstance(spec, AttentionSpec) == is_attention and i not in shared)
        mods = [m for m in order if isinstance(m, PagedAttention) == is_attention and id(m) not in cache_layers]
        if len(indices) != len(mods):
            raise ValueError(f"{model.architecture}: its cache layers do not map one to one onto its "
                             f"attention and mixer modules; tensor_parallel_size={size} is not supported")
        cache_layers.update({id(m): [i] for m, i in zip(mods, indices)})
    _check_shapes(plan, size)
    layouts = {}
    for fn, mod in plan:
        out = fn(mod, rank, size, all_reduce)
        if out is not None:
            layouts.update({i: out for i in cache_layers[id(mod)]})
    return layouts


def _shared_attention_sites(model) -> list[tuple[nn.Module, list[int]]]:
    """[(a shared block's attention module, the KV cache keys of its use sites)] (Zamba2's hybrid
    layers: `shared_transformer` and `kv_key`); empty for other families."""
    sites: dict[int, tuple[nn.Module, list[int]]] = {}
    for mod in model.modules():
        block, key = getattr(mod, "shared_transformer", None), getattr(mod, "kv_key", None)
        if block is not None and key is not None:
            attn = block.self_attn
            sites.setdefault(id(attn), (attn, []))[1].append(key)
    return list(sites.values())


def _check_shapes(plan, size: int) -> None:
    """Refuse before any weight is cut: every module's heads / groups / widths must split."""
    for fn, m in plan:
        if fn in (shard_attention, shard_zamba2_attention):
            split_count("num_attention_heads", m.num_heads, size)
            split_count("num_key_value_heads", m.num_kv_heads, size, replicate=True)
        elif fn is shard_mamba2:
            split_count("mamba num_heads", m.num_heads, size)
            split_count("mamba n_groups", m.n_groups, size, replicate=m.norm is None)
        elif fn is shard_gdn:
            split_count("linear_num_key_heads", m.num_k_heads, size)
        elif fn is shard_mamba1:
            split_count("mamba intermediate_size (d_inner)", m.d_inner, size)
        elif fn is shard_short_conv:
            split_count("short-conv hidden_size", m.hidden_size, size)
        elif fn is shard_mlp:
            split_count("intermediate_size", m.gate_proj.out_features, size)
        elif fn is shard_up_down_mlp:
            split_count("intermediate_size", m.up_proj.out_features, size)
        elif fn is shard_zamba2_mlp:
            split_count("intermediate_size", m.down_proj.in_features, size)
        elif fn is shard_shared_mlp:
            split_count("shared_intermediate_size", m.output_linear.in_features, size)
        elif fn is shard_nemotron_moe:
            split_count("moe_intermediate_size", m.experts.up_proj.shape[1], size)
            split_count("moe_shared_expert_intermediate_size", m.shared_experts.up_proj.out_features, size)
        elif fn is shard_moe:
            split_count("moe_intermediate_size", m.experts.down_proj.shape[2], size)
            if m.shared_expert is not None:
                split_count("shared_expert_intermediate_size", m.shared_expert.gate_proj.out_features, size)
