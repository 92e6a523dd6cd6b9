"""GPT-OSS against transformers' model of the same tiny checkpoint: the MoE (router with bias,
clamped SwiGLU experts with biases) layer by layer, the planner's specs, and a long generation whose
sliding-window layers hold at most ceil(window / block_size) + 1 blocks while full layers grow.
The shared checks (logits, ragged batches, chunks, engine) run from tests/family_checks.py."""
import json

import pytest
import torch

from hybridkv import LLM
from hybridkv.config_specs import load_specs
from hybridkv.kernels.fused_moe_cpu import fused_moe_torch
from hybridkv.kernels.fused_moe_ref import fused_moe_ref
from hybridkv.models.checkpoint import CheckpointError
from hybridkv.models.tiny import make_tiny_checkpoint

from engine_fixtures import assert_no_leaks, greedy, hf_model
from model_harness import assert_greedy_matches_hf

WINDOW, BS = 24, 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), seed=14)
    return str(path), hf_model(path)


def test_moe_layer_equals_transformers(ckpt):
    path, hf = ckpt
    ours = LLM(path, memory_budget_bytes=1 << 20).model
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, hf.config.hidden_size, generator=g) * 3
    for i in (0, 3):
        with torch.no_grad():
            want, _ = hf.model.layers[i].mlp(x[None])
            got = ours.model.layers[i].mlp(x)
        assert (got - want[0]).abs().max() <= 1e-5 * want.abs().max()
    gate_up = hf.model.layers[0].mlp.experts.gate_up_proj  # [E, H, 2I], gate and up interleaved
    assert torch.equal(ours.model.layers[0].mlp.experts.gate_up_proj[:, 0], gate_up[:, :, 0])
    assert torch.equal(ours.model.layers[0].mlp.experts.gate_up_proj[:, hf.config.intermediate_size],
                       gate_up[:, :, 1])


def test_fused_moe_torch_path_with_biases_and_clamped_swiglu_matches_reference():
    g = torch.Generator().manual_seed(1)
    T, E, k, H, I = 29, 5, 2, 24, 12
    hidden = torch.randn(T, H, generator=g)
    w_gu, w_d = torch.randn(E, 2 * I, H, generator=g) * 0.5, torch.randn(E, H, I, generator=g) * 0.3
    b_gu, b_d = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    args = (hidden, w_gu, w_d, weights, ids)
    opts = dict(gate_up_bias=b_gu, down_bias=b_d, swiglu=(1.702, 1.5))
    want = fused_moe_ref(*args, **opts)
    got = fused_moe_torch(*args, **opts)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    loose = fused_moe_ref(*args, gate_up_bias=b_gu, down_bias=b_d, swiglu=(1.702, 100.0))
    assert (loose - want).abs().max() > 1e-2 * want.abs().max()  # the clamp at 1.5 bites here
    with pytest.raises(ValueError, match=r"down_bias has shape \(5, 23\); expected \(5, 24\)"):
        fused_moe_torch(*args, gate_up_bias=b_gu, down_bias=b_d[:, :-1], swiglu=(1.702, 1.5))


def test_planner_specs_equal_the_model_and_alternate_windows(ckpt):
    path, _ = ckpt
    specs = LLM(path, memory_budget_bytes=1 << 20).model.cache_specs()
    assert load_specs(f"{path}/config.json", torch.float32) == specs
    assert [s.sliding_window for s in specs.values()] == [WINDOW, None, WINDOW, None]


def test_long_generation_holds_the_window_in_sliding_groups_while_full_groups_grow(ckpt):
    path, hf = ckpt
    llm = LLM(path, memory_budget_bytes=4 << 20, max_num_batched_tokens=20)
    mgr = llm.manager
    assert list(mgr.attention_groups) == [None, WINDOW]
    sliding, full = mgr.attention_groups[WINDOW], mgr.attention_groups[None]
    ps = [list(range(4, 4 + 70)), [7, 9, 11] * 10, [5]]
    ids = [llm.add_request(p, greedy(70)) for p in ps]
    done, peak, full_peak = {}, 0, 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        for rid, r in mgr.requests.items():
            n = r.num_computed_tokens
            if n > r.num_prompt_tokens:  # decoding: only the window is held in the sliding group
                assert len(sliding.held_blocks(rid)) <= -(-WINDOW // BS) + 1, (rid, n)
                assert len(full.held_blocks(rid)) >= -(-n // BS)  # every block so far
                full_peak = max(full_peak, len(full.held_blocks(rid)))
                peak = max(peak, len(sliding.held_blocks(rid)))
    assert peak == -(-WINDOW // BS) + 1 and full_peak >= -(-(70 + 69) // BS)  # 70 + 69 tokens: 9 blocks
    for p, rid in zip(ps, ids):
        assert_greedy_matches_hf(hf, p, done[rid])
    assert_no_leaks(llm)


def test_quantized_experts_are_refused_by_name(tmp_path):
    path = make_tiny_checkpoint("gpt_oss", tmp_path, seed=1)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quant_method='mxfp4': quantized experts are not supported"):
        LLM(str(path), memory_budget_bytes=1 << 20)
