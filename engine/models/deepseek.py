"""DeepSeek-V2/V3-family decoder (DeepSeek-V2/V2-Lite/V2.5, DeepSeek-V3/R1, Kimi-K2, Moonlight): multi-head
latent attention (MLA) and mixture-of-experts MLPs, over the same paged KV cache and attention backends as
the Llama family. V2 and V3 differ in their routers alone.

MLA (DeepSeek-V2 paper, sec. 2.1) compresses K/V into a small latent per token (kv_a_proj_with_mqa, then
kv_a_layernorm) plus one shared rotary key; kv_b_proj expands the latent into per-head keys (their
no-position part) and values. Here the expansion happens before the backend stores them, so the pool
holds ordinary per-head K/V ([slots, heads, head_dim]) and every backend runs MLA unchanged: the simple,
exact first step. Its cost is memory: per token and layer 2 x heads x head_dim values instead of the
latent's kv_lora_rank + qk_rope_head_dim. Caching the latent and absorbing kv_b_proj into the query and
output projections (SGLang's MLA kernels) is the optimisation not done here.

MoE: moe.MoE's grouped experts and the shared experts, routed by V3's grouped sigmoid top-k ("noaux_tc")
or V2's softmax top-k (`topk_method` "greedy" or "group_limited_greedy"), as transformers routes. Weights
keep the checkpoint's names (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight` ...); a nextn (MTP)
layer after the decoder layers is skipped here and drafts through engine/models/mtp.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.llama import MLP, DecoderLayer, LlamaForCausalLM, RMSNorm, Rotary, embedding, rotate
from engine.models.moe import Experts, MoE
from engine.models.rope import rope_parameters

# transformers' DeepSeek-V3 gives the latent norms their own eps, not rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


def uses_mla(config) -> bool:
    return getattr(config, "kv_lora_rank", None) is not None


def softmax_scale(config) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale squared when the context is extended with YaRN (DeepSeek's
    `mscale_all_dim`): its longer-context attention is that much sharper."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    factor, mscale_all_dim = params.get("factor", 1.0), params.get("mscale_all_dim", 0)
    if params["rope_type"] != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MlaAttention(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.layer = layer
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.lora = config.kv_lora_rank
        qk = self.nope + self.rope
        self.num_heads = self.num_kv_heads = heads
        # The pool keeps K and V at one head size: the narrower of the two is zero-padded, which changes
        # neither q.k nor the attention-weighted sum of V (its padding is dropped).
        self.head_dim = max(qk, self.v_dim)
        bias = bool(getattr(config, "attention_bias", False))
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.lora + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.lora, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.lora, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)
        # DeepSeek's checkpoints store the rotary dims as interleaved pairs (x0, x1), (x2, x3), ...
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        self.scale = softmax_scale(config)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x, rope, batch, backend):
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        q = self._query(x).view(T, H, self.nope + self.rope)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split((self.lora, self.rope), dim=-1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(latent)).view(T, H, -1).split((self.nope, self.v_dim), dim=-1)
        # Queries' rotary parts and the one shared rotary key, turned together.
        rot = torch.cat([q[..., self.nope:], k_rot[:, None]], dim=1)
        if self.interleaved:    # pairs -> halves, the layout rotate-half rotary turns the same way
            rot = torch.cat([rot[..., 0::2], rot[..., 1::2]], dim=-1)
        rot = rotate(rot, rope)
        q = torch.cat([q[..., :self.nope], rot[:, :H]], dim=-1)
        k = torch.cat([k_nope, rot[:, H:].expand(T, H, self.rope)], dim=-1)
        q, k, v = (F.pad(t, (0, D - t.shape[-1])) for t in (q, k, v))
        out = backend.forward(q, k, v, self.layer, batch, self.scale)[..., :self.v_dim]
        return self.o_proj(out.reshape(T, H * self.v_dim))


class _Fp32Router(nn.Module):
    """A router that scores in fp32 whatever the model's dtype, as DeepSeek and transformers route."""

    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.top_k, self.groups, self.top_groups = config.num_experts_per_tok, config.n_group, config.topk_group
        self.normalise, self.scaling = config.norm_topk_prob, config.routed_scaling_factor

    def _apply(self, fn, recurse=True):
        # Moves to other devices, never casts: model.to(dtype) leaves the router in fp32.
        def same_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(out.device)

        return super()._apply(same_dtype, recurse)


class V3Router(_Fp32Router):
    """DeepSeek-V3's routing: sigmoid scores; a learned bias steers which experts are chosen but not their
    weights; the experts come in n_group groups, each ranked by its two best biased scores, and only the
    topk_group best groups compete; the chosen experts' scores are normalised (norm_topk_prob) and scaled
    by routed_scaling_factor."""

    def __init__(self, config):
        super().__init__(config)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] fp32, expert ids [T, top_k]) per token."""
        scores = F.linear(x.float(), self.weight).sigmoid()
        biased = scores + self.e_score_correction_bias
        by_group = biased.view(x.shape[0], self.groups, -1)
        group_scores = by_group.topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(self.top_groups, dim=-1).indices, True)
        biased = by_group.masked_fill(~kept[:, :, None], float("-inf")).flatten(1)
        ids = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.normalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class V2Router(_Fp32Router):
    """DeepSeek-V2's routing: softmax scores; the top k of them ("greedy"), or of the topk_group groups
    with the best single scores ("group_limited_greedy"); the chosen scores scaled by
    routed_scaling_factor, normalised first where norm_topk_prob (DeepSeek's own code does; transformers
    does not, and no release sets it)."""

    def __init__(self, config):
        super().__init__(config)
        self.limited = config.topk_method == "group_limited_greedy"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] fp32, expert ids [T, top_k]) per token."""
        scores = F.linear(x.float(), self.weight).softmax(dim=-1)
        if self.limited:
            by_group = scores.view(x.shape[0], self.groups, -1)
            kept = torch.zeros(by_group.shape[:2], dtype=torch.bool, device=x.device)
            kept.scatter_(1, by_group.amax(-1).topk(self.top_groups, dim=-1).indices, True)
            scores = by_group.masked_fill(~kept[:, :, None], 0.0).flatten(1)
        weights, ids = scores.topk(self.top_k, dim=-1)
        if self.normalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


def decoder_layer(config, layer: int, moe: bool | None = None) -> DecoderLayer:
    """Layer `layer` with MLA; `moe`: a mixture-of-experts MLP (default: from layer first_k_dense_replace
    on, as the target's layers are laid out; an MTP layer says by its weights)."""
    moe = layer >= config.first_k_dense_replace if moe is None else moe
    return DecoderLayer(config, layer, MlaAttention(config, layer), _moe(config) if moe else MLP(config))


def _moe(config) -> MoE:
    size = config.moe_intermediate_size
    router = V2Router(config) if config.model_type == "deepseek_v2" else V3Router(config)
    return MoE(router, Experts(config, config.n_routed_experts, size),
               MLP(config, size * config.n_shared_experts))


class DeepseekV3Model(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        self.embed_tokens = embedding(config)
        self.layers = nn.ModuleList(decoder_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config, config.qk_rope_head_dim, max_positions)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """The Llama model's forward, head and loading over DeepSeek-V3's layers."""
    model_class = DeepseekV3Model
