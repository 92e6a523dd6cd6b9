"""benchmarks/bench_sampler.py, small: the baseline row loop and the batched sampler agree (same
greedy tokens; sampled rows from the same distribution, draws inside the same top-k / top-p set), and
the script's table runs every case."""
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


def test_every_case_of_the_table_compares_one_distribution():
    """Per case the script times (penalties aside: the old sampler had none), on the script's kind
    of logits: greedy rows give the same tokens; sampled rows draw from the same distribution (the
    same kept tokens, the same probabilities) and every draw of either is a kept token."""
    rows = 4
    base = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(0))
    compared = [name for name in bench_sampler.CASES if "penalties" not in name]
    assert len(compared) == 4
    for name in compared:
        p, scale = bench_sampler.CASES[name]
        logits, sample_rows = base * scale, [SampleRow(p, 0, 0)] * rows
        old = bench_sampler.row_loop_sampler(logits, [p] * rows, torch.Generator().manual_seed(0))
        new = Sampler(seed=0)(logits, sample_rows)[0]
        if p.greedy:
            assert old == new == logits.argmax(-1).tolist(), name
            continue
        old_probs = torch.stack([torch.softmax(bench_sampler._old_filter(logits[r] / p.temperature, p.top_k,
                                                                         p.top_p), -1) for r in range(rows)])
        new_probs = torch.softmax(Sampler().process(logits, sample_rows), -1)
        assert torch.equal(old_probs > 0, new_probs > 0), name
        assert torch.allclose(old_probs, new_probs, atol=1e-6), name
        assert all(new_probs[r, t] > 0 for draws in (old, new) for r, t in enumerate(draws)), name


def test_measure_reports_every_case():
    rows = bench_sampler.measure(rows=2, vocab=2048, repeats=1, context=16)
    assert [r["case"] for r in rows] == list(bench_sampler.CASES)
    assert [("old" in r) for r in rows] == ["penalties" not in r["case"] for r in rows]
