"""scheduler/profiler.py: the time profile runs at num_tokens; the activation peak is taken on the
step's full token budget (peak_tokens) on CUDA, and on CPU nothing larger is run or allocated."""
import torch

import hybridkv.scheduler.profiler as profiler
from hybridkv.models import load_model
from hybridkv.models.tiny import make_tiny_checkpoint


def test_cpu_profile_runs_num_tokens_only(tmp_path, monkeypatch):
    model = load_model(str(make_tiny_checkpoint("bamba", tmp_path)), device="cpu",
                       dtype=torch.float32)
    sized, calls = [], []
    real_caches = profiler._scratch_caches
    monkeypatch.setattr(profiler, "_scratch_caches",
                        lambda specs, n, bs, dev: sized.append(n) or real_caches(specs, n, bs, dev))
    real_forward = model.forward
    monkeypatch.setattr(model, "forward",
                        lambda batch, caches: calls.append(batch.num_tokens)
                        or real_forward(batch, caches))
    prof = profiler.profile_model(model, 16, num_tokens=24, peak_tokens=2048)
    assert sized == [24] and calls == [24, 24]  # warm-up and timed run; no 2048-token step on CPU
    assert prof.peak_activation_bytes == 0 and prof.prefill_seconds_per_token > 0
