"""IBM Granite (3.x): Llama's decoder with four multipliers set by the config: the embedding's
(`embedding_multiplier`), each sublayer's output before its residual add (`residual_multiplier`), the
attention's softmax scale in place of 1/sqrt(head_dim) (`attention_multiplier`), and the logits'
divisor (`logits_scaling`)."""

from __future__ import annotations

import torch

from engine.distributed import group as tp
from engine.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, config, layer: int):
        super().__init__(config, layer)
        self.self_attn.scale = config.attention_multiplier
        self.residual_multiplier = config.residual_multiplier

    def forward(self, h, rope, batch, backend):
        m = self.residual_multiplier
        h = h + tp.all_reduce(self.self_attn(self.input_layernorm(h), rope, batch, backend), self.tp) * m
        return h + tp.all_reduce(self.mlp(self.post_attention_layernorm(h)), self.tp) * m


class GraniteModel(LlamaModel):
    layer_class = GraniteDecoderLayer


class GraniteForCausalLM(LlamaForCausalLM):
    model_class = GraniteModel

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling
