"""Mixture-of-experts families on Llama's decoder: Qwen2-MoE (a gated shared expert), Qwen3-MoE, Mixtral
and OLMoE (q/k norms over the whole projections). Each layer's MLP is dense or an MoE (moe.py) as the
config lays them out; checkpoint names are mapped onto this engine's modules as they load."""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

from engine.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm
from engine.models.moe import Experts, MoE, SoftmaxRouter


def _sparse(config, layer: int) -> bool:
    """Whether a layer's MLP is an MoE: Qwen's `decoder_sparse_step` and `mlp_only_layers`, else every layer."""
    if layer in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return (layer + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0


def _mlp(config, layer: int):
    if not _sparse(config, layer):
        return MLP(config)
    count = getattr(config, "num_experts", None) or config.num_local_experts
    size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    # Mixtral always renormalises its top k; the others say so in norm_topk_prob.
    normalise = config.model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))
    shared = getattr(config, "shared_expert_intermediate_size", None)
    return MoE(SoftmaxRouter(config, count, normalise), Experts(config, count, size),
               MLP(config, shared) if shared else None, shared_gate=bool(shared))


class OlmoeAttention(Attention):
    """OLMoE normalises q and k over all their heads at once, then clips q, k and v (`clip_qkv`)."""

    def __init__(self, config, layer: int):
        super().__init__(config, layer)
        q, kv, _ = self.split
        self.q_norm, self.k_norm = RMSNorm(q, config.rms_norm_eps), RMSNorm(kv, config.rms_norm_eps)
        self.clip = getattr(config, "clip_qkv", None)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        return torch.cat([q.view(T, H, D), k.view(T, Hkv, D)], dim=1), v.reshape(T, Hkv, D)


class MixtureLayer(DecoderLayer):
    def __init__(self, config, layer: int):
        attention = OlmoeAttention(config, layer) if config.model_type == "olmoe" else None
        super().__init__(config, layer, attention, _mlp(config, layer))


class MixtureModel(LlamaModel):
    layer_class = MixtureLayer


# Checkpoint names -> this engine's: Mixtral's block_sparse_moe and w1/w3/w2, Qwen2-MoE's shared_expert.
_RENAMES = [(re.compile(r"\.block_sparse_moe\."), ".mlp."), (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
            (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."), (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."),
            (re.compile(r"\.mlp\.shared_expert\."), ".mlp.shared_experts.")]


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for pattern, to in _RENAMES:
            name = pattern.sub(to, name)
        yield name, tensor


class MixtureForCausalLM(LlamaForCausalLM):
    model_class = MixtureModel

    def load_weights(self, weights, sinks=None) -> None:
        super().load_weights(_renamed(weights), sinks)
