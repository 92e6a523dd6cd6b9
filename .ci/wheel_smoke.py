"""Smoke of an installed wheel: a tiny Bamba served with tensor_parallel_size=2 (two CPU processes
over gloo) gives the same greedy tokens as tensor_parallel_size=1. Run from outside the source
tree, so only the installed package can be imported (the script checks that it is not the tree's).

    cd /tmp && python /path/to/.ci/wheel_smoke.py
"""
import sys
import tempfile
from pathlib import Path

import hybridkv
from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import make_tiny_checkpoint

SOURCE = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40))]
MAX_TOKENS = 12


def generate(path: Path, tp: int) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", dtype="float32", memory_budget_bytes=64 << 20,
              tensor_parallel_size=tp)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    for o in outs:  # a failed forward ends a request early with finish_reason "error"
        done = o.outputs[0]
        assert done.finish_reason == "length" and len(done.token_ids) == MAX_TOKENS, \
            f"tp={tp}: a request ended {done.finish_reason!r} after {len(done.token_ids)} tokens: {done.error}"
    return [o.outputs[0].token_ids for o in outs]


def main() -> None:
    installed = Path(hybridkv.__file__).resolve()
    if SOURCE in installed.parents:
        sys.exit(f"hybridkv imports from the source tree ({installed}), not from the installed wheel")
    print(f"hybridkv from {installed.parent}")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint("bamba", Path(tmp) / "tiny-bamba")
        one, two = generate(path, 1), generate(path, 2)
    print("tp=1:", one)
    print("tp=2:", two)
    assert one == two, f"tensor_parallel_size=2 tokens differ from tensor_parallel_size=1: {two} != {one}"
    print("wheel smoke passed: TP=2 greedy tokens equal TP=1")


if __name__ == "__main__":
    main()
