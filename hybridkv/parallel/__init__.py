"""Tensor parallelism over torch.distributed: process group, sharding, mirrored pools, workers."""
from .group import RankFailedError
from .shard_loading import ShardLoad
from .tensor_parallel import TensorParallel, check_size

__all__ = ["RankFailedError", "ShardLoad", "TensorParallel", "check_size"]
