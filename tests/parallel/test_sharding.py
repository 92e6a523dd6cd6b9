"""Each family's shards, run as 2 ranks in 2 threads of this process (an all-reduce over a barrier),
give the full model's logits through chunked prefill and decode: the cut of every weight, state and
all-reduce is checked here in seconds; tests/engine/test_tensor_parallel.py checks the processes."""
import importlib
import inspect
import pkgutil
import random
import threading

import pytest
import torch

import hybridkv.models as model_package
from hybridkv.models import load_model
from hybridkv.models.row_parallel import RowParallel
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.parallel.param_cuts import sum_over_ranks
from hybridkv.parallel.shard_loading import ShardLoad

from family_checks import mamba2_scans_that_matter
from model_harness import Harness

RNG = random.Random(3)
PROMPTS = [[RNG.randrange(4, 128) for _ in range(n)] for n in (5, 19, 30)]
FAMILIES = ["llama", "bamba", "qwen3_next", "mamba2", "mamba", "falcon_mamba", "jamba", "lfm2", "lfm2_moe",
            "nemotron_h", "granitemoehybrid", "falcon_h1", "qwen3_5", "qwen3_5_moe", "zamba2"]
# attention + Mamba2, GDN, Mamba1 and an MoE (Lfm2SparseMoE overrides forward) in the fast tier
SHARDING_FAST = {"bamba", "qwen3_next", "mamba", "lfm2_moe"}
MAMBA2_FAMILIES = ("bamba", "mamba2", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba2")
# Nemotron-H's MoE in a latent width, with biases (fc2's bias must be added once)
OVERRIDES = {"nemotron_h_latent": ("nemotron_h", {"moe_latent_size": 32, "mlp_bias": True})}


class ThreadAllReduce:
    """`size` ranks in threads: rank r's all_reduce(t) returns the sum of every rank's t (rank order)."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=60)
        self.parts = [None] * size

    def for_rank(self, rank: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()  # every rank has read every part before any is replaced
            return total
        return all_reduce


def _run(model) -> list:
    """Logits of every step: prompts prefilled together in chunks of 8, then 6 greedy decodes."""
    h = Harness(model, block_size=8, num_blocks=32, num_slots=8, seed=1)
    seqs = [h.add(p) for p in PROMPTS]
    out = []
    while any(s.num_computed < len(s.tokens) for s in seqs):
        out.append(h.step([(s, min(8, len(s.tokens) - s.num_computed)) for s in seqs
                           if s.num_computed < len(s.tokens)]))
    for _ in range(6):
        for s in seqs:
            s.tokens.append(int(s.last_logits.argmax()))
        out.append(h.step([(s, 1) for s in seqs]))
    return out


def _sharded(path, size: int) -> list:
    reduce = ThreadAllReduce(size)
    # each rank reads only its shard (safetensors slices), as a worker does
    models = [load_model(path, shard=ShardLoad(r, size, reduce.for_rank(r))) for r in range(size)]
    for m in models:  # the sums are the layers' own (RowParallel.rank_sum), not hooks on them
        hooked = [n for n, mod in m.named_modules() if mod._forward_hooks or mod._forward_pre_hooks]
        assert not hooked, hooked
        summed = [n for n, mod in m.named_modules() if isinstance(mod, RowParallel) and "rank_sum" in vars(mod)]
        assert summed, "no layer sums its output over ranks"
    results, errors = [None] * size, []

    def rank(r):
        try:
            torch.set_num_threads(1)
            results[r] = _run(models[r])
        except BaseException as e:  # reported below; the barrier's timeout frees the other rank
            errors.append(e)
            reduce.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("case", [c if c in SHARDING_FAST else pytest.param(c, marks=pytest.mark.slow)
                                  for c in FAMILIES + list(OVERRIDES)])
def test_two_shards_give_the_full_models_logits(tmp_path, case):
    family, overrides = OVERRIDES.get(case, (case, {}))
    path = make_tiny_checkpoint(family, tmp_path / family, **overrides)
    if family in MAMBA2_FAMILIES:  # a head's A, dt or state on the wrong rank changes the logits
        mamba2_scans_that_matter(path, seed=0)
    path = str(path)
    want = _run(load_model(path))
    for r, got in enumerate(_sharded(path, 2)):
        assert len(got) == len(want)
        for step, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"{family} rank {r} step {step}")


def test_a_layer_that_cannot_sum_its_output_is_refused():
    """A row-parallel cut of a layer without `rank_sum` would silently return a partial sum."""
    with pytest.raises(TypeError, match="Linear does not sum its output over ranks"):
        sum_over_ranks(torch.nn.Linear(4, 4), lambda t: t)


def test_every_layer_that_overrides_forward_still_sums_over_ranks():
    """A subclass of a RowParallel layer with a forward of its own must end in rank_sum too, or a
    sharded model would return partial sums from it (as Lfm2SparseMoE once did)."""
    missing = []
    for info in pkgutil.iter_modules(model_package.__path__):
        for cls in vars(importlib.import_module(f"hybridkv.models.{info.name}")).values():
            for name in ("forward", "forward_codes"):  # every way the layer runs
                if inspect.isclass(cls) and issubclass(cls, RowParallel) and name in vars(cls):
                    if "self.rank_sum(" not in inspect.getsource(vars(cls)[name]):
                        missing.append(f"{cls.__module__}.{cls.__name__}.{name}")
    assert not missing, missing
