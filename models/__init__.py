"""hybridkv.models: load Hugging Face checkpoints and run them on the paged KV pool and state slots.

Entry point: `load_model(path, device="cpu", dtype=torch.float32) -> HybridModel`.
A model declares `cache_specs()` (layer index -> AttentionSpec / RecurrentSpec) and runs
`forward(ForwardBatch, ModelCaches) -> float32 logits`.
"""
from .base import HybridModel
from .forward_batch import ForwardBatch, ModelCaches
from .loader import CheckpointError, load_model
from .registry import UnsupportedArchitectureError, supported_architectures

__all__ = [
    "CheckpointError",
    "ForwardBatch",
    "HybridModel",
    "ModelCaches",
    "UnsupportedArchitectureError",
    "load_model",
    "supported_architectures",
]
