"""Our SparseMoE against transformers' Jamba and Qwen3-Next MoE blocks with the same weights."""
import pytest
import torch
from transformers import JambaConfig, Qwen3NextConfig
from transformers.models.jamba.modeling_jamba import JambaSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from hybridkv.models.moe import SparseMoE, route

H, E, K = 16, 6, 2


def _fill_from_fused(ours: SparseMoE, experts) -> None:
    """Copy transformers' fused expert tensors ([E, 2I, H] gate|up, [E, H, I]) into per-expert MLPs."""
    for e, mlp in enumerate(ours.experts):
        gate, up = experts.gate_up_proj[e].chunk(2, dim=0)
        mlp.gate_proj.weight.data.copy_(gate)
        mlp.up_proj.weight.data.copy_(up)
        mlp.down_proj.weight.data.copy_(experts.down_proj[e])


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _jamba_pair(seed=0):
    cfg = JambaConfig(hidden_size=H, intermediate_size=24, num_experts=E, num_experts_per_tok=K)
    hf = JambaSparseMoeBlock(cfg).eval()
    _randomize(hf, seed)
    ours = SparseMoE(H, 24, E, K, norm_topk_prob=False).eval()
    ours.router.weight.data.copy_(hf.router.weight)
    _fill_from_fused(ours, hf.experts)
    return hf, ours


def _qwen_pair(seed=0, norm_topk_prob=True):
    cfg = Qwen3NextConfig(hidden_size=H, moe_intermediate_size=12, shared_expert_intermediate_size=20,
                          num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk_prob)
    hf = Qwen3NextSparseMoeBlock(cfg).eval()
    _randomize(hf, seed)
    ours = SparseMoE(H, 12, E, K, norm_topk_prob=norm_topk_prob, shared_intermediate_size=20).eval()
    ours.router.weight.data.copy_(hf.gate.weight)
    _fill_from_fused(ours, hf.experts)
    ours.shared_expert.load_state_dict(hf.shared_expert.state_dict())
    ours.shared_expert_gate.weight.data.copy_(hf.shared_expert_gate.weight)
    return hf, ours


@torch.no_grad()
def test_jamba_routing_is_topk_of_softmax_without_renormalisation():
    hf, ours = _jamba_pair()
    x = torch.randn(40, H)
    _, hf_w, hf_ids = hf.router(x)
    w, ids = route(ours.router(x), K, norm_topk_prob=False)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, rtol=1e-6, atol=1e-7)
    assert (w.sum(-1) < 1 - 1e-3).any(), "Jamba keeps the raw softmax mass of the top-k"


@torch.no_grad()
@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_next_routing_renormalises_when_asked(norm):
    hf, ours = _qwen_pair(norm_topk_prob=norm)
    x = torch.randn(40, H)
    _, hf_w, hf_ids = hf.gate(x)
    w, ids = route(ours.router(x), K, norm_topk_prob=norm)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, rtol=1e-6, atol=1e-7)
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.ones(40))


@torch.no_grad()
def test_jamba_moe_output_matches_transformers():
    hf, ours = _jamba_pair(seed=1)
    x = torch.randn(2, 17, H)
    torch.testing.assert_close(ours(x.view(-1, H)), hf(x).view(-1, H), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_qwen3_next_moe_with_shared_expert_matches_transformers():
    hf, ours = _qwen_pair(seed=2)
    x = torch.randn(3, 11, H)
    torch.testing.assert_close(ours(x.view(-1, H)), hf(x).view(-1, H), rtol=1e-5, atol=1e-6)


def test_bad_top_k_is_rejected():
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        SparseMoE(H, 8, 4, 5, norm_topk_prob=False)


@pytest.mark.parametrize("family", ["jamba", "qwen3_next"])
def test_fused_expert_checkpoint_loads_like_per_expert(tmp_path, family):
    """transformers' in-memory layout (experts.gate_up_proj / experts.down_proj) loads the same."""
    import re

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
    for k in a:
        assert torch.equal(a[k], b[k]), k
