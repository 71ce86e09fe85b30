"""A decoder layer of a decode step in one C call: kernels/cpu_decoder.c, linked with the kernels it
calls (w4a8 linears, bf16 elementwise steps, paged attention) into one library built once per machine
(kernels/native.py) and called through ctypes. engine/models/fused_decode.py decides when it applies."""

from __future__ import annotations

import ctypes

import torch

from spec_kernels import cpu_w4a8
from spec_kernels.native import Kernel

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Layer(ctypes.Structure):
    """struct spec_decoder_layer: a layer's linears (cpu_w4a8.Layer structs), norm weights and KV pools."""
    _fields_ = [("qkv", _P), ("o", _P), ("gate_up", _P), ("down", _P), ("input_norm", _P), ("post_norm", _P),
                ("k_pool", _P), ("v_pool", _P)]


class Step(ctypes.Structure):
    """struct spec_decoder_step: the model's sizes and one forward's tokens, shared by its layers."""
    _fields_ = [("T", _I64), ("hidden", _I64), ("inter", _I64), ("H", _I64), ("Hkv", _I64), ("D", _I64),
                ("eps", _F), ("scale", _F), ("cos", _P), ("sin", _P), ("out_slots", _P), ("kv_index", _P),
                ("kv_len", _P), ("starts", _P), ("shared", _P), ("max_kv", _I64), ("groups", _I64),
                ("threads", _I64)]


def _declare(library: ctypes.CDLL) -> None:
    library.spec_decoder_layer.argtypes = [_P, _P, _P, _P]
    library.spec_decoder_layer.restype = ctypes.c_int


_kernel = Kernel("cpu_decoder.c", _declare,
                 "the one-call CPU decoder layer is unavailable (%s): decode steps run the layer's kernels one "
                 "call at a time (slower on small models)",
                 others=("cpu_w4a8.c", "cpu_attention.c", "cpu_elementwise.c"))
library, failure = _kernel.library, _kernel.failure


def layer(qkv: cpu_w4a8.Layer, o: cpu_w4a8.Layer, gate_up: cpu_w4a8.Layer, down: cpu_w4a8.Layer,
          input_norm: torch.Tensor, post_norm: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> Layer:
    """The C struct of a layer: it points into the structs and tensors, which must outlive it unchanged."""
    pointers = [ctypes.addressof(s) for s in (qkv, o, gate_up, down)]
    return Layer(*pointers, *(t.data_ptr() for t in (input_norm, post_norm, k_pool, v_pool)))


def run(layer: Layer, step: Step, h: torch.Tensor) -> torch.Tensor:
    """h [T, hidden] bf16 (contiguous) -> the layer's output [T, hidden]."""
    out = torch.empty_like(h)
    rc = library().spec_decoder_layer(ctypes.byref(layer), ctypes.byref(step), h.data_ptr(), out.data_ptr())
    if rc != 0:
        raise RuntimeError("cpu_decoder: out of memory" if rc == -1 else "cpu_decoder: unsupported shape")
    return out
