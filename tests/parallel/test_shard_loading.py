"""A rank's ShardLoad reads only its rows: every cut tensor stored under its own name comes through
safetensors slices (never a whole read), and each parameter equals the same cut of the whole model."""
import pytest
import torch

from hybridkv.models import load_model
from hybridkv.models.checkpoint import CheckpointTensors
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.parallel.shard_loading import ShardLoad
from hybridkv.parallel.sharding import shard_model


@pytest.mark.parametrize("family", ["bamba", "jamba"])  # jamba: stacked experts come whole, cut on copy
def test_a_rank_reads_its_rows_and_holds_the_same_shard_as_a_whole_load_cut(tmp_path, family, monkeypatch):
    path = str(make_tiny_checkpoint(family, tmp_path / family, seed=3))
    whole_reads = []
    get = CheckpointTensors.get
    monkeypatch.setattr(CheckpointTensors, "get", lambda self, name: whole_reads.append(name) or get(self, name))
    for rank in (0, 1):
        whole_reads.clear()
        shard = ShardLoad(rank, 2, lambda t: t)
        model = load_model(path, shard=shard)
        read_whole = set(whole_reads)  # by the shard load alone
        want = load_model(path)
        layouts = shard_model(want, rank, 2, lambda t: t)
        assert shard.layouts == layouts
        assert shard.full_specs == load_model(path).cache_specs()
        got_params, want_params = dict(model.named_parameters()), dict(want.named_parameters())
        assert got_params.keys() == want_params.keys()
        for name, p in want_params.items():
            assert torch.equal(got_params[name], p), name
        cut_names = {model.checkpoint_name(n) for n, p in want.named_parameters() if hasattr(p, "tp_cut")}
        assert cut_names and not cut_names & read_whole, sorted(cut_names & read_whole)


def test_rank0_loaded_as_another_rank_is_refused(tmp_path):
    from hybridkv.parallel import TensorParallel

    path = str(make_tiny_checkpoint("llama", tmp_path / "llama"))
    shard = ShardLoad(1, 2)
    model = load_model(path, shard=shard)
    with pytest.raises(ValueError, match=r"rank 0 of tensor_parallel_size=2 was loaded as rank 1 of 2"):
        TensorParallel(model, path, 2, dtype=torch.float32, max_model_len=None, block_size=16,
                       profile_tokens=(16, 16), shard=shard)
