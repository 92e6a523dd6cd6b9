"""Published Mixtral-style MoE names seen as transformers' in-memory ones.

MiniMax and Kimi-Linear publish their MoE under `block_sparse_moe` with per-expert `w1` (gate),
`w3` (up) and `w2` (down); transformers renames them onto `mlp` (conversion_mapping.py).
"""
from __future__ import annotations

import torch


class MixtralExpertNames:
    """A checkpoint seen with transformers' names (`mlp.*`, per-expert `mlp.experts.E.{gate,up,
    down}_proj`, which models/moe.py's PerExpertView stacks) when it holds the published ones
    (`block_sparse_moe.*`, `block_sparse_moe.experts.E.{w1,w3,w2}`). Wraps anything with
    `__contains__` and `get(name)`; a name it holds as such is returned unchanged."""

    _PARTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def _published(self, name: str) -> str:
        head, sep, tail = name.partition(".mlp.")
        if not sep:
            return name
        pieces = tail.split(".")
        if len(pieces) == 4 and pieces[0] == "experts" and pieces[2] in self._PARTS:
            pieces[2] = self._PARTS[pieces[2]]
        return f"{head}.block_sparse_moe.{'.'.join(pieces)}"

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt or self._published(name) in self.ckpt

    def get(self, name: str) -> torch.Tensor:
        return self.ckpt.get(name if name in self.ckpt else self._published(name))
