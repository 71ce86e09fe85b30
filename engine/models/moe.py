"""Mixture-of-experts MLPs: a router picks each token's experts and their weights, the experts run on the
tokens that chose them (grouped by expert, so only the chosen experts' weights are read), and their
outputs are summed by those weights; a shared expert runs on every token where a family has one.
`Experts.grouped` is where the chosen experts compute, on their rows sorted by expert: with w4a8 layers
(a GGUF's quantized experts, on the CPU) each projection of all of them in one kernel call, otherwise
each expert's own MLP. On CUDA, float experts are stacked at load (`Experts.stack`) and run in
kernels/fused_moe.py's Triton grouped GEMMs instead.

Routers: `SoftmaxRouter` (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE: softmax over the experts, the top k,
renormalised where the family says so) and DeepSeek-V2's and V3's (deepseek.py), all
behind `MoE`.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.llama import MLP
from engine.models.quant import W4A8_LAYERS
from spec_kernels import cpu_elementwise, cpu_w4a8, fused_moe


class Stacked(NamedTuple):
    """A mixture's experts' weights stacked for kernels/fused_moe.py (Experts.stack)."""
    gate_up: torch.Tensor                   # [E, 2I, H]
    gate_up_bias: Optional[torch.Tensor]    # [E, 2I] or None
    down: torch.Tensor                      # [E, H, I]
    down_bias: Optional[torch.Tensor]       # [E, H] or None


class Experts(nn.ModuleList):
    """The experts' MLPs; `forward` sums, per token, its chosen experts' outputs by their weights."""
    expert = MLP        # a family whose experts compute otherwise (GPT-OSS's) brings its own

    def __init__(self, config, count: int, intermediate_size: int):
        super().__init__(self.expert(config, intermediate_size) for _ in range(count))
        self.stacked: Optional[Stacked] = None

    def stack(self) -> bool:
        """Lay the experts' gate/up and down weights out as two stacked tensors [E, 2I, H] and [E, H, I]
        (and their biases, where they have them: GPT-OSS's), each expert's own becoming views of them (no
        second copy), for kernels/fused_moe.py's Triton kernel: on CUDA it runs every chosen expert in two
        launches with no host synchronisation, so a step with experts can be captured in a CUDA graph.
        Only float experts (False otherwise: quantized layers)."""
        linears = [p for m in self for p in (m.gate_up_proj, m.down_proj)]
        if not fused_moe.available() or not all(type(p) is nn.Linear for p in linears) or \
                len({p.bias is None for p in linears}) > 1:
            return False
        stacked = []
        for proj, part in itertools.product(("gate_up_proj", "down_proj"), ("weight", "bias")):
            params = [getattr(getattr(m, proj), part) for m in self]
            if params[0] is None:
                stacked.append(None)
                continue
            with torch.no_grad():
                whole = torch.stack(params)
            for param, view in zip(params, whole):
                param.data = view
            stacked.append(whole)
        self.stacked = Stacked(*stacked)
        return True

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights and ids [T, top_k]: each token's experts and their weights. Stacked experts
        run in the Triton kernel. Otherwise the tokens' choices are sorted by expert, the experts run once
        each on their rows (`grouped`), and the outputs are added to their tokens in that order: per token
        by increasing expert, as transformers sums them."""
        if self.stacked is not None:
            gate_up, gate_up_bias, down, down_bias = self.stacked
            return fused_moe.fused_moe(x, gate_up, down, weights, ids, gate_up_bias, down_bias, self[0].act)
        order = ids.flatten().argsort(stable=True)          # stable: an expert's rows in token order
        counts = torch.bincount(ids.flatten(), minlength=len(self)).tolist()
        tokens = order // ids.shape[1]
        out = self.grouped(x[tokens], counts) * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, out.to(x.dtype))

    def grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [sum(counts), H], expert e's `counts[e]` of them after those of the experts before it ->
        each row through its expert's MLP. Only the chosen experts' weights are read; where they are w4a8
        layers (a GGUF's quantized experts as the file stores them, engine/models/quant.py), each
        projection of all of them in one kernel call (`_w4a8`)."""
        chosen = [self[e] for e, n in enumerate(counts) if n]
        sizes = [n for n in counts if n]
        if not torch.compiler.is_compiling() and all(
                isinstance(p, W4A8_LAYERS) for m in chosen for p in (m.gate_up_proj, m.down_proj)):
            return _w4a8(chosen, sizes, rows)
        ends = itertools.accumulate(sizes)
        return torch.cat([m(rows[end - n:end]) for m, n, end in zip(chosen, sizes, ends)])


def _w4a8(chosen: list[MLP], sizes: list[int], rows: torch.Tensor) -> torch.Tensor:
    """The chosen experts' MLPs on their runs of rows, as each expert's own forward computes them: its
    gate/up and down projections (biases included) one cpu_w4a8.grouped call each (every expert's layer
    on its rows), and the experts' activation between them on all rows at once."""
    first = chosen[0]
    gate_up = cpu_w4a8.grouped([m.gate_up_proj.c_layer() for m in chosen], sizes, rows,
                               first.gate_up_proj.out_features)
    if first.act is MLP.act and cpu_elementwise.usable(gate_up):
        act = cpu_elementwise.silu_mul(gate_up)
    else:
        act = first.act(*gate_up.split(first.inter, dim=-1))
    return cpu_w4a8.grouped([m.down_proj.c_layer() for m in chosen], sizes, act, first.down_proj.out_features)


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


def stack_experts(model: nn.Module) -> None:
    """Stack every mixture's float experts for the Triton kernel (Experts.stack): on CUDA, at load."""
    for module in model.modules():
        if isinstance(module, Experts):
            module.stack()
