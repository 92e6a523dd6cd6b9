"""The model interface the engine uses: specs per layer, a packed forward over pools, weight loading."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.specs import LayerSpec

from .checkpoint import CheckpointError, CheckpointTensors
from .forward_batch import ForwardBatch, ModelCaches
from .fused_linear import FusedLinear
from .generation_defaults import GenerationDefaults


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


class HybridModel(nn.Module):
    """A decoder LM whose attention layers use the paged KV pool and recurrent layers state slots.

    Attributes set by the loader: `config` (HF config), `tokenizer` (or None), `fingerprint` (str),
    `vocab_size`, `max_model_len`, `eos_token_ids`, `architecture`, `generation_defaults`
    (generation_config.json's sampling defaults, for fields a request leaves unset).
    A family subclass builds its layers in `__init__(config)`, names its parameters like the HF
    checkpoint (or overrides `checkpoint_name` / `load_weights`), and implements `cache_specs`
    and `forward`.
    """

    architecture: str = ""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tokenizer = None
        self.fingerprint = ""
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.eos_token_ids = _as_id_list(getattr(config, "eos_token_id", None))
        self.generation_defaults = GenerationDefaults()
        self._heads: dict[int, FusedLinear] = {}  # id(lm_head) -> its weight in the CPU layout

    # --- what the engine calls -------------------------------------------------------------
    def cache_specs(self) -> dict[int, LayerSpec]:
        """Model layer index -> AttentionSpec / RecurrentSpec, in the cache dtype."""
        raise NotImplementedError

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Run T packed tokens of R requests; write KV / states into `caches`.

        Returns float32 logits `[R, vocab]` for each request's last token, or `[T, vocab]` when
        `batch.return_all_logits`.
        """
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # --- helpers for families ----------------------------------------------------------------
    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch, lm_head: nn.Module) -> torch.Tensor:
        """hidden [T, H] (after the final norm) -> float32 logits [R, T or N, vocab]."""
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        elif not batch.return_all_logits and not (
                hidden.shape[0] == len(batch.query_lens_cpu) and max(batch.query_lens_cpu, default=0) == 1):
            hidden = hidden[batch.query_start_loc[1:].long() - 1]  # (all-decode steps are already one row each)
        if type(lm_head) is nn.Linear:  # through FusedLinear for its CPU layout (a callable: called)
            head = self._heads.get(id(lm_head))
            if head is None or head.linears[0] is not lm_head:
                head = self._heads[id(lm_head)] = FusedLinear((lm_head,))
            return F.linear(hidden, *head.weight_bias()).float()
        return lm_head(hidden).float()

    def checkpoint_name(self, name: str) -> str | None:
        """The checkpoint tensor that fills parameter/buffer `name`; None to leave it alone."""
        return name

    def tied_weights(self) -> dict[str, str]:
        """Parameter -> parameter it copies when the checkpoint omits it (tied embeddings)."""
        if getattr(self.config, "tie_word_embeddings", False):
            return {"lm_head.weight": "model.embed_tokens.weight"}
        return {}

    @torch.no_grad()
    def load_weights(self, ckpt: CheckpointTensors) -> None:
        """Fill every parameter and persistent buffer from `ckpt`, checking names and shapes.

        Raises CheckpointError naming a missing tensor or one whose shape differs.
        """
        tied = self.tied_weights()
        state = self.state_dict(keep_vars=True)
        for name, param in state.items():
            source = self.checkpoint_name(name)
            if source is None:
                continue
            if source not in ckpt and name in tied:
                source = self.checkpoint_name(tied[name])
            tensor = ckpt.get(source)
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"tensor {source!r} has shape {tuple(tensor.shape)} in the checkpoint, but "
                    f"{self.architecture} with this config.json expects {tuple(param.shape)}; the "
                    f"weights do not match the config")
            param.data.copy_(tensor.to(device=param.device, dtype=param.dtype))
