"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): Llama's decoder with OpenAI's attention and experts.

Attention has biases on q, k, v and o, a learned sink logit per head (it joins each query's softmax,
taking a share of the probability but adding no value), a sliding window on the "sliding_attention"
layers (every other one) and yarn RoPE. Every layer's MLP is a mixture of experts: the router (with a
bias) keeps each token's top k logits and softmaxes over those k; an expert is a SwiGLU with biases
whose gate is clamped above and whose up projection is clamped both ways at `swiglu_limit`,
(up + 1) * gate * sigmoid(alpha * gate). transformers' modeling_gpt_oss.py is the reference.

Checkpoints stack each layer's experts in one tensor ([experts, in, out], gate and up columns
interleaved); they are cut into each expert's gate, up and down layers as they load, so moe.Experts
runs them and quantization, prepacking and tensor parallelism treat them as any family's. MXFP4
experts (the released checkpoints') come dequantized from the loader, or as 5-bit groups for the CPU's
quantized layers (engine/loader/mxfp4.py).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, LlamaModel
from engine.models.moe import Experts, MoE

# What the released configs say; transformers 4's configs do not name the sigmoid's gain.
SWIGLU_ALPHA = 1.702


class GptOssAttention(Attention):
    def __init__(self, config, layer: int):
        super().__init__(config, layer)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))


class TopKRouter(nn.Module):
    """Logits with a bias; each token's top k kept and softmaxed over those k alone."""

    def __init__(self, config):
        super().__init__()
        count = config.num_local_experts
        self.weight = nn.Parameter(torch.zeros(count, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(count))
        self.top_k = config.num_experts_per_tok

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k], expert ids [T, top_k]) per token."""
        top, ids = F.linear(x, self.weight, self.bias).topk(self.top_k, dim=-1)
        return top.softmax(-1, dtype=torch.float32).to(x.dtype), ids


class ClampedSwiGLU(MLP):
    """An expert: gate and up (fused, with biases) clamped at the limit, then (up + 1) * gate *
    sigmoid(alpha * gate) into the down projection."""

    def __init__(self, config, intermediate_size: int):
        super().__init__(config, intermediate_size, bias=True)
        self.alpha = getattr(config, "swiglu_alpha", None) or SWIGLU_ALPHA
        self.limit = config.swiglu_limit

    def forward(self, x):
        return self.down_proj(self.act(*self.gate_up_proj(x).split(self.inter, dim=-1)))

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssExperts(Experts):
    expert = ClampedSwiGLU


class GptOssLayer(DecoderLayer):
    def __init__(self, config, layer: int):
        experts = GptOssExperts(config, config.num_local_experts, config.intermediate_size)
        super().__init__(config, layer, GptOssAttention(config, layer), MoE(TopKRouter(config), experts))


class GptOssModel(LlamaModel):
    layer_class = GptOssLayer


_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")


def per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's stream with each stacked expert tensor cut into every expert's own layers, named
    as Llama's MLP parts (gate_proj, up_proj: fused again as they load; down_proj), weights [out, in];
    the router named as moe.MoE's."""
    for name, tensor in weights:
        stacked = _STACKED.match(name)
        if stacked is None:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        prefix, proj, bias = stacked.groups()
        leaf = "bias" if bias else "weight"
        for e, t in enumerate(tensor):
            t = t if bias else t.T      # stored [in, out]
            if proj == "down_proj":
                yield f"{prefix}.{e}.down_proj.{leaf}", t
            else:                       # gate and up interleaved: even outputs the gate's, odd the up's
                yield f"{prefix}.{e}.gate_proj.{leaf}", t[0::2]
                yield f"{prefix}.{e}.up_proj.{leaf}", t[1::2]
        del tensor


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel

    def load_weights(self, weights, sinks=None) -> None:
        super().load_weights(per_expert(weights), sinks)
