"""Several linear layers that read the same input, run as one matmul (q/k/v, gate/up).

The checkpoint keeps its own parameter names (q_proj.weight, ...); on first use their weights are
concatenated into one buffer and each parameter becomes a view of its rows, so memory is not
doubled and a later in-place load (`param.data.copy_`) still lands in the fused buffer. When a
parameter is replaced (a new load, `.to()`), the views no longer match and the buffer is rebuilt.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn


class FusedLinear:
    """linears [n] of equal in_features -> one (weight [sum out, in], bias or None) for F.linear.

    The output splits back with `.split(self.sizes, -1)`. Biases are fused when all have one;
    a mix of biased and unbiased layers is refused.
    """

    def __init__(self, linears: Sequence[nn.Linear]):
        if len({lin.in_features for lin in linears}) != 1:
            raise ValueError(f"fused linears need one input width, got "
                             f"{[lin.in_features for lin in linears]}")
        biased = {lin.bias is not None for lin in linears}
        if len(biased) != 1:
            raise ValueError("fused linears must all have a bias or all have none")
        self.linears = tuple(linears)
        self.sizes = [lin.out_features for lin in linears]
        self._weight: Optional[torch.Tensor] = None
        self._bias: Optional[torch.Tensor] = None
        self._ptrs: tuple = ()  # the parameters' data_ptr()s right after fusing

    def _current_ptrs(self) -> tuple:
        ptrs = tuple(lin.weight.data_ptr() for lin in self.linears)
        return ptrs if self._bias is None else ptrs + tuple(lin.bias.data_ptr() for lin in self.linears)

    def _fuse(self) -> None:
        with torch.inference_mode(False), torch.no_grad():
            self._weight = torch.cat([lin.weight.detach() for lin in self.linears])
            for lin, part in zip(self.linears, self._weight.split(self.sizes)):
                lin.weight.data = part
            self._bias = None
            if self.linears[0].bias is not None:
                self._bias = torch.cat([lin.bias.detach() for lin in self.linears])
                for lin, part in zip(self.linears, self._bias.split(self.sizes)):
                    lin.bias.data = part
            self._ptrs = self._current_ptrs()

    def weight_bias(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The fused (weight, bias), rebuilt when a parameter no longer views the buffer."""
        # A parameter replaced (new load, .to()) no longer points into the buffer; the buffer is
        # held here, so its addresses cannot be reused by another tensor. One call per parameter:
        # this runs for every projection of every step.
        if self._weight is None or self._current_ptrs() != self._ptrs:
            self._fuse()
        return self._weight, self._bias
