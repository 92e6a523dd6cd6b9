"""Qwen4-Exp's stored tensor names answered under the text model's in-memory names.

Prefix: `model.` (Qwen4ExpForCausalLM) or `model.language_model.` (the multimodal checkpoint). The
n-gram embedding tables are stored in `split_ngram_parts` row shards
(`...ngram_embedding.shard_{k}.weight`) and read back concatenated, as transformers loads them.
Per-expert weights stack in models/moe.py's PerExpertView.
"""
from __future__ import annotations

from .checkpoint import PartsView

_TABLE = ".ngram_embedding.weight"


class Qwen4ExpNames(PartsView):
    """A checkpoint seen under in-memory names; anything with `__contains__` and `get(name)` inside."""

    def _parts(self, name: str) -> list[str]:
        candidates = [name]
        if name.startswith("model."):
            candidates.append("model.language_model." + name.removeprefix("model."))
        for full in candidates:
            if full in self.ckpt:
                return [full]
            if full.endswith(_TABLE):
                head, shards = full[: -len(_TABLE)], []
                while f"{head}.ngram_embedding.shard_{len(shards)}.weight" in self.ckpt:
                    shards.append(f"{head}.ngram_embedding.shard_{len(shards)}.weight")
                if shards:
                    return shards
        return [name]
