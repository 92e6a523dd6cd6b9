"""hybridkv: serve hybrid language models with a dual memory manager (paged KV + state slots)."""
from hybridkv.errors import (MemoryBudgetError, RequestStateError, RequestTooLargeError,
                             SnapshotMismatchError)
from hybridkv.outputs import CompletionOutput, RequestOutput
from hybridkv.plan import MemoryPlan, plan
from hybridkv.request import Request, RequestStatus
from hybridkv.sampling_params import SamplingParams
from hybridkv.snapshot import RequestSnapshot
from hybridkv.specs import AttentionSpec, LayerSpec, RecurrentSpec


def _version() -> str:
    """The installed package's version; from pyproject.toml in a source tree that is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybridkv")
    except PackageNotFoundError:
        import re
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return m.group(1) if m else "0+unknown"


__version__ = _version()

__all__ = ["__version__", "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "AttentionSpec",
           "RecurrentSpec", "LayerSpec", "HybridCacheManager", "ManagerStats", "RequestSnapshot",
           "MemoryPlan", "plan", "MemoryBudgetError", "RequestTooLargeError",
           "SnapshotMismatchError", "RequestStateError", "Request", "RequestStatus"]


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
