"""oneDNN-prepacked weights for CPU matmuls over a few rows.

MKL's sgemm repacks the weight on every call; in the 4-64-row products of batched decode and tree
verification that costs about as much as the product itself. A weight packed once in oneDNN's blocked
layout (what torch.compile's CPU freezing does) skips it: all of SmolLM2-135M's fp32 linears over 16
rows took 61 ms instead of 87 ms here. fp32 products over one or two rows stay on F.linear (a
memory-bound GEMV, where MKL is faster); bf16 takes the packed path at every row count, since its
unpacked call pays ~0.1 ms of setup per matrix. The packed copy doubles the linear weights' memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_MIN_ROWS = {torch.float32: 3, torch.bfloat16: 1}   # fewest rows worth the packed path, by dtype


def can_prepack(device: str, dtype: torch.dtype) -> bool:
    return device == "cpu" and dtype in _MIN_ROWS and torch.backends.mkldnn.is_available()


class PrepackedLinear(nn.Module):
    """y = x @ weight.T + bias, keeping the original parameters (their names, their readers) and a packed copy."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.min_rows = _MIN_ROWS[weight.dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def prepack_linears(module: nn.Module) -> int:
    """Swap every nn.Linear under `module` for a PrepackedLinear over the same parameters; returns the
    bytes the packed copies take."""
    added = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PrepackedLinear(child.weight, child.bias))
                added += child.weight.numel() * child.weight.element_size()
    return added
