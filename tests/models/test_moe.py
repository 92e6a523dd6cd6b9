"""Our MoE blocks against transformers' with the same weights, for every MoE family here: routing
(softmax / sigmoid, renormalised or not, group-limited with a score bias) and block outputs
(stacked experts through hybridkv.kernels.fused_moe, shared experts)."""
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from transformers import (GraniteMoeHybridConfig, JambaConfig, NemotronHConfig, Qwen3NextConfig)
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMoE
from transformers.models.jamba.modeling_jamba import JambaSparseMoeBlock
from transformers.models.nemotron_h import modeling_nemotron_h as hf_nemotron
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from hybridkv.models.moe import SparseMoE, route
from hybridkv.models.nemotron_h import NemotronHMoE

H, E, K = 16, 6, 2


@dataclass(frozen=True)
class MoEFamily:
    """A transformers MoE block, the config that builds it, and our SparseMoE as the family builds it."""
    config: Callable
    hf_block: type
    router: str  # attribute of transformers' router in its block
    intermediate: int
    norm_topk_prob: bool
    shared: int = 0


FAMILIES = {
    "jamba": MoEFamily(lambda: JambaConfig(hidden_size=H, intermediate_size=24, num_experts=E,
                                           num_experts_per_tok=K),
                       JambaSparseMoeBlock, "router", 24, norm_topk_prob=False),
    "qwen3_next": MoEFamily(lambda: Qwen3NextConfig(
        hidden_size=H, moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=E,
        num_experts_per_tok=K, norm_topk_prob=True), Qwen3NextSparseMoeBlock, "gate", 12, True, 20),
    "qwen3_next_unnormalised": MoEFamily(lambda: Qwen3NextConfig(
        hidden_size=H, moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=E,
        num_experts_per_tok=K, norm_topk_prob=False), Qwen3NextSparseMoeBlock, "gate", 12, False, 20),
    # transformers: softmax over the top-k logits, which is top-k of the softmax renormalised
    "granitemoehybrid": MoEFamily(lambda: GraniteMoeHybridConfig(
        hidden_size=H, intermediate_size=20, num_local_experts=E, num_experts_per_tok=3,
        mamba_n_heads=4, mamba_d_head=8),
        GraniteMoeHybridMoE, "router", 20, True),
    "qwen3_5_moe": MoEFamily(lambda: Qwen3_5MoeTextConfig(
        hidden_size=H, moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=8,
        num_experts_per_tok=4), Qwen3_5MoeSparseMoeBlock, "gate", 12, True, 20),
}


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _pair(name: str, seed: int = 0):
    fam = FAMILIES[name]
    cfg = fam.config()
    hf = fam.hf_block(cfg).eval()
    _randomize(hf, seed)
    experts = hf.experts.gate_up_proj.shape[0]
    top_k = cfg.num_experts_per_tok
    ours = SparseMoE(H, fam.intermediate, experts, top_k, fam.norm_topk_prob,
                     shared_intermediate_size=fam.shared).eval()
    ours.router.weight.data.copy_(getattr(hf, fam.router).weight)
    ours.experts.gate_up_proj.data.copy_(hf.experts.gate_up_proj)
    ours.experts.down_proj.data.copy_(hf.experts.down_proj)
    if fam.shared:
        ours.shared_expert.load_state_dict(hf.shared_expert.state_dict())
        ours.shared_expert_gate.weight.data.copy_(hf.shared_expert_gate.weight)
    return hf, ours, fam


@torch.no_grad()
@pytest.mark.parametrize("name", list(FAMILIES))
def test_routing_matches_transformers(name):
    hf, ours, fam = _pair(name)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(1))
    _, hf_w, hf_ids = getattr(hf, fam.router)(x)
    w, ids = route(ours.router(x), ours.top_k, ours.norm_topk_prob)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w.float(), rtol=1e-6, atol=1e-6)
    if fam.norm_topk_prob:
        torch.testing.assert_close(w.sum(-1), torch.ones(40))
    else:
        assert (w.sum(-1) < 1 - 1e-3).any(), "the raw softmax mass of the top-k is kept"


@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 7, 45])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_moe_block_matches_transformers(name, tokens):
    hf, ours, _ = _pair(name, seed=2)
    x = torch.randn(1, tokens, H, generator=torch.Generator().manual_seed(tokens))
    torch.testing.assert_close(ours(x.view(-1, H)), hf(x).view(-1, H), rtol=1e-5, atol=2e-5)


@pytest.mark.slow  # interpreted Triton
@torch.no_grad()
@pytest.mark.parametrize("name", ["qwen3_next", "granitemoehybrid"])
def test_moe_block_on_the_triton_path_matches_transformers(name, monkeypatch):
    """The block as the GPU runs it: the Triton fused MoE (interpreted on CPU)."""
    monkeypatch.setenv("HYBRIDKV_BACKEND", "triton")
    hf, ours, _ = _pair(name, seed=6)
    x = torch.randn(1, 13, H, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(ours(x.view(-1, H)), hf(x).view(-1, H), rtol=1e-5, atol=2e-5)


def _nemotron_config():
    return NemotronHConfig(hidden_size=H, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                           topk_group=2, moe_intermediate_size=12,
                           moe_shared_expert_intermediate_size=20, norm_topk_prob=True,
                           routed_scaling_factor=2.5, mlp_hidden_act="relu2",
                           layers_block_type=["moe"], num_hidden_layers=1)


@torch.no_grad()
def test_nemotron_h_group_routing_and_block_match_transformers():
    """Sigmoid scores, choice by score + bias inside the best groups, routed scaling, relu2 experts."""
    cfg = _nemotron_config()
    hf = hf_nemotron.NemotronHMoE(cfg, layer_idx=0).eval()
    _randomize(hf, 3)
    hf.gate.e_score_correction_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(4)))
    ours = NemotronHMoE(cfg).eval()
    ours.gate.weight.data.copy_(hf.gate.weight)
    ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
    ours.experts.up_proj.data.copy_(hf.experts.up_proj)
    ours.experts.down_proj.data.copy_(hf.experts.down_proj)
    ours.shared_experts.load_state_dict(hf.shared_experts.state_dict())
    x = torch.randn(30, H, generator=torch.Generator().manual_seed(5))
    _, hf_w, hf_ids = hf.gate(x)
    w, ids = ours.gate(x)
    assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values)
    torch.testing.assert_close(w.gather(1, ids.argsort(-1)), hf_w.gather(1, hf_ids.argsort(-1)))
    torch.testing.assert_close(ours(x), hf(x[None]).view(-1, H), rtol=1e-5, atol=2e-5)


def test_bad_top_k_is_rejected():
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        SparseMoE(H, 8, 4, 5, norm_topk_prob=False)


@pytest.mark.parametrize("family", ["jamba", "qwen3_next"])
def test_fused_expert_checkpoint_loads_like_per_expert(tmp_path, family):
    """The published per-expert tensors and transformers' stacked ones load the same weights."""
    from safetensors.torch import load_file, save_file

    from hybridkv.models import load_model
    from hybridkv.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(family, tmp_path / "per_expert", seed=4)
    tensors = load_file(path / "model.safetensors")
    fused, groups = {}, {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            fused[name] = t
    assert groups, "the tiny checkpoint has MoE layers"
    for prefix, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(n)])
        fused[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
    other = tmp_path / "fused"
    other.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (other / f.name).write_bytes(f.read_bytes())
    save_file(fused, str(other / "model.safetensors"))

    a, b = load_model(path).state_dict(), load_model(other).state_dict()
    assert a.keys() == b.keys()
    assert any(k.endswith("experts.gate_up_proj") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    e0 = next(p for p in groups)
    stacked = a[f"{e0}.gate_up_proj"]
    assert torch.equal(stacked[1], torch.cat([groups[e0][(1, "gate_proj")], groups[e0][(1, "up_proj")]]))
