"""Host values onto the device without stalling the host.

`torch.tensor(values, device="cuda")` copies from pageable memory, which waits for the GPU to finish
everything queued before it: a decode step that builds a dozen small index tensors that way waits a
dozen times. Staged in pinned memory, the copy is queued behind the step's kernels instead (PyTorch's
pinned allocator keeps the staging block until the copy has run). On a CPU it is a plain tensor."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch


def to_device(values: Union[Sequence, torch.Tensor], device: Union[str, torch.device],
              dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if torch.device(device).type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def ragged_index(lens: Sequence[int], width: int, device: Union[str, torch.device]) -> torch.Tensor:
    """Flat indices of the first lens[b] entries of each row of a [len(lens), width] layout, made on the
    host: a boolean mask on the device would wait for the GPU to count its rows."""
    return to_device([b * width + i for b, n in enumerate(lens) for i in range(n)], device)
