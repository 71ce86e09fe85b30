"""CPU matmul weights laid out for decoding: oneDNN-prepacked, and column-major for fp32 GEMV.

MKL's sgemm repacks the weight on every call; in the 2-64-row products of batched decode and tree
verification that costs about as much as the product itself. A weight packed once in oneDNN's blocked
layout (what torch.compile's CPU freezing does) skips it:

- fp32: packed wins from 2 rows. One row (batch-1 decode) is a memory-bound GEMV where MKL beats oneDNN
  and streams a column-major weight faster. So an fp32 weight is kept twice: packed for 2+ rows,
  column-major for one.
- bf16: packed wins at every row count, so the packed copy replaces the decoder's weights (left as shape-only `meta` tensors), and bf16 costs no extra memory
  beyond a packed copy of a head shared with the embedding. Only where the CPU has native bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_MIN_PACKED_ROWS = {torch.float32: 2, torch.bfloat16: 0}   # fp32 GEMV stays on MKL


def native_bf16(device: str) -> bool:
    """Whether bf16 matmuls run on native instructions here: a CUDA device with bf16, or a CPU with
    AVX-512-BF16 / AMX. Elsewhere they are emulated, several times slower than fp32."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_prepack(device: str, dtype: torch.dtype) -> bool:
    if device != "cpu" or dtype not in _MIN_PACKED_ROWS or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or native_bf16(device)


class PrepackedLinear(nn.Module):
    """y = x @ weight.T + bias through a packed copy of the weight. The parameters keep their names.
    `owned`: the weight belongs to this linear alone, so it may be relaid out (fp32: column-major in
    place) or dropped (bf16); a weight shared with an embedding, whose lookups want rows, stays as it is
    (fp32 keeps a column-major copy)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None, owned: bool = True):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.min_rows = _MIN_PACKED_ROWS[weight.dtype]
        self.gemv_copy: torch.Tensor | None = None
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            if weight.dtype == torch.float32:
                column_major = weight.detach().t().contiguous().t()
                if owned:
                    weight.data = column_major
                else:
                    self.gemv_copy = column_major
            elif owned:    # only the shape stays; the caller drops the last reference to the data
                self.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
        self.extra_bytes = self._bytes(1 + (self.gemv_copy is not None) - (self.weight.device.type == "meta"))

    def _bytes(self, copies: int) -> int:
        return copies * self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] < self.min_rows:
            return F.linear(x, self.weight if self.gemv_copy is None else self.gemv_copy, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def prepack_linears(module: nn.Module) -> int:
    """Swap every nn.Linear under `module` for a PrepackedLinear owning its weight; returns the bytes
    added (negative when the packed copies replace the weights)."""
    added = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                packed = PrepackedLinear(child.weight, child.bias)
                setattr(parent, name, packed)
                added += packed.extra_bytes
    return added
