"""Tensor parallelism over torch.distributed: process group, sharding, mirrored pools, workers."""
from .group import RankFailedError
from .tensor_parallel import TensorParallel, check_size

__all__ = ["RankFailedError", "TensorParallel", "check_size"]
