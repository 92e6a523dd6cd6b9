"""hybridkv: serve hybrid language models with a dual memory manager (paged KV + state slots)."""
from hybridkv.outputs import CompletionOutput, RequestOutput
from hybridkv.sampling_params import SamplingParams
from hybridkv.specs import AttentionSpec, LayerSpec, RecurrentSpec

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "AttentionSpec",
           "RecurrentSpec", "LayerSpec", "HybridCacheManager"]


def __getattr__(name):  # lazy: importing the memory manager must not pull in models or torch kernels
    if name == "LLM":
        from hybridkv.llm import LLM
        return LLM
    if name == "HybridCacheManager":
        from hybridkv.cache_manager import HybridCacheManager
        return HybridCacheManager
    raise AttributeError(name)
