"""What crosses between the scheduler and the worker in one step: the work, with its KV slots already
allocated by the scheduler, and the result, which only the scheduler applies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.core.request import Request


@dataclass
class PrefillStep:
    """Prompt pieces: reqs[i] feeds lens[i] tokens after its kv_len cached ones, into `slots` (flat,
    request after request). A piece that reaches the end of its prompt yields the first output token."""
    reqs: list[Request]
    lens: list[int]
    slots: torch.Tensor

    def completes(self, i: int) -> bool:
        req = self.reqs[i]
        return req.kv_len + self.lens[i] == req.seq_len

    def input_ids(self) -> list[int]:
        return [t for req, n in zip(self.reqs, self.lens) for t in req.token_ids[req.kv_len:req.kv_len + n]]


@dataclass
class DecodeStep:
    """One decode step of the running requests. slots[b]: the KV slots request b may use this step:
    one per tree node (the root's first; the drafter's nodes, then its prediction chain's), then the
    drafter's scratch. drafts[b]: the most draft tokens request b's tree may hold this step (0: none, and
    no drafting for it); None: the whole tree. chains[b]: Predicted Output tokens to verify after request
    b's newest token. catch_up: tokens a draft model that fell behind feeds first (drafter.lag).
    evidence[b]: what request b's draft size was chosen by (Drafter.evidence); None when not chosen."""
    reqs: list[Request]
    slots: torch.Tensor          # [B, slots per request]
    chains: Optional[list[list[int]]] = None
    drafts: Optional[list[int]] = None
    catch_up: int = 0
    evidence: Optional[list[Optional[int]]] = None

    @property
    def chain_slots(self) -> int:
        """Slot columns given to prediction chains (after the drafter's tree columns)."""
        return max(map(len, self.chains)) if self.chains else 0


@dataclass
class StepResult:
    tokens: list[list[int]]                  # new tokens per request (none for a piece of a prompt)
    counts: list[int]                        # tokens whose KV to commit, per request
    kept: Optional[torch.Tensor] = None      # decode: [B, S] bool on the host, the slots of those tokens in order
    drafts: Optional[list[int]] = None       # speculative decode: draft tokens accepted per request
    captured: Optional[list] = None          # per request, hidden states to keep (Request.captured)
    predicted: Optional[list[int]] = None    # per request, tokens of its prediction chain accepted
    rows: int = 0                            # decode: tokens the target's forward ran (tree nodes)
    proposed: Optional[list[int]] = None     # speculative decode: draft tokens the drafter proposed per request
    draft_seconds: float = 0.0               # time spent in the drafter
    # Per request asking for them (else None): per new token, (logprob, [(token id, logprob)] best first).
    logprobs: Optional[list] = None
