"""hybridkv: serve hybrid language models with a dual memory manager (paged KV + state slots)."""
from hybridkv.errors import (MemoryBudgetError, RequestStateError, RequestTooLargeError,
                             SnapshotMismatchError)
from hybridkv.outputs import CompletionOutput, RequestOutput
from hybridkv.plan import MemoryPlan, plan
from hybridkv.sampling_params import SamplingParams
from hybridkv.snapshot import RequestSnapshot
from hybridkv.specs import AttentionSpec, LayerSpec, RecurrentSpec

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "AttentionSpec",
           "RecurrentSpec", "LayerSpec", "HybridCacheManager", "ManagerStats", "RequestSnapshot",
           "MemoryPlan", "plan", "MemoryBudgetError", "RequestTooLargeError",
           "SnapshotMismatchError", "RequestStateError"]


def __getattr__(name):  # lazy: `import hybridkv` stays light; LLM pulls in models and kernels
    if name == "LLM":
        from hybridkv.llm import LLM
        return LLM
    if name == "HybridCacheManager":
        from hybridkv.cache_manager import HybridCacheManager
        return HybridCacheManager
    if name == "ManagerStats":
        from hybridkv.manager_stats import ManagerStats
        return ManagerStats
    raise AttributeError(name)
