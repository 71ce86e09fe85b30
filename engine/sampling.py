"""Logit processing and sampling, shared by plain decoding and speculative verification.

A row is one position to sample from: its logits plus the request's parameters and the token history
its penalties count (prompt + output, plus a draft path when verifying). `target_probs` gives the exact
distribution a row samples from; `sample` draws from it by inverse CDF with a caller-given uniform,
so a request's randomness depends only on its seed and position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.sampling_params import SamplingParams


@dataclass
class Row:
    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]        # generated tokens before this position (a draft path included)
    eos_ids: Sequence[int] = ()      # masked while fewer than min_new_tokens are out


def adjust_logits(logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """Penalties and min_new_tokens, applied to fp32 logits [N, V] (a new tensor when anything changes)."""
    if not any(r.params.has_penalties or r.params.min_new_tokens for r in rows):
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            # transformers' rule over prompt and output: shrink positive logits, grow negative ones.
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and len(row.output_ids):
            # OpenAI's rule, over generated tokens only.
            counts = torch.bincount(torch.tensor(list(row.output_ids), dtype=torch.long), minlength=vocab)[:vocab]
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if len(row.output_ids) < p.min_new_tokens and not p.ignore_eos:
            for t in list(row.eos_ids) + list(p.stop_token_ids):
                if t < vocab:
                    logits[i, t] = float("-inf")
    return logits


def target_probs(logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """The distribution each row samples from [N, V]: greedy rows are one-hot at the argmax; others
    apply temperature, then top-k, top-p and min-p, then renormalise."""
    logits = adjust_logits(logits.float(), rows)
    probs = torch.empty_like(logits)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        idx = torch.tensor(greedy)
        probs[idx] = 0.0
        probs[idx, logits[idx].argmax(-1)] = 1.0
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        idx = torch.tensor(sampled)
        ps = [rows[i].params for i in sampled]
        temps = torch.tensor([p.temperature for p in ps], dtype=torch.float32)[:, None]
        probs[idx] = _truncate(torch.softmax(logits[idx] / temps, dim=-1), ps)
    return probs


def _truncate(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """top-k, top-p and min-p filtering (in that order, as SGLang), then renormalisation."""
    vocab = probs.shape[-1]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if all(k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p) and not any(min_p):
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    keep = ranks < torch.tensor(top_k)[:, None]
    sorted_probs = sorted_probs * keep
    # top-p over the untruncated distribution: a token goes once the mass ranked above it exceeds p.
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep &= mass_before <= torch.tensor(top_p)[:, None]
    keep &= sorted_probs >= torch.tensor(min_p)[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True
    sorted_probs = sorted_probs * keep
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return out / out.sum(-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, uniforms: Sequence[float]) -> torch.Tensor:
    """Inverse-CDF draw per row with the given uniforms in [0, 1). Zero-probability tokens never come out."""
    cdf = probs.double().cumsum(-1)
    u = torch.tensor(uniforms, dtype=torch.float64)[:, None] * cdf[:, -1:]
    ids = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    last_nonzero = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(ids, last_nonzero)


def sample(logits: torch.Tensor, rows: Sequence[Row], uniforms: Sequence[float]) -> torch.Tensor:
    """Next token per row [N]."""
    if all(r.params.greedy for r in rows):
        return adjust_logits(logits.float(), rows).argmax(-1)
    return sample_from_probs(target_probs(logits, rows), uniforms)
