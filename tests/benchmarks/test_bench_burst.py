"""benchmarks/bench_burst.py, small: a burst on a hybrid model computes its shared prefix once,
as on a pure-attention model, with outputs identical to transformers and to caching off."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_burst  # noqa: E402


@pytest.fixture(scope="module")
def measured():
    """The rows of Llama and both hybrids, measured once (each family's row is its own: checkpoint,
    burst, transformers check), so the Llama row the two cases compare with is measured once."""
    return {r["family"]: r for r in bench_burst.measure(["llama", "bamba", "qwen3_next"], n=6, prefix_len=64,
                                                        new=2, repeats=1)}


@pytest.mark.slow  # a benchmark: three families measured with transformers checks
@pytest.mark.parametrize("hybrid", ["bamba", "qwen3_next"])
def test_burst_prefill_matches_pure_attention(hybrid, measured):
    rows = {f: measured[f] for f in ("llama", hybrid)}
    llama, hyb = rows["llama"], rows[hybrid]
    assert hyb["prefill"] <= 1.1 * llama["prefill"], rows
    assert hyb["hits"] == 5 * 64 and hyb["waits"] > 0  # every follower hit the whole shared prefix
    assert hyb["prefill"] < hyb["off"]  # caching on computes less than caching off
    assert hyb["checked"] == 6  # (measure asserts each output against transformers and caching off)
