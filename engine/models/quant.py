"""Weight-only quantized linears for the CPU, through the kernels that ship with torch.

- int4: groups of 32 weights along the input, w = q * scale + min with q in 0..15 (GGUF's Q4_0, Q4_1
  and Q4_K are exactly this, engine/loader/gguf_quant.py); aten._weight_int4pack_mm_for_cpu with bf16
  activations, the scale and min rounded to bf16 there. 0.625 bytes per weight.
- int8: one scale per output row (symmetric); aten._weight_int8pack_mm with bf16 activations. 1 byte
  per weight.
Both kernels are scalar for fp32 activations on x86 (7-20x slower), so activations go in as bf16 and
come back in the model's dtype; both give a row the same result whatever the number of rows (a verify
forward agrees with a decode step), which speculative decoding's losslessness leans on. Measured on
this project's CPUs (docs/benchmarking.md): fastest at one row, an 8-row call costs ~3.7x a 1-row call.
The layers quantized are the decoder's (q/k/v, o, gate/up, down); embeddings, norms and the lm_head
stay dense.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from engine.loader.gguf_quant import GROUP, unpack

aten = torch.ops.aten
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Fused projections and the checkpoint parts they are made of, in order.
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Int4Linear(nn.Module):
    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                 bias: Optional[nn.Parameter]):
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.register_buffer("weight_int4", aten._convert_weight_to_int4pack_for_cpu(unpack(packed).contiguous(), 1),
                             persistent=False)
        # The kernel computes (q - 8) * scale + zero per group: zero = min + 8 * scale.
        self.register_buffer("scale_zero", torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
                             .to(torch.bfloat16), persistent=False)
        self.bias = bias

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: Optional[nn.Parameter]) -> "Int4Linear":
        """Round float weights to groups of 32 (per-group min and max map to 0 and 15)."""
        from engine.loader.gguf_quant import pack

        w = weight.detach().float().view(weight.shape[0], -1, GROUP)
        low, high = w.amin(-1), w.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-8)
        q = ((w - low[..., None]) / scale[..., None]).round().clamp(0, 15).view(weight.shape)
        return cls(pack(q.to(torch.uint8).numpy()), scale, low, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).to(torch.bfloat16), self.weight_int4,
                                             GROUP, self.scale_zero).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: Optional[nn.Parameter]):
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(-1) / 127).clamp(min=1e-8)
        self.out_features, self.in_features = w.shape
        self.register_buffer("weight_int8", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8),
                             persistent=False)
        self.register_buffer("scale", scale.to(torch.bfloat16), persistent=False)
        self.bias = bias

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: Optional[nn.Parameter]) -> "Int8Linear":
        return cls(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = aten._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16), self.weight_int8,
                                     self.scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


KINDS = {"int4": Int4Linear, "int8": Int8Linear}


def decoder_linears(model: nn.Module) -> Iterable[tuple[str, nn.Module, str]]:
    """(checkpoint prefix, parent module, attribute) of every quantizable linear of the decoder."""
    for name, module in model.named_modules():
        for attr in QUANTIZED_LINEARS:
            if isinstance(getattr(module, attr, None), nn.Linear):
                yield f"{name}.{attr}" if name else attr, module, attr


def quantize_loaded(model: nn.Module, kind: str) -> None:
    """Replace the decoder's loaded float linears with `kind` ("int4" or "int8") ones."""
    for _, parent, attr in list(decoder_linears(model)):
        linear = getattr(parent, attr)
        if kind == "int4" and linear.in_features % GROUP:
            continue                       # int4 groups need whole groups of 32 inputs
        setattr(parent, attr, KINDS[kind].quantize(linear.weight, linear.bias))


def install_gguf_groups(model: nn.Module, groups: Callable[[str], Optional[tuple]]) -> set[str]:
    """Replace every decoder linear whose checkpoint parts all come as GGUF 4-bit groups
    (`groups(hf name)` -> (packed, scale, min) or None) with an Int4Linear built from them; returns
    the checkpoint names now provided (their float copies need not be loaded)."""
    provided: set[str] = set()
    for prefix, parent, attr in list(decoder_linears(model)):
        base = prefix.rsplit(".", 1)[0]
        names = [f"{base}.{p}.weight" for p in PARTS.get(attr, (attr,))]
        parts = [groups(n) for n in names]
        if any(p is None for p in parts):
            continue                       # a part in another format (Q6_K, ...): the layer stays dense
        linear = getattr(parent, attr)
        packed, scale, low = (torch.cat([p[i] for p in parts]) for i in range(3))
        setattr(parent, attr, Int4Linear(packed, scale.float(), low.float(), linear.bias))
        provided.update(names)
    return provided
