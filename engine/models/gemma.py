"""Gemma 2 and Gemma 3 (text) decoders: Llama's attention, MLP and layer with Gemma's parts.

Embedding scaled by sqrt(hidden_size) -> decoder layers -> final norm -> the tied head (Gemma 2: its
logits soft-capped). A layer norms each sublayer's input and its output before the residual (four
norms, all x * (1 + w) in float32); the MLP is GELU-tanh; attention scales by query_pre_attn_scalar,
soft-caps its logits where the config says (Gemma 2), norms q and k per head (Gemma 3) and, on
"sliding_attention" layers, sees only the last `sliding_window` tokens. Gemma 3 turns those local
layers with their own RoPE base and the "full_attention" ones with the global RoPE (its scaling
included); Gemma 2 has one RoPE. transformers' modular_gemma2.py / modular_gemma3.py are the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import group as tp
from engine.errors import ModelLoadError
from engine.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm, Rotary
from engine.models.rope import rope_parameters
from spec_kernels import cpu_elementwise

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(RMSNorm):
    """x * (1 + w): checkpoints store the weight centred on zero. Scaled in float32, then rounded; bf16 on
    the CPU in one C call (kernels/cpu_elementwise.c), where the torch ops cost a few microseconds each,
    six norms a layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == x.dtype and cpu_elementwise.usable(x):
            return cpu_elementwise.rms_norm(x, self.weight, self.eps, offset=True)
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def layer_types(config) -> list[str]:
    """Each layer's attention kind. Configs from transformers 4.x before `layer_types` say it by a
    pattern: every `sliding_window_pattern`-th layer is global (Gemma 2: every other one)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or 2
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.num_hidden_layers)]


class LayerTypeRotary(nn.Module):
    """A rotary table per layer type, shared by types whose RoPE is the same (Gemma 2's); forward gives
    every layer type its tokens' (cos, sin), gathered once per forward."""

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        params = {t: rope_parameters(config, t) for t in sorted(set(layer_types(config)))}
        self.table_of = {t: next(first for first in params if params[first] == p) for t, p in params.items()}
        self.tables = nn.ModuleDict({t: Rotary(config, head_dim, max_positions, t)
                                     for t in set(self.table_of.values())})

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        ropes = {name: table(positions, dtype) for name, table in self.tables.items()}
        return {layer_type: ropes[name] for layer_type, name in self.table_of.items()}


class GemmaAttention(Attention):
    """Llama's attention scaled by query_pre_attn_scalar, with Gemma 3's per-head q/k norms and the
    layer's window and logit soft-cap handed to the backend."""

    def __init__(self, config, layer: int):
        super().__init__(config, layer)
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.qk_norm = config.model_type.startswith("gemma3")
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.window = config.sliding_window if layer_types(config)[layer] == SLIDING else None
        self.softcap = getattr(config, "attn_logit_softcapping", None)


class GemmaMLP(MLP):
    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(DecoderLayer):
    """Llama's layer with each sublayer's output normed too: input, post-attention, pre-feedforward
    and post-feedforward norms. Reads its layer type's rotary."""

    def __init__(self, config, layer: int):
        super().__init__(config, layer, GemmaAttention(config, layer), GemmaMLP(config))
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.layer_type = layer_types(config)[layer]

    def forward(self, h, rope, batch, backend):
        attended = self.self_attn(self.input_layernorm(h), rope[self.layer_type], batch, backend)
        h = h + self.post_attention_layernorm(tp.all_reduce(attended, self.tp))
        return h + self.post_feedforward_layernorm(tp.all_reduce(self.mlp(self.pre_feedforward_layernorm(h)), self.tp))


class GemmaModel(LlamaModel):
    layer_class, norm_class, rotary_class = GemmaDecoderLayer, GemmaRMSNorm, LayerTypeRotary


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and Gemma 3 text: Llama's model with Gemma's layers, a scaled embedding and a soft-capped head."""
    model_class = GemmaModel

    def __init__(self, config, max_positions: int):
        check(config)
        super().__init__(config, max_positions)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super().embed(input_ids)
        # sqrt(hidden_size) rounded to the model's dtype first, as transformers scales it.
        return h * torch.tensor(self.config.hidden_size ** 0.5).to(h.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap


def check(config) -> None:
    """Refuse, by name, the configs of this shape that the parts above do not compute."""
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(f"Gemma with hidden_activation {activation!r} is not supported: spec runs GELU-tanh "
                             "(gelu_pytorch_tanh), which every released Gemma 2 and 3 uses.")
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelLoadError("Gemma with use_bidirectional_attention (an embedding model such as EmbeddingGemma) "
                             "is not a causal language model; spec serves causal Gemma 2 and 3 text models.")
