"""Mixture-of-experts MLPs: a router picks each token's experts and their weights, the experts run on the
tokens that chose them (grouped by expert, so only the chosen experts' weights are read), and their
outputs are summed by those weights; a shared expert runs on every token where a family has one.

Routers: `SoftmaxRouter` (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE: softmax over the experts, the top k,
renormalised where the family says so) and DeepSeek-V3's grouped sigmoid router (deepseek_v3.py), both
behind `MoE`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.llama import MLP


class Experts(nn.ModuleList):
    """The experts' MLPs; `forward` sums, per token, its chosen experts' outputs by their weights."""
    expert = MLP        # a family whose experts compute otherwise (GPT-OSS's) brings its own

    def __init__(self, config, count: int, intermediate_size: int):
        super().__init__(self.expert(config, intermediate_size) for _ in range(count))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights and ids [T, top_k]: each token's experts and their weights."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():      # the experts this batch chose, in order, as transformers sums them
            rows, slot = (ids == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, (self[e](x[rows]) * weights[rows, slot, None]).to(x.dtype))
        return out


class SoftmaxRouter(nn.Module):
    """Softmax over the experts' logits in float32, the top k kept (renormalised to sum to 1 where
    `normalise`), their weights in the model's dtype as transformers gives them."""

    def __init__(self, config, count: int, normalise: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(count, config.hidden_size))
        self.top_k, self.normalise = config.num_experts_per_tok, normalise

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k], expert ids [T, top_k]) per token."""
        probs = F.linear(x, self.weight).softmax(-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), ids


class MoE(nn.Module):
    """A router, its experts and, where a family has them, shared experts that every token runs: always
    added (DeepSeek), or scaled by a sigmoid gate of the token (Qwen2-MoE's shared_expert_gate)."""

    def __init__(self, gate: nn.Module, experts: Experts, shared: Optional[MLP] = None, shared_gate: bool = False):
        super().__init__()
        self.gate, self.experts, self.shared_experts = gate, experts, shared
        hidden = experts[0].gate_up_proj.in_features
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
