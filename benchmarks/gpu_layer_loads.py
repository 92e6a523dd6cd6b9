"""Layer-wise promotion on a GPU (hybridkv/layer_loads.py): first one state slot promoted from pinned
memory (pending on the copy stream until its layer's wait, then read on the compute stream), then the
tiny Bamba engine with a host tier,
two passes over six prefixes (the second hits the host tier), checked against caching off, and the
second pass's wall time with the copy stream vs the old immediate copy (HYBRIDKV_IMMEDIATE_LOADS=1).

    python benchmarks/gpu_layer_loads.py [--cpu-dry-run]     (run by benchmarks/gpu_first.sh)
Writes $OUT/gpu_layer_loads.json; exits 1 when the slot check fails, tokens differ or no promotion happened.
"""
import json
import os
import random
import sys
import tempfile
import time

import torch

from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.plan import kv_bytes_per_block, state_bytes_per_slot
from hybridkv.specs import RecurrentSpec
from hybridkv.state_pool import StatePool


def passes(llm, prefixes, rng_seed=1):
    """Tokens of both passes and the second pass's seconds (the host-tier hits)."""
    rng, outs, seconds = random.Random(rng_seed), [], 0.0
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(2):
        prompts = [p + [rng.randrange(4, 128) for _ in range(8)] for p in prefixes]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        seconds = time.perf_counter() - t0
    return outs, seconds


def pool_check(device: str) -> bool:
    """One state slot promoted from pinned host memory: on CUDA pending on the copy stream until a
    layer's wait, then read on the compute stream; settle finishes the rest (on the CPU: deferred)."""
    spec = RecurrentSpec(conv_shape=(3, 2), state_shape=(2, 2), dtype=torch.float32)
    p = StatePool({0: spec, 1: spec}, 5, device)
    pin = device == "cuda"
    conv = {i: torch.full((3, 2), 2.5).pin_memory() if pin else torch.full((3, 2), 2.5) for i in (0, 1)}
    ssm = {i: torch.full((2, 2), 2.5).pin_memory() if pin else torch.full((2, 2), 2.5) for i in (0, 1)}
    p.from_host(2, conv, ssm)
    ok = p.loads.pending and (p.loads.stream is not None) == (device == "cuda")
    p.loads.wait(0)
    ok = ok and bool((p.conv[0][2] == 2.5).all())  # (read on the compute stream, after its wait)
    p.loads.settle()
    return bool(ok and (p.ssm[1][2] == 2.5).all() and not p.loads.pending)


def main() -> int:
    device = "cpu" if "--cpu-dry-run" in sys.argv or not torch.cuda.is_available() else "cuda"
    if os.environ.get("HYBRIDKV_IMMEDIATE_LOADS") != "1" and not pool_check(device):
        print("pool check failed: a promoted slot was not loaded at its layer's wait", flush=True)
        return 1
    path = make_tiny_checkpoint("bamba", tempfile.mkdtemp())
    specs = LLM(str(path), device=device, memory_budget_bytes=16 << 20).model.cache_specs()
    budget = kv_bytes_per_block(specs, 16) * 64 + state_bytes_per_slot(specs) * 5
    kw = dict(device=device, max_num_seqs=2, checkpoint_share=0.1, memory_budget_bytes=budget)
    rng = random.Random(0)
    prefixes = [[rng.randrange(4, 128) for _ in range(48)] for _ in range(6)]
    want, _ = passes(LLM(str(path), enable_prefix_caching=False, **kw), prefixes)
    result, ok = {"device": device}, True
    for mode, env in (("immediate", "1"), ("layer_wise", ""), ("immediate_again", "1"), ("layer_wise_again", "")):
        os.environ["HYBRIDKV_IMMEDIATE_LOADS"] = env
        llm = LLM(str(path), host_cache_bytes=16 * state_bytes_per_slot(specs), **kw)
        got, seconds = passes(llm, prefixes)
        host = llm.manager.recurrent.host.stats()
        same = got == want and host["promotions"] > 0 and not llm.manager.loads.pending
        ok &= same
        result[mode] = {"tokens_equal_caching_off": got == want, "promotions": host["promotions"],
                        "promotion_seconds": host["promotion_seconds"], "second_pass_s": seconds,
                        "copy_stream": llm.manager.loads.stream is not None}
        print(mode, result[mode], flush=True)
    out = os.environ.get("OUT", tempfile.gettempdir())
    with open(os.path.join(out, "gpu_layer_loads.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
