"""Layer-wise promotion on a GPU (hybridkv/layer_loads.py): the tiny Bamba engine with a host tier,
two passes over six prefixes (the second hits the host tier), checked against caching off, and the
second pass's wall time with the copy stream vs the old immediate copy (HYBRIDKV_IMMEDIATE_LOADS=1).

    python benchmarks/gpu_layer_loads.py [--cpu-dry-run]     (run by benchmarks/gpu_first.sh)
Writes $OUT/gpu_layer_loads.json; exits 1 when tokens differ or no promotion happened.
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


def main() -> int:
    device = "cpu" if "--cpu-dry-run" in sys.argv or not torch.cuda.is_available() else "cuda"
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
