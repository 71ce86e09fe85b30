"""FP8 (e4m3) weights: the quantize/dequantize math, and FP8 checkpoints read as stored.

A weight [N, K] is kept as e4m3 values and fp32 scales, one per row and per block of `block` columns
(`block` = K: one scale per output channel). Other layouts are brought to this one as they are read,
which the fused projections need (q/k/v and gate/up are concatenated by rows, and their parts' row
counts need not be multiples of a checkpoint's 128-row blocks):
- per-tensor scales (AutoFP8's `weight_scale`, a scalar): the same scale on every row;
- per-channel scales (`weight_scale` [N] or [N, 1]): as they are;
- block scales (`weight_scale_inv` [N / 128, K / 128] with `weight_block_size: [128, 128]`, DeepSeek-V3's
  and Qwen3's FP8 releases): each block's scale repeated over its rows.
The weight is q * scale in every case, so none of these changes the values the checkpoint holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Optional

import torch

from engine.errors import ModelLoadError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
BLOCK = 128             # DeepSeek's block width, and the activation groups of the block scheme
_SCALE_NAMES = ("weight_scale_inv", "weight_scale")


class Fp8Weight(NamedTuple):
    q: torch.Tensor         # [N, K] float8
    scale: torch.Tensor     # [N, ceil(K / block)] fp32
    block: int              # columns one scale covers (K: one scale per row)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        columns = self.scale.repeat_interleave(self.block, dim=1)[:, :self.q.shape[1]]
        return (self.q.float() * columns).to(dtype)

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weights: what a parameter that is not an FP8 layer loads (a tensor's `.to`)."""
        return self.dequantize(dtype)

    def to_device(self, device) -> "Fp8Weight":
        return Fp8Weight(self.q.to(device), self.scale.to(device), self.block)

    @staticmethod
    def cat(parts: list["Fp8Weight"]) -> "Fp8Weight":
        """A fused projection's parts stacked by rows."""
        if len({p.block for p in parts}) > 1:
            raise ModelLoadError(f"FP8 parts of one fused projection come with scale blocks of different widths "
                                 f"({sorted({p.block for p in parts})} columns), which one layer cannot hold")
        return Fp8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), parts[0].block)


def cat_rows(parts: list) -> object:
    """Row-wise concatenation of a fused projection's parts: tensors, or FP8 weights with their scales."""
    return Fp8Weight.cat(parts) if isinstance(parts[0], Fp8Weight) else torch.cat(parts, dim=0)


def quantize(weight: torch.Tensor, block: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights [N, K] -> (e4m3 [N, K], fp32 scale) as checkpoints store them: one scale per output
    channel ([N, 1]) without `block`, else one per block of (rows, columns) ([N / rows, K / columns],
    DeepSeek's `weight_scale_inv`). Each scale maps its values' largest magnitude to e4m3's largest finite
    value (448); q * scale is the weight."""
    w = weight.detach().float()
    n, k = w.shape
    rows, columns = block or (1, k)
    padded = torch.nn.functional.pad(w, (0, -k % columns, 0, -n % rows))
    tiles = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // columns, columns)
    scale = tiles.abs().amax((1, 3)).clamp(min=torch.finfo(torch.float32).tiny) / E4M3_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(padded.shape)[:n, :k]
    return q.contiguous(), scale


def stored_weight(q: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]], name: str) -> Fp8Weight:
    """A weight and its scale as a checkpoint stores them (`quantize`'s layouts, or one scale for the
    tensor) in the row layout (module docstring)."""
    n, k = q.shape
    scale = scale.float()
    if block is not None and scale.dim() == 2 and scale.numel() > 1:
        rows, columns = block
        if scale.shape != (-(-n // rows), -(-k // columns)):
            raise ModelLoadError(f"{name}: scale of shape {list(scale.shape)} does not fit {rows}x{columns} blocks "
                                 f"of a {n}x{k} weight")
        return Fp8Weight(q, scale.repeat_interleave(rows, dim=0)[:n].contiguous(), columns)
    if scale.numel() == 1:
        return Fp8Weight(q, scale.reshape(1, 1).expand(n, 1).contiguous(), k)
    if scale.numel() == n:
        return Fp8Weight(q, scale.reshape(n, 1).contiguous(), k)
    raise ModelLoadError(f"{name}: scale of shape {list(scale.shape)} fits neither a tensor, its {n} rows nor its blocks")


class Fp8Checkpoint(NamedTuple):
    """What an FP8 checkpoint's quantization_config says."""
    block: Optional[tuple[int, int]]        # weight_block_size, or None for per-tensor / per-channel scales

    def describe(self) -> str:
        return f"{self.block[0]}x{self.block[1]} block scales" if self.block else "per-tensor/per-channel scales"


def fp8_checkpoint(quantization_config, source: str) -> Optional[Fp8Checkpoint]:
    """The FP8 layout a config's quantization_config describes; None without one. Other methods (GPTQ, AWQ,
    compressed-tensors, ...) and FP8 variants this engine does not read are refused with the reason."""
    if not quantization_config:
        return None
    q = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    method = q.get("quant_method", "?")
    if method == "mxfp4":
        return None         # GPT-OSS's experts: dequantized as they are read (mxfp4.py)
    if method != "fp8":
        raise ModelLoadError(f"{source} holds {method}-quantized weights; spec reads unquantized (bf16, fp16, fp32), "
                             "FP8 (quant_method 'fp8') and MXFP4 (quant_method 'mxfp4', GPT-OSS's experts, dequantized "
                             "at load) checkpoints. Pass the model's unquantized or FP8 release.")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"{source}: the FP8 format is {q['fmt']}; spec reads e4m3 weights (fmt 'e4m3').")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ModelLoadError(f"{source}: the FP8 activation_scheme is {scheme!r}; spec reads 'dynamic' and 'static'.")
    block = q.get("weight_block_size")
    if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"{source}: weight_block_size {block} is not two positive integers.")
    return Fp8Checkpoint(tuple(block) if block else None)


def checkpoint_of(model_dir: Path) -> Optional[Fp8Checkpoint]:
    """The FP8 layout of a model directory's config.json, if it has one."""
    return fp8_checkpoint(quantization_config(model_dir), str(model_dir))


def quantization_config(model_dir: Path) -> Optional[dict]:
    """The quantization_config of a model directory's config.json, if it has one."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None         # no config.json (a GGUF's converted directory has one; loading reports it)
    return config.get("quantization_config") if isinstance(config, dict) else None


def weight_name(name: str) -> str:
    """The weight a scale belongs to (`x.weight_scale_inv` -> `x.weight`); other names as they are."""
    base, _, leaf = name.rpartition(".")
    return f"{base}.weight" if leaf in _SCALE_NAMES else name


def paired(weights: Iterable[tuple[str, torch.Tensor]], checkpoint: Fp8Checkpoint, keep: bool
           ) -> Iterator[tuple[str, object]]:
    """An FP8 checkpoint's stream with each e4m3 weight and its scale (which may come before or after it,
    in another file too) made one: an Fp8Weight where `keep`, else its float32 values. A static activation
    scheme's input scales are dropped: activations are quantized per token as they come."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base, _, leaf = name.rpartition(".")
        if leaf == "input_scale":
            continue
        if leaf not in _SCALE_NAMES and not (leaf == "weight" and tensor.dtype == E4M3):
            yield name, tensor
            continue
        parts = waiting.setdefault(base, {})
        parts["scale" if leaf in _SCALE_NAMES else "q"] = tensor
        del tensor
        if len(parts) == 2:
            del waiting[base]
            weight = stored_weight(parts["q"], parts["scale"], checkpoint.block, f"{base}.weight")
            yield f"{base}.weight", weight if keep else weight.dequantize()
    if waiting:
        base, parts = next(iter(waiting.items()))
        raise ModelLoadError(f"{base}: an FP8 weight without its scale (or a scale without its weight), "
                             f"{len(waiting)} in all; the checkpoint is incomplete.")
