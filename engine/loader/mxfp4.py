"""MXFP4 checkpoints (quant_method "mxfp4": GPT-OSS's releases store their experts so): the weights are
dequantized as they are read, to bfloat16, which holds every MXFP4 value exactly; or, for the CPU's
quantized layers (engine/models/quant.py install_gguf_groups), each expert's projection is read as the
5-bit groups a GGUF's MXFP4 becomes (`ExpertGroups`, gguf_quant.e2m1), exactly, and never dequantized.

MXFP4 (OCP microscaling) keeps 32 consecutive weights of a row as 4-bit e2m1 values sharing a power of
two. A checkpoint stores tensor `x` [..., rows, columns] as
- `x_blocks` [..., rows, columns / 32, 16] uint8: two values a byte, the low nibble first;
- `x_scales` [..., rows, columns / 32] uint8: e8m0 exponents, the group's factor 2^(s - 127).
GPT-OSS stores its experts' weights [experts, out, in] so, where the unquantized checkpoints hold them
[experts, in, out] (transformers' GptOssExperts): they are yielded in that layout, under that name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from engine.errors import ModelLoadError
from engine.loader.gguf_quant import Groups, e2m1
from engine.loader.safetensors_io import SafetensorsFile

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Each byte's two values, low nibble first: one lookup a byte.
_PAIRS = torch.tensor([[E2M1[byte & 0xF], E2M1[byte >> 4]] for byte in range(256)])
_PARTS = ("_blocks", "_scales")
_ROWS = 4096        # rows dequantized at a time: their float32 temporaries stay small
# One expert's projection as the engine's layers name it.
_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def is_mxfp4(quantization_config) -> bool:
    if not quantization_config:
        return False
    q = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    return q.get("quant_method") == "mxfp4"


def weight_name(name: str) -> str:
    """The tensor a block or scale tensor belongs to (`x_blocks` -> `x`); other names as they are."""
    for part in _PARTS:
        if name.endswith(part):
            return name[:-len(part)]
    return name


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., rows, groups, 16] blocks and [..., rows, groups] scales -> [..., rows, groups * 32] values."""
    *lead, groups, width = blocks.shape
    flat_blocks, flat_scales = blocks.reshape(-1, groups, width), scales.reshape(-1, groups)
    out = torch.empty(flat_blocks.shape[0], groups, 2 * width, dtype=dtype)
    for r in range(0, len(out), _ROWS):
        values = _PAIRS[flat_blocks[r:r + _ROWS].int()].flatten(-2)
        out[r:r + _ROWS] = values.mul_(torch.exp2(flat_scales[r:r + _ROWS].float() - 127)[..., None])
    return out.reshape(*lead, groups * 2 * width)


def dequantized(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's stream with each blocks/scales pair (in any order, in any files) made the float
    tensor they store, [..., columns, rows] as the unquantized checkpoints hold it."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base = weight_name(name)
        if base == name:
            yield name, tensor
            continue
        parts = waiting.setdefault(base, {})
        parts[name[len(base):]] = tensor
        del tensor
        if len(parts) == 2:
            del waiting[base]
            yield base, _checked(base, parts["_blocks"], parts["_scales"])
    if waiting:
        base, parts = next(iter(waiting.items()))
        missing = "scales" if "_blocks" in parts else "blocks"
        raise ModelLoadError(f"{base}: MXFP4 {missing} missing ({len(waiting)} tensors lack a part); the checkpoint "
                             "is incomplete.")


def _checked(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1:] != (16,) \
            or blocks.shape[:-1] != scales.shape:
        raise ModelLoadError(f"{name}: MXFP4 blocks {list(blocks.shape)} ({blocks.dtype}) and scales "
                             f"{list(scales.shape)} ({scales.dtype}) are not uint8 [..., groups, 16] and "
                             "[..., groups]; the checkpoint is damaged or not MXFP4.")
    return dequantize(blocks, scales).transpose(-1, -2)


class ExpertGroups:
    """An MXFP4 checkpoint's experts as gguf_quant.Groups, by the name of one expert's projection
    (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`; gate and up are the even and odd rows of the
    stored gate_up_proj): read from that expert's blocks and scales alone when asked for, the rest None.
    The last expert read is kept: its gate and up are asked for one after the other."""

    def __init__(self, files: Iterable[Path]):
        self._files = {name: reader for reader in map(SafetensorsFile, files) for name in reader.names()}
        self._last: tuple[Optional[tuple[str, int]], tuple[torch.Tensor, ...]] = (None, ())

    def __call__(self, name: str) -> Optional[Groups]:
        found = _EXPERT.fullmatch(name)
        stacked = found and f"{found[1]}.{'down' if found[3] == 'down' else 'gate_up'}_proj"
        if not found or f"{stacked}_blocks" not in self._files:
            return None
        key = (stacked, int(found[2]))
        if self._last[0] != key:
            self._last = key, tuple(self._files[stacked + part].get(stacked + part, key[1]) for part in _PARTS)
        blocks, scales = self._last[1]
        if found[3] != "down":
            rows = slice(found[3] == "up", None, 2)
            blocks, scales = blocks[rows], scales[rows]
        codes = torch.stack([blocks & 0x0F, blocks >> 4], -1).flatten(-3)     # byte j: values 2 j, 2 j + 1
        q, scale, low = e2m1(codes.numpy(), scales.numpy())
        return Groups(5, *map(torch.from_numpy, (q, scale, low)))

    def sources(self, provided: set[str]) -> set[str]:
        """`provided` (names given as groups) and the stacked tensors (by weight_name) that hold nothing
        else: those all of whose experts' projections it names."""
        covered = set(provided)
        for name in self._files:
            stacked = weight_name(name)
            if stacked == name or not name.endswith("_blocks"):
                continue
            parts = ("down",) if stacked.endswith("down_proj") else ("gate", "up")
            experts = range(self._files[name].header[name]["shape"][0])
            prefix = stacked.rsplit(".", 1)[0]
            if all(f"{prefix}.{e}.{p}_proj.weight" in provided for e in experts for p in parts):
                covered.add(stacked)
        return covered
