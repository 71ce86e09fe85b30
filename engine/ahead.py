"""A decode step built ahead (overlap scheduler): step N+1 is scheduled, its KV slots allocated and its
requests copied while step N's forward runs, before N's tokens reach the host; its forward is queued on
the forward thread right behind N's, so the thread goes from one forward to the next without waiting
for the scheduler. N's outputs are the "future" inputs of N+1, resolved on the forward thread when N+1
starts (N is done by then: the thread runs steps in order):

- each request's copy gets N's new tokens (its last one is N+1's root) and kv_len grows by N's
  committed count; the table entries of those tokens are written (the scheduler's commit of N writes
  the same values);
- a request that N's tokens finish (stop token, EOS, max_new_tokens, context length: the scheduler's
  own test, which needs no text for requests without stop strings) is dropped from N+1, and its drafter
  state released there, as the scheduler would have done before scheduling N+1.

The worker runs N+1 on the copies, so it never reads a request the scheduler is changing meanwhile.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import Future
from typing import Callable, Optional, Sequence

from engine.memory.kv_manager import write_table
from engine.request import Request
from engine.step import DecodeStep, StepResult
from engine.worker import Worker


def copies(reqs: Sequence[Request]) -> list[Request]:
    """The requests as the worker sees them in a step built ahead: shallow copies with a token list of
    their own, which _resolve extends."""
    out = []
    for req in reqs:
        view = copy.copy(req)
        view.token_ids = list(req.token_ids)
        out.append(view)
    return out


def forward_ahead(worker: Worker, table, prev: DecodeStep, prev_result: Future, step: DecodeStep,
                  views: list[Request], ends: Callable, started: threading.Event
                  ) -> tuple[DecodeStep, Optional[StepResult]]:
    """On the forward thread, after `prev`'s forward: resolve `step` (views[i] copies step.reqs[i]) from
    prev's result and run it. `ends(view, token)` is true where a token finishes a request. `started` is
    set once resolved: the scheduler applies prev only then, so that its Python work does not hold the
    GIL while this thread resolves. Returns the part of `step` that ran (its requests, not their copies)
    and its result (None where none ran). Raises prev's exception where prev failed, having run nothing."""
    try:
        keep = _resolve(worker, table, prev, prev_result.result(), step, views, ends)
    finally:
        started.set()
    ran = DecodeStep([step.reqs[b] for b in keep], step.slots[keep])
    return ran, worker.forward(DecodeStep([views[b] for b in keep], ran.slots)) if keep else None


def _resolve(worker: Worker, table, prev: DecodeStep, out, step: DecodeStep, views: list[Request],
             ends: Callable) -> list[int]:
    """Give the copies prev's outputs; return the indices of the requests that go on."""
    prev, result = out if isinstance(out, tuple) else (prev, out)      # prev was built ahead too, or not
    at = {id(req): i for i, req in enumerate(prev.reqs)}
    keep = []
    for b, (req, view) in enumerate(zip(step.reqs, views)):
        if _extend(view, result.tokens[at[id(req)]], ends):
            worker.release(view)
        else:
            keep.append(b)
    if keep:
        js = [at[id(step.reqs[b])] for b in keep]
        counts = [result.counts[j] for j in js]
        gone_on = [views[b] for b in keep]
        write_table(table, gone_on, counts, prev.slots[js][result.kept.to(prev.slots.device)[js]])
        for view, n in zip(gone_on, counts):
            view.kv_len += n
    return keep


def _extend(view: Request, tokens: Sequence[int], ends: Callable) -> bool:
    """Append tokens until one finishes the request; True when one did."""
    for tok in tokens:
        view.token_ids.append(tok)
        if ends(view, tok):
            return True
    return False
