"""examples/compare_baseline.py and what it stands on: specs from published configs, capacity,
and the contiguous pre-allocation baseline against paging."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

from hybridkv.cache_manager import HybridCacheManager  # noqa: E402
from hybridkv.config_specs import load_specs, specs_from_config  # noqa: E402
from hybridkv.contiguous import bytes_per_request, contiguous_manager, max_concurrent_requests  # noqa: E402
from hybridkv.models import load_model  # noqa: E402
from hybridkv.models.tiny import make_tiny_checkpoint  # noqa: E402
from hybridkv.plan import kv_bytes_per_token, state_bytes_per_slot  # noqa: E402
from hybridkv.request import Request
from hybridkv.specs import AttentionSpec, RecurrentSpec  # noqa: E402
from replay import replay  # noqa: E402
from traces import serving_mix  # noqa: E402

CONFIGS = ROOT / "examples" / "configs"
KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}), ("bamba", {}), ("jamba", {}), ("qwen3_next", {}), ("granitemoehybrid", {}),
    ("nemotron_h", {}), ("nemotron_h", {"mamba_ssm_cache_dtype": "bfloat16"}), ("lfm2", {}),
    ("falcon_h1", {}), ("zamba2", {})])
def test_specs_from_config_equal_the_models_own(tmp_path, family, overrides):
    path = make_tiny_checkpoint(family, tmp_path / family, **overrides)
    model = load_model(str(path), device="cpu", dtype=torch.float32)
    cfg = json.loads((path / "config.json").read_text())
    assert specs_from_config(cfg, torch.float32) == model.cache_specs()


def test_published_configs_hand_computed():
    bamba, llama = load_specs(CONFIGS / "bamba-9b.json"), load_specs(CONFIGS / "llama-3-8b.json")
    jamba, qwen = load_specs(CONFIGS / "jamba-v0.1.json"), load_specs(CONFIGS / "qwen3-next-80b-a3b.json")
    assert kv_bytes_per_token(llama) == 128 * KiB and state_bytes_per_slot(llama) == 0
    assert kv_bytes_per_token(bamba) == 12 * KiB and state_bytes_per_slot(bamba) == 62_287_360
    assert kv_bytes_per_token(jamba) == 16 * KiB and state_bytes_per_slot(jamba) == 8_716_288
    # Qwen3-Next: 12 attention layers x 2 KV heads x 256; 36 GDN layers, conv (2x16x128 + 32x128) x 3,
    # state 32 x 128 x 128, all bf16
    assert kv_bytes_per_token(qwen) == 12 * 2 * 2 * 256 * 2
    assert state_bytes_per_slot(qwen) == 36 * (8192 * 3 + 32 * 128 * 128) * 2
    assert sorted(i for i, s in qwen.items() if isinstance(s, AttentionSpec)) == list(range(3, 48, 4))
    for hybrid in (bamba, jamba, qwen):
        assert bytes_per_request(hybrid, 4096) < bytes_per_request(llama, 4096)
    assert bytes_per_request(llama, 4096) == 512 * MiB
    assert bytes_per_request(bamba, 4096) == 4096 * 12 * KiB + 62_287_360


def test_max_concurrent_is_what_a_manager_admits():
    specs = {0: AttentionSpec(2, 8, torch.float32), 1: RecurrentSpec((6, 3), (2, 4, 4), torch.float32)}
    budget, ctx = 200 * KiB, 100
    slot = state_bytes_per_slot(specs)
    assert slot == 6 * 3 * 4 + 2 * 4 * 4 * 4 and kv_bytes_per_token(specs) == 2 * 2 * 8 * 4
    n = max_concurrent_requests(specs, budget, ctx)
    assert n == (budget - slot) // (slot + 7 * 16 * 128)  # 100 tokens take 7 blocks of 16
    for seqs, fits in ((n, n), (n + 1, n)):
        mgr = HybridCacheManager.from_budget(specs, budget, 16, seqs, 0.0)
        admitted = 0
        for r in range(seqs):
            if mgr.admit(Request(r, [r + 1] * ctx)) is None or mgr.allocate(r, ctx) is None:
                break
            admitted += 1
        assert admitted == fits


def test_contiguous_reserves_max_len_and_paging_uses_more_of_it():
    specs = {0: AttentionSpec(2, 8, torch.float32), 1: RecurrentSpec((6, 3), (2, 4, 4), torch.float32)}
    max_len, budget = 256, 256 * KiB  # contiguous: 7 reservations; paged: 121 blocks of 16
    trace = serving_mix(num_requests=30, prompt_len=(16, 160), output_len=(8, 64))
    cont = contiguous_manager(specs, budget, max_len, max_num_seqs=64)
    paged = HybridCacheManager.from_budget(specs, budget, 16, 64, 0.0, enable_prefix_caching=False)
    assert cont.block_size == max_len
    assert cont.num_blocks == max_concurrent_requests(specs, budget, max_len, block_size=max_len) == 7
    rc = replay(cont, trace, max_num_seqs=64)
    rp = replay(paged, trace, max_num_seqs=64)
    # requests hold 16..223 tokens of a 256 reservation; paging wastes < 16 per request
    assert rp.mean_utilization > rc.mean_utilization + 0.3
    assert rp.mean_running > rc.mean_running
    assert max(rc.running) <= cont.num_blocks  # one max_len reservation per running request


@pytest.mark.slow  # long
def test_compare_baseline_small_end_to_end(tmp_path):
    import compare_baseline
    import matplotlib.image

    report = compare_baseline.main(["--small", "--out", str(tmp_path)])
    per_req = report["real"]["bytes_per_request"]
    assert per_req["hybrid (Bamba)"][4096] < per_req["attention (Llama)"][4096]
    plan = report["planner"]
    assert plan["bamba-9b"]["bytes_per_request"][4096] < plan["llama-3-8b"]["bytes_per_request"][4096]
    runs = report["real"]["runs"]
    for model in ("hybrid (Bamba)", "attention (Llama)"):
        paged, cont = runs[f"{model}, paged"], runs[f"{model}, contiguous"]
        assert paged["mean_utilization"] > cont["mean_utilization"]
        assert cont["block_size"] == report["real"]["max_model_len"]
        assert paged["peak_in_use_bytes"] <= paged["pool_bytes"]
    for png in ("memory_per_request", "concurrency", "throughput", "utilization"):
        img = matplotlib.image.imread(tmp_path / f"{png}.png")
        assert img.shape[0] > 300 and img.shape[1] > 500
    assert "| hybrid (Bamba), paged |" in (tmp_path / "results.md").read_text()
