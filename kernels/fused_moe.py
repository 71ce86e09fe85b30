"""Mixture-of-experts MLPs in Triton: every (token, chosen expert) pair of a batch in two grouped GEMMs,
each program multiplying one block of pairs routed to one expert by that expert's weights, so a batch
reads each chosen expert's weights once and no expert it did not choose.

Layout:
- x [T, H]; ids, weights [T, K]: each token's K experts and their routing weights;
- w_gate_up [E, 2I, H] (each expert's gate rows, then its up rows), w_down [E, H, I]; biases, where the
  experts have them (GPT-OSS's), [E, 2I] and [E, H];
- `align_by_expert` sorts the T*K pairs by expert and pads each expert's run to a multiple of BLOCK_M,
  in tensors whose sizes depend on T, K and E only (no host synchronisation, so a CUDA graph can
  capture a step): pair p = t * K + k; padding entries hold T * K and are skipped.
The first GEMM gives each pair its expert's gate and up projections of its token (plus bias), the
experts' activation runs in torch (SiLU(gate) * up, or GPT-OSS's clamped one: `act`), the second GEMM
gives each pair its expert's down projection (plus bias) scaled by its routing weight, and a sum over
each token's K pairs gives the output. `fused_moe_reference` computes the same in plain torch
(expert by expert); tests compare the two (on CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:                         # optional: the CPU runs experts in torch
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _grouped_gemm_kernel(a, w, out, pairs, block_expert, pair_weights, bias, n_pairs, N, Kdim,
                             stride_am, stride_we, stride_wn, stride_om, stride_be, top_k: tl.constexpr,
                             A_PER_PAIR: tl.constexpr, SCALE: tl.constexpr, BIAS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[p, n-block] = a[row(p)] @ w[expert].T (plus bias[expert] when BIAS, then times pair p's
        weight when SCALE) for the pairs p of block program_id(0); row(p) is p's token (a = x) or p itself
        (a = the pairs' activations)."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(block_expert + pid_m)
        if expert >= 0:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(pairs + offs_m)
            valid = pair < n_pairs
            row = pair if A_PER_PAIR else pair // top_k
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, Kdim, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a_tile = tl.load(a + row[:, None] * stride_am + offs_k[None, :],
                                 mask=valid[:, None] & (offs_k[None, :] < Kdim), other=0.0)
                w_tile = tl.load(w + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
                                 mask=(offs_n[None, :] < N) & (offs_k[:, None] < Kdim), other=0.0)
                acc += tl.dot(a_tile, w_tile)
            if BIAS:
                acc += tl.load(bias + expert * stride_be + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            if SCALE:
                acc *= tl.load(pair_weights + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
            tl.store(out + pair[:, None] * stride_om + offs_n[None, :], acc.to(out.dtype.element_ty),
                     mask=valid[:, None] & (offs_n[None, :] < N))


def align_by_expert(ids: torch.Tensor, experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [P], block_expert [P / block_m]): the pairs t * K + k sorted by expert, each expert's run
    padded with T * K to a multiple of block_m, and each block's expert (-1 past the last run). P is
    the bound T * K + E * (block_m - 1), rounded up to a whole block."""
    flat = ids.reshape(-1)
    n = flat.numel()
    blocks = -(-(n + experts * (block_m - 1)) // block_m)
    # Not torch.bincount: on CUDA it reads the largest id back to the host, which a graph cannot capture.
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(n, device=ids.device) - (counts.cumsum(0) - counts)[by_expert]
    pairs = torch.full((blocks * block_m,), n, dtype=torch.int64, device=ids.device)
    pairs[(run_end - padded)[by_expert] + rank] = order
    starts = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(run_end, starts, right=True)
    block_expert = torch.where(block_expert < experts, block_expert, -1)
    return pairs, block_expert


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, block_expert: torch.Tensor, top_k: int,
                  n_pairs: int, a_per_pair: bool, bias: torch.Tensor | None, pair_weights: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    out = torch.empty((n_pairs, w.shape[1]), dtype=out_dtype or a.dtype, device=a.device)
    grid = (block_expert.numel(), triton.cdiv(w.shape[1], BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, w, out, pairs, block_expert, pair_weights if pair_weights is not None else out,
        bias if bias is not None else out, n_pairs, w.shape[1], w.shape[2], a.stride(0), w.stride(0), w.stride(1),
        out.stride(0), bias.stride(0) if bias is not None else 0, top_k=top_k, A_PER_PAIR=a_per_pair,
        SCALE=pair_weights is not None, BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation."""
    return F.silu(gate) * up


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
              act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_mul) -> torch.Tensor:
    """[T, H]: each token's chosen experts' MLPs (act(gate, up) between the projections) summed by their
    routing weights."""
    tokens, top_k = ids.shape
    n_pairs, inter = tokens * top_k, w_down.shape[2]
    pairs, block_expert = align_by_expert(ids, w_gate_up.shape[0])
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    gate_up = _grouped_gemm(x, w_gate_up, pairs, block_expert, top_k, n_pairs, a_per_pair=False, bias=b_gate_up)
    hidden = act(gate_up[:, :inter], gate_up[:, inter:]).contiguous()
    down = _grouped_gemm(hidden, w_down, pairs, block_expert, top_k, n_pairs, a_per_pair=True, bias=b_down,
                         pair_weights=weights.reshape(-1).contiguous(), out_dtype=torch.float32)
    return down.view(tokens, top_k, -1).sum(1).to(x.dtype)       # each token's K experts summed in float32


def fused_moe_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor, b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
                        act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_mul) -> torch.Tensor:
    """The same in torch, expert by expert, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w_down.shape[2]
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = x[rows].float() @ w_gate_up[e].float().T
        if b_gate_up is not None:
            gate_up = gate_up + b_gate_up[e].float()
        down = act(gate_up[:, :inter], gate_up[:, inter:]) @ w_down[e].float().T
        if b_down is not None:
            down = down + b_down[e].float()
        out.index_add_(0, rows, down * weights[rows, slot, None].float())
    return out.to(x.dtype)
