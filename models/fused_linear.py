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

    @staticmethod
    def _is_row_views(buffer: Optional[torch.Tensor], parts: list) -> bool:
        if buffer is None:
            return False
        row = buffer.stride(0) * buffer.element_size() if buffer.dim() > 1 else buffer.element_size()
        at = buffer.data_ptr()
        for p in parts:
            if p.data_ptr() != at or p.dtype != buffer.dtype or p.device != buffer.device:
                return False
            at += p.shape[0] * row
        return True

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

    def weight_bias(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The fused (weight, bias), rebuilt when a parameter no longer views the buffer."""
        ok = self._is_row_views(self._weight, [lin.weight for lin in self.linears])
        if ok and self._bias is not None:
            ok = self._is_row_views(self._bias, [lin.bias for lin in self.linears])
        if not ok:
            self._fuse()
        return self._weight, self._bias
