"""Tensor parallelism over torch.distributed: process group, sharding, an executor, mirrored pools, workers."""
from .group import RankFailedError
from .shard_loading import ShardLoad
from .executor import TensorParallelExecutor
from .tensor_parallel import TensorParallel, check_size

__all__ = ["RankFailedError", "ShardLoad", "TensorParallel", "TensorParallelExecutor", "check_size"]
