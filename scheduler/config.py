"""The engine's knobs, checked once, with the defaults a vLLM user expects."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

from hybridkv.cache_dtype import check_cache_dtype
from hybridkv.checkpoint_policy import DEFAULT_POLICY
from hybridkv.eviction import DEFAULT_EVICTION
from hybridkv.memory.disk_tier import DEFAULT_DISK_CACHE_BYTES
from hybridkv.speculative.config import SpeculativeConfig

PREEMPTION_MODES = ("recompute", "swap", "auto")
CUDA_GRAPH_MODES = (False, True, "dry_run")


@dataclass
class EngineConfig:
    """block_size: tokens per KV block. max_num_batched_tokens: token budget per step (chunked
    prefill cuts prompts to fit). max_num_seqs: cap on running sequences. memory_budget_bytes:
    bytes for KV blocks + state slots (None: derived from gpu_memory_utilization on a GPU, 1 GiB on
    a CPU). checkpoint_share: share of the budget for prefix-cache state checkpoints. cuda_graphs:
    decode steps replay CUDA graphs (decode_graphs.py; never run on a GPU yet, so off by default);
    "dry_run" (tests) runs that path on a CPU with a direct call in place of capture and replay.
    speculative_config: None (off), or a dict / JSON text in vLLM's shape (hybridkv/speculative/
    config.py), kept as a SpeculativeConfig. host_cache_bytes: the host tier's budget for state
    checkpoints evicted from the device (0: off; hybridkv/memory/host_tier.py). disk_cache_dir: a
    directory for the disk tier of KV blocks and state checkpoints, which survives restarts (None:
    off; hybridkv/memory/disk_tier.py), within disk_cache_bytes (default 16 GiB); disk_read_ahead: a
    waiting request's disk files are read on a thread before its admission (False: in the admission,
    on the step's thread; memory/disk_read_ahead.py). verify_cache_hits: the fraction of prefix
    hits recomputed cold and compared (0: off; scheduler/hit_guard.py).
    kv_cache_dtype / state_cache_dtype: "auto" (the model's dtype), "int8" or "fp8_e4m3": KV pages /
    state slots kept as one-byte codes with a scale per row (hybridkv/cache_dtype.py);
    quantize_stochastic: int8 codes rounded stochastically (seeded by `seed`)."""

    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    memory_budget_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    checkpoint_policy: str = DEFAULT_POLICY
    checkpoint_every_n: int = 4
    checkpoint_eviction: str = DEFAULT_EVICTION
    checkpoint_share: Optional[float] = None
    host_cache_bytes: int = 0
    disk_cache_dir: Optional[str] = None
    disk_cache_bytes: int = DEFAULT_DISK_CACHE_BYTES
    disk_read_ahead: bool = True
    verify_cache_hits: float = 0.0
    kv_cache_dtype: str = "auto"
    state_cache_dtype: str = "auto"
    quantize_stochastic: bool = False
    preemption_mode: str = "auto"
    max_model_len: Optional[int] = None
    seed: int = 0
    cuda_graphs: Union[bool, str] = False
    speculative_config: Optional[object] = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs={self.cuda_graphs!r}; choose one of {CUDA_GRAPH_MODES}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r}; choose one of {PREEMPTION_MODES}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r} must be a positive integer (e.g. 16)")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if isinstance(self.host_cache_bytes, bool) or not isinstance(self.host_cache_bytes, int) \
                or self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes={self.host_cache_bytes!r} must be an integer >= 0 (0: no host tier)")
        if self.disk_cache_dir is not None and (not isinstance(self.disk_cache_dir, (str, os.PathLike))
                                                or not str(self.disk_cache_dir)):
            raise ValueError(f"disk_cache_dir={self.disk_cache_dir!r} must be a directory path (None: no disk tier)")
        if self.disk_cache_dir is not None:
            self.disk_cache_dir = os.fspath(self.disk_cache_dir)
        if self.disk_cache_dir is not None and not self.enable_prefix_caching:
            raise ValueError("disk_cache_dir keeps prefixes for later hits: it needs enable_prefix_caching=True "
                             "(drop --no-enable-prefix-caching or --disk-cache)")
        if isinstance(self.disk_cache_bytes, bool) or not isinstance(self.disk_cache_bytes, int) \
                or self.disk_cache_bytes <= 0:
            raise ValueError(f"disk_cache_bytes={self.disk_cache_bytes!r} must be an integer > 0")
        if not isinstance(self.disk_read_ahead, bool):
            raise ValueError(f"disk_read_ahead={self.disk_read_ahead!r} must be True or False")
        if isinstance(self.verify_cache_hits, bool) or not isinstance(self.verify_cache_hits, (int, float)) \
                or not 0.0 <= self.verify_cache_hits <= 1.0:
            raise ValueError(f"verify_cache_hits={self.verify_cache_hits!r} must be a fraction in [0, 1] (0: off)")
        check_cache_dtype("kv_cache_dtype", self.kv_cache_dtype)
        check_cache_dtype("state_cache_dtype", self.state_cache_dtype)
        if not isinstance(self.quantize_stochastic, bool):
            raise ValueError(f"quantize_stochastic={self.quantize_stochastic!r} must be True or False")
        if self.quantize_stochastic and self.kv_cache_dtype != "int8" and self.state_cache_dtype != "int8":
            raise ValueError("quantize_stochastic rounds int8 codes; set kv_cache_dtype or state_cache_dtype to 'int8'")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes={self.memory_budget_bytes} must be > 0")
