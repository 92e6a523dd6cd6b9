"""The shape of a steady decode step (issue 23): the Python files of hybridkv it calls into,
outside models/ and kernels/, measured with a profile hook; docs/design.md ("The step") lists them."""
from __future__ import annotations

import os
import sys

import hybridkv
from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import make_tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(hybridkv.__file__)))
STEADY = ["scheduler/engine.py", "scheduler/request_inbox.py", "scheduler/scheduler.py",
          "scheduler/sequence_queue.py", "scheduler/step_plan.py", "hybridkv/decode_rows.py",
          "scheduler/model_runner.py", "scheduler/batch_builder.py",
          "hybridkv/layer_loads.py",  # each layer's pools read through LoadedLayers (its pending loads first)
          "scheduler/sampler.py", "scheduler/step_results.py",
          "scheduler/token_append.py"]


def files_called(step) -> list[str]:
    """The files outside models/ and kernels/ whose Python functions `step()` calls, in order."""
    order: list[str] = []

    def hook(frame, event, arg):
        if event == "call":
            f = os.path.abspath(frame.f_code.co_filename)
            if f.startswith(ROOT):
                r = os.path.relpath(f, ROOT)
                if r.startswith(("hybridkv/", "scheduler/")) and r not in order:  # not models/, kernels/
                    order.append(r)
    sys.setprofile(hook)
    try:
        step()
    finally:
        sys.setprofile(None)
    return order


def test_a_steady_decode_step_calls_twelve_files(tmp_path):
    llm = LLM(str(make_tiny_checkpoint("bamba", tmp_path, seed=1)), memory_budget_bytes=64 << 20)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    for i in range(8):
        llm.add_request([5 + i, 6, 7, 8, 9, 10, 11, 12, 13], params)  # 9 tokens: every row in one phase
    engine = llm.engine
    for _ in range(4):
        engine.step(finished_only=True)  # prefill, then steady decodes
    seen = [files_called(lambda: engine.step(finished_only=True)) for _ in range(16)]
    steady = [s for s in seen if len(s) == len(STEADY)]
    assert steady and all(s == STEADY for s in steady), seen
    # the other steps add the memory below the batch: rows that start a block (the pool and the
    # attention memory) or fill one (hashes, the checkpoint policy, the recurrent kind)
    assert len(steady) >= 12 and all(set(STEADY) <= set(s) for s in seen), seen
