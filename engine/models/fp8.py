"""FP8 linears for CUDA GPUs: e4m3 weights with fp32 scales (engine/loader/fp8_quant.py) times e4m3
activations quantized as they come, one scale per token (per token and group of 128 columns where the
weight has block scales, as DeepSeek-V3 computes; vLLM and SGLang quantize activations the same ways),
multiplied in cuBLASLt's FP8 GEMM: torch._scaled_mm with row-wise scales, torch.nn.functional.scaled_mm
with 1x128 blocks on both sides. The weight is half of bf16's bytes, which a decode step reads in full,
and the tensor cores of compute capability 8.9 and later (Ada, Hopper) multiply e4m3 at twice bf16's rate.

Where that GEMM does not run, the same layer computes weight-only (the weight dequantized to the
activations' dtype for each product): CUDA cards before 8.9, block scales where torch's blockwise GEMM
does not (it needs Hopper and CUDA 12.9; a probe against the reference checks once per device), and
shapes it refuses. On a CPU the layer computes the GEMM's reference (`reference_gemm`: both sides
dequantized, multiplied in fp32), which is what the tests check the layer with; serving on a CPU
dequantizes FP8 checkpoints while loading instead (model_runner.resolve_quantization).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.loader.fp8_quant import BLOCK, Fp8Weight, quantize, stored_weight

log = logging.getLogger(__name__)

# The library's row-wise FP8 kernels write bf16; a layer casts their output to its activations' dtype.
_GEMM_OUT = torch.bfloat16


def quantize_activations(rows: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (e4m3 [M, K], fp32 scales [M, K / group]): one scale per token and group."""
    return quantize(rows, (1, group))


def reference_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """What the scaled GEMM computes, in torch: (a * a_scale) @ (w * w_scale).T, written as _GEMM_OUT
    (K a multiple of the scales' groups). Summed in float64, so that a row's result does not depend on
    how many rows the call has (an fp32 matmul's order of sums does): verification leans on that."""
    def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return Fp8Weight(q, scale, q.shape[1] // scale.shape[1]).dequantize().double()

    return (dequantize(a, a_scale) @ dequantize(w, w_scale).t()).to(_GEMM_OUT)


def scaled_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The library's FP8 GEMM: row-wise scales (one per token, one per output channel), or 1x128 blocks on
    both sides, whose scales cuBLASLt reads column-major ([M, K/128] with strides [1, M], the token count
    padded to a multiple of 4)."""
    if w_scale.shape[1] == 1:
        return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_scale.t(), out_dtype=_GEMM_OUT)
    rows = a.shape[0]
    pad = -rows % 4
    if pad:
        a, a_scale = F.pad(a.view(torch.uint8), (0, 0, 0, pad)).view(a.dtype), F.pad(a_scale, (0, 0, 0, pad), value=1.0)
    out = F.scaled_mm(a, w.t(), a_scale.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                      w_scale, F.ScalingType.BlockWise1x128, output_dtype=_GEMM_OUT)
    return out[:rows]


@functools.lru_cache(maxsize=None)
def blockwise_gemm_runs(device: torch.device) -> bool:
    """Whether torch's blockwise FP8 GEMM runs on `device` and agrees with the reference (once per device)."""
    g = torch.Generator(device).manual_seed(0)
    w = Fp8Weight(*quantize(torch.randn(256, 256, generator=g, device=device), (1, BLOCK)), BLOCK)
    a, a_scale = quantize_activations(torch.randn(3, 256, generator=g, device=device), BLOCK)
    w_scale = w.scale.t().contiguous().t()
    try:
        out = scaled_gemm(a, a_scale, w.q, w_scale).float()
    except (RuntimeError, ValueError, NotImplementedError) as e:
        log.info("FP8 block scales: weight-only on %s (torch's blockwise GEMM does not run: %s)", device, e)
        return False
    expected = reference_gemm(a, a_scale, w.q, w.scale).float()
    if not torch.allclose(out, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item()):
        log.warning("FP8 block scales: weight-only on %s (torch's blockwise GEMM disagrees with the reference)", device)
        return False
    return True


def gemm_path(device: torch.device, out_features: int, in_features: int, blocks: int, block: int) -> str:
    """How a layer multiplies: "scaled_mm" (the library's FP8 GEMM), "reference" (its torch reference, on
    a CPU) or "weight_only"."""
    if blocks > 1 and in_features % block:
        return "weight_only"        # activations cannot be grouped as the weight's columns are
    if device.type != "cuda":
        return "reference"
    if torch.cuda.get_device_capability(device) < (8, 9) or out_features % 16 or in_features % 16:
        return "weight_only"
    if blocks == 1:
        return "scaled_mm"
    return "scaled_mm" if block == BLOCK and blockwise_gemm_runs(device) else "weight_only"


class Fp8Linear(nn.Module):
    def __init__(self, weight: Fp8Weight, bias: Optional[nn.Parameter]):
        super().__init__()
        self.out_features, self.in_features = weight.q.shape
        blocks = weight.scale.shape[1]
        self.block = weight.block
        # Activations are grouped as the weight's columns are: a whole row under one scale per row.
        self.group = self.in_features if blocks == 1 else weight.block
        self.path = gemm_path(weight.q.device, self.out_features, self.in_features, blocks, weight.block)
        self.register_buffer("weight_fp8", weight.q, persistent=False)
        # Column-major, as the blockwise GEMM reads it (a no-op for one scale per row).
        self.register_buffer("weight_scale", weight.scale.t().contiguous().t(), persistent=False)
        self.bias = bias

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: Optional[nn.Parameter]) -> "Fp8Linear":
        """Float weights rounded to e4m3 with one scale per output channel (--quantization fp8)."""
        return cls(stored_weight(*quantize(weight), None, "weight"), bias)

    def fp8_weight(self) -> Fp8Weight:
        return Fp8Weight(self.weight_fp8, self.weight_scale, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.path == "weight_only":
            y = F.linear(rows, self.fp8_weight().dequantize(x.dtype))
        else:
            gemm = scaled_gemm if self.path == "scaled_mm" else reference_gemm
            y = gemm(*quantize_activations(rows, self.group), self.weight_fp8, self.weight_scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def layer_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(checkpoint prefix, parent, attribute) of every linear of the decoder layers (attention, MLP,
    experts: every one an FP8 checkpoint may store in e4m3), fused names as the model holds them."""
    for name, module in model.model.layers.named_modules(prefix="model.layers"):
        for attr, child in module.named_children():
            if isinstance(child, nn.Linear):
                yield f"{name}.{attr}", module, attr


def fp8_sinks(model: nn.Module, online: bool) -> dict[str, Callable[[object], None]]:
    """Where each decoder linear's weight goes when loading reads it: an FP8 checkpoint's e4m3 weights
    (Fp8Weight) become Fp8Linear layers as stored and its float ones (layers it keeps unquantized) stay
    float; with `online` (--quantization fp8 on a float checkpoint) float weights are rounded to e4m3."""
    from engine.models.quant import _Pending, release_freed_memory

    sinks: dict[str, Callable[[object], None]] = {}
    for prefix, parent, attr in list(layer_linears(model)):
        linear = getattr(parent, attr)
        pending = _Pending(linear.bias)
        setattr(parent, attr, pending)

        def sink(weight, parent=parent, attr=attr, bias=pending.bias, like=linear.weight) -> None:
            setattr(parent, attr, _layer(weight, bias, online, like))
            release_freed_memory()

        sinks[f"{prefix}.weight"] = sink
    return sinks


def _layer(weight, bias: Optional[nn.Parameter], online: bool, like: torch.Tensor) -> nn.Module:
    """A decoder linear from the weight loading read; `like` is the float weight it replaces (its device
    and dtype)."""
    if isinstance(weight, Fp8Weight):
        return Fp8Linear(weight.to_device(like.device), bias)
    if online:
        return Fp8Linear.quantize(weight.to(like.device), bias)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.to(like.device, like.dtype), requires_grad=False)
    linear.bias = bias
    return linear


def describe(model: nn.Module) -> str:
    """How the model's FP8 layers multiply, e.g. "24 scaled_mm, 2 weight_only"."""
    paths = Counter(m.path for m in model.modules() if isinstance(m, Fp8Linear))
    return ", ".join(f"{n} {path}" for path, n in sorted(paths.items()))
