"""Every family of tests/family_checks.FAMILIES through the CUDA-graph decode path's CPU dry run.

    TRITON_INTERPRET=1 python benchmarks/decode_graphs_all_families.py            # all families
    TRITON_INTERPRET=1 python benchmarks/decode_graphs_all_families.py kimi_linear gpt_oss

Too slow for the test suite (the Triton kernels run interpreted: ~80 s of CPU over the 25 tiny
families on the 2-core VM), so tests/engine/test_decode_graphs.py covers a few families and this
script the rest, run by hand after a change to a model's decode step. Per family: the tiny
checkpoint of its table row, LLM(cuda_graphs="dry_run") against LLM() on the CPU, two prompts (17
and 3 tokens), 3 greedy tokens each with logprobs. A family passes when the graph path replays
decode steps under NoHostSync and its tokens equal the eager ones; a decode step that syncs on the
host is reported as refused, with the op NoHostSync names (the engine ends the batch's requests
with that error). Prints one line per family (replays,
max |logprob difference|, CPU seconds of the graph half) and exits 1 if any family failed or was
refused.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

from family_checks import FAMILIES  # noqa: E402
from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.scheduler.host_sync_check import HostSyncError  # noqa: E402

PROMPTS = [list(range(5, 22)), [30, 31, 32]]
ENGINE = dict(device="cpu", max_num_seqs=2, max_num_batched_tokens=64, memory_budget_bytes=8 << 20)


def first_logprobs(output):
    return [next(iter(step.values())).logprob for step in output.outputs[0].logprobs]


def check_family(name: str) -> tuple[bool, str]:
    """(passed, one line of figures) for one family."""
    f = FAMILIES[name]
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)] * len(PROMPTS)
    path = str(f.make(name, tempfile.mkdtemp(prefix=f"graphs-{name}-"), seed=f.seed, **f.overrides))
    want = LLM(path, **ENGINE).generate(PROMPTS, params, use_tqdm=False)
    start = time.process_time()
    llm = LLM(path, cuda_graphs="dry_run", **ENGINE)
    try:
        got = llm.generate(PROMPTS, params, use_tqdm=False)
    except HostSyncError as e:
        return False, f"refused: {e}"
    cpu = time.process_time() - start
    errors = [o.outputs[0].error for o in got if o.outputs[0].error]
    if errors:  # the engine ends a failed batch's requests with the error instead of raising
        return False, f"{'refused' if 'HostSyncError' in errors[0] else 'FAILED'}: {errors[0]}"
    same = all(g.outputs[0].token_ids == w.outputs[0].token_ids for g, w in zip(got, want))
    diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(first_logprobs(g), first_logprobs(w)))
    replays = llm.engine.runner.decode_graphs.replays
    ok = same and replays > 0 and diff < 1e-4
    return ok, (f"{'ok' if ok else 'FAILED'} replays={replays} same_tokens={same} "
                f"max_logprob_diff={diff:.1e} graph_cpu_s={cpu:.1f}")


def main(names) -> int:
    torch.set_num_threads(1)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        print(f"unknown families {unknown}; choose from {list(FAMILIES)}", file=sys.stderr)
        return 2
    failed = []
    for name in names or list(FAMILIES):
        ok, line = check_family(name)
        print(f"{name:18s} {line}", flush=True)
        if not ok:
            failed.append(name)
    print(f"{len(names or FAMILIES) - len(failed)} passed, {len(failed)} failed or refused: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
