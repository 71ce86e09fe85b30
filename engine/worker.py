"""Decode workers: what one decode step does for the running batch.

`PlainWorker` runs one forward and samples one token per request. Speculative workers (in
`engine/speculative/`) draft a tree, verify it in one forward and may return several tokens; the
scheduler treats both alike: it reserves `slots_per_request` KV slots per request beforehand and
appends whatever tokens come back.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.model_runner import ForwardItem, ForwardOutput, ModelRunner
from engine.request import Request
from engine.sampling import Row, sample


def sampling_row(req: Request, eos_ids: Sequence[int], extra_output: Sequence[int] = ()) -> Row:
    return Row(req.params, req.prompt_ids, list(req.output_ids) + list(extra_output), eos_ids)


class PlainWorker:
    slots_per_request = 1
    capture_hidden: tuple[int, ...] = ()

    def __init__(self, runner: ModelRunner, eos_ids: Sequence[int]):
        self.runner = runner
        self.eos_ids = list(eos_ids)

    def after_prefill(self, plan: Sequence[tuple[Request, int]], out: ForwardOutput) -> None:
        """After each prefill forward (every chunk), with how many tokens each request fed, in the order
        of `out.hidden`, and the sampled first token already appended where a prefill completed (such a
        request may have finished right there: workers skip finished requests). Speculative workers
        keep what their drafts need here (EAGLE: the target's hidden states)."""

    def release(self, req: Request) -> None:
        """The request left the running batch (finished or retracted)."""

    def sample_next(self, reqs: Sequence[Request], logits: torch.Tensor) -> list[int]:
        rows = [sampling_row(r, self.eos_ids) for r in reqs]
        uniforms = [r.uniform(len(r.output_ids)) for r in reqs]
        return sample(logits, rows, uniforms).tolist()

    def decode(self, reqs: Sequence[Request]) -> list[list[int]]:
        """One step for every request: new tokens per request. KV of the fed tokens is committed."""
        slots = self.runner.allocator.alloc(len(reqs))
        assert slots is not None, "the scheduler reserves decode slots before calling decode"
        items = [ForwardItem(r.row, r.kv_len, [r.all_ids[-1]]) for r in reqs]
        out = self.runner.forward(items, slots, torch.arange(len(reqs)), self.capture_hidden)
        for r in reqs:
            r.kv_len += 1
        return [[t] for t in self.sample_next(reqs, out.logits)]
