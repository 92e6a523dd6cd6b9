"""benchmarks/bench_sampler.py, small: the baseline row loop and the batched sampler agree (same
greedy tokens; draws inside the same top-k / top-p set), and the script's table runs."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_sampler  # noqa: E402
from hybridkv.sampling_params import SamplingParams  # noqa: E402
from hybridkv.scheduler.sampler import SampleRow, Sampler  # noqa: E402


def test_baseline_and_batched_sampler_agree():
    logits = torch.randn(8, 3000, generator=torch.Generator().manual_seed(0)) * 3
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0)
    assert bench_sampler.row_loop_sampler(logits, [greedy] * 8, gen) == \
        Sampler()(logits, [SampleRow(greedy, 0, 0)] * 8)[0] == logits.argmax(-1).tolist()
    p = SamplingParams(temperature=0.7, top_k=50, top_p=0.8)
    kept = torch.isfinite(Sampler().process(logits, [SampleRow(p, 0, 0)] * 8))
    for _ in range(5):
        old = bench_sampler.row_loop_sampler(logits, [p] * 8, gen)
        new = Sampler(seed=_)(logits, [SampleRow(p, 0, 0)] * 8)[0]
        assert all(kept[r, t] for r, t in enumerate(old)) and all(kept[r, t] for r, t in enumerate(new))


def test_measure_reports_every_case():
    rows = bench_sampler.measure(rows=2, vocab=2048, repeats=1, context=16)
    assert [r["case"] for r in rows] == list(bench_sampler.CASES)
    assert all(r["new"][0] >= 0 for r in rows) and all("old" in r for r in rows if "penalties" not in r["case"])
