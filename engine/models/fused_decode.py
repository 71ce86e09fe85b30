"""Decode steps of a w4a8 Llama-family model in bf16 on the CPU, one C call per layer
(kernels/cpu_decoder.c): the CPU's counterpart of a CUDA graph, which removes what surrounds each
kernel in an eager layer (~20 torch ops and 6 ctypes calls; about half of a SmolLM2-135M decode
step) and runs the same kernels on the same values, so the output is the eager forward's bit for bit.

It applies to forwards whose attention goes through kernels/cpu_attention.c (decode steps, tree
verification and one-token forwards: the torch backend's key lists), on models whose every layer is
Llama's attention (no q/k norm) and MLP with w4a8 weights, not sharded. Anything else runs layer by
layer as before.
"""

from __future__ import annotations

import weakref
from typing import Literal, Optional, Union

import torch
from torch import nn

from engine.attention.torch_backend import KeyLists
from engine.core.forward_batch import ForwardBatch
from engine.memory.kv_pool import KVPool
from spec_kernels import cpu_decoder


class FusedLayers:
    """A model's layers as C structs over one KV pool; `step` prepares a forward's shared part."""

    def __init__(self, model: nn.Module, kv_pool: KVPool):
        layers = model.model.layers
        attention = layers[0].self_attn
        self.kv_pool = kv_pool
        self.sizes = dict(hidden=model.config.hidden_size, inter=layers[0].mlp.inter, H=attention.num_heads,
                          Hkv=attention.num_kv_heads, D=attention.head_dim,
                          eps=layers[0].input_layernorm.eps, scale=attention.scale)
        self.structs, self.linears = [], []     # the linears' structs, which the layers' point to, kept alive
        for layer in layers:
            attention, mlp, i = layer.self_attn, layer.mlp, layer.self_attn.layer
            linears = [m.c_layer() for m in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            self.linears.append(linears)
            self.structs.append(cpu_decoder.layer(*linears, layer.input_layernorm.weight,
                                                  layer.post_attention_layernorm.weight, kv_pool.k[i], kv_pool.v[i]))

    def step(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch) -> cpu_decoder.Step:
        lists: KeyLists = batch.attn
        cos, sin = (t.contiguous() for t in rope)
        index, lens, starts, shared, slots = (t.contiguous() for t in (lists.slots, lists.lens, lists.starts,
                                                                       lists.shared, batch.out_slots))
        step = cpu_decoder.Step(T=h.shape[0], max_kv=index.shape[1], groups=len(shared),
                                threads=torch.get_num_threads(), **self.sizes)
        for name, t in (("cos", cos), ("sin", sin), ("kv_index", index), ("kv_len", lens), ("starts", starts),
                        ("shared", shared), ("out_slots", slots)):
            setattr(step, name, t.data_ptr())
        step._keep = (cos, sin, index, lens, starts, shared, slots)    # alive as long as the struct is
        return step


# Per model: its FusedLayers (over the pool it last ran with), or False where it cannot run fused.
_built: "weakref.WeakKeyDictionary[nn.Module, Union[FusedLayers, Literal[False]]]" = weakref.WeakKeyDictionary()


def plan(model: nn.Module, h: torch.Tensor, rope, batch: ForwardBatch, backend) -> Optional[tuple]:
    """(the model's FusedLayers, this forward's Step) when this forward can run fused, else None."""
    if (h.dtype != torch.bfloat16 or h.device.type != "cpu" or not isinstance(batch.attn, KeyLists)
            or backend.kv_pool.k[0].dtype != torch.bfloat16 or torch.compiler.is_compiling()):
        return None
    fused = _built.get(model)
    if fused is None or (fused is not False and fused.kv_pool is not backend.kv_pool):
        runnable = model.fusable_decode() and cpu_decoder.library() is not None
        fused = _built[model] = FusedLayers(model, backend.kv_pool) if runnable else False
    if fused is False:
        return None
    return fused, fused.step(h, rope, batch)


def run(fused: tuple, i: int, h: torch.Tensor) -> torch.Tensor:
    layers, step = fused
    return cpu_decoder.run(layers.structs[i], step, h.contiguous())

