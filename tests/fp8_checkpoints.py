"""FP8 checkpoints for tests: a float model's decoder linears written in e4m3 with per-channel or
DeepSeek-style block scales, beside the dequantized float model such a checkpoint means."""

from __future__ import annotations

import json
import shutil

import torch

from engine.loader import iter_weights
from engine.loader.fp8_quant import quantize

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")       # and DeepSeek-V3's MLA


def blockwise(weight: torch.Tensor, block) -> list[tuple[slice, slice, tuple[int, int]]]:
    """(rows, columns, scale index) of every block of a weight, one row per block without `block`."""
    n, k = weight.shape
    rows, columns = block or (1, k)
    return [(slice(i, i + rows), slice(j, j + columns), (i // rows, j // columns))
            for i in range(0, n, rows) for j in range(0, k, columns)]


def dequantized_reference(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    out = torch.empty(q.shape)
    for rows, columns, at in blockwise(q, block):
        out[rows, columns] = q[rows, columns].float() * scale[at]
    return out


def save_fp8_checkpoint(src, dst, block, keep_float: tuple[str, ...] = ()):
    """`src`'s float model as an FP8 checkpoint in `dst` (its decoder linears in e4m3, per-channel
    `weight_scale` or DeepSeek's block `weight_scale_inv`, except names containing `keep_float`), and its
    dequantized float twin in `dst`_ref: the model an FP8 checkpoint means."""
    from safetensors.torch import save_file

    ref = dst.parent / f"{dst.name}_ref"
    shutil.copytree(src, dst)
    shutil.copytree(src, ref)
    stored, floats = {}, {}
    for name, w in iter_weights(src):
        if name.split(".")[-2] in LINEARS and not any(k in name for k in keep_float):
            q, scale = quantize(w, block)
            stored[name] = q
            stored[name + ("_scale_inv" if block else "_scale")] = scale
            floats[name] = dequantized_reference(q, scale, block)
        else:
            stored[name] = floats[name] = w
    for path in (dst, ref):
        for old in path.glob("*.safetensors"):
            old.unlink()
    save_file(stored, dst / "model.safetensors")
    save_file(floats, ref / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     **({"weight_block_size": list(block)} if block else {})}
    (dst / "config.json").write_text(json.dumps(config))
    return dst, ref
