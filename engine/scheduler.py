"""Scheduler: decides each step's work, and alone changes requests and KV bookkeeping.

A step is either a prefill (new or resumed requests, longest cached prefix first, long prompts split
into chunks) or a decode of every running request. The scheduler allocates the step's KV slots
through the KV manager, calls the worker once, and applies its StepResult: appends the tokens (cutting
an accepted run where a stop fires), commits the accepted tokens' slots and frees the rest. When decode
runs out of KV slots the cache is evicted first, then requests are retracted: their KV goes to the
radix cache (or is freed) and they wait to resume, recomputing only what was evicted meanwhile. No
request is dropped: one that cannot fit even alone is finished with an "abort" reason that says what
to raise.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Optional, Sequence

from engine.config import ServerArgs
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import DistributedError
from engine.memory.kv_manager import KVManager
from engine.request import FinishReason, Request, Status
from engine.speculative.stats import SpecStats
from engine.step import DecodeStep, PrefillStep, StepResult
from engine.worker import Worker

log = logging.getLogger(__name__)

# Tokens of growth kept in reserve per running request when admitting new ones, so that fresh
# admissions do not force retractions on the very next steps.
_RESERVE_TOKENS = 8
# Under the lpm policy a waiting request that later arrivals have overtaken this often goes first: a
# request sharing no cached prefix cannot be starved by a stream of ones that do.
_MAX_OVERTAKEN = 16


class Scheduler:
    def __init__(self, args: ServerArgs, kv: KVManager, worker: Worker, tokenizer, eos_ids: Sequence[int],
                 context_len: int, max_running: int, device: str):
        self.args = args
        self.kv = kv
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.context_len = context_len
        self.prefill_budget = args.prefill_chunk(device)
        self.chunking = args.chunked_prefill_size != 0
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilling: Optional[Request] = None   # a request part-way through a chunked prefill
        self.stats = {"retractions": 0, "cached_tokens": 0, "prefill_tokens": 0, "decode_steps": 0}
        self._finished_now: list[Request] = []
        self.set_worker(worker, args)

    def set_worker(self, worker: Worker, args: ServerArgs) -> None:
        """Decode with another worker (another speculative configuration), between requests only: the
        radix cache is emptied, since its entries hold no KV of a draft that was not running."""
        assert not self.has_work, "workers change between requests only"
        self.kv.flush()
        self.worker, self.args = worker, args
        self.spec_stats = SpecStats(args.speculative_num_steps) if worker.drafter else None

    # ------------------------------------------------------------------ requests in and out
    def add(self, req: Request) -> None:
        req.detok = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens,
                                           req.params.spaces_between_special_tokens, start=req.prompt_len)
        if req.params.max_new_tokens == 0:
            self._finish(req, FinishReason("length"))
            return
        if req.seq_len + 1 > self.kv.capacity:
            self._abort_oom(req)
            return
        self.waiting.append(req)

    def _abort_oom(self, req: Request) -> None:
        message = self.kv.budget.request_too_large(self._full_length(req), self.worker.slots_per_request)
        self._finish(req, FinishReason("abort", status_code=503, message=message))

    def _full_length(self, req: Request) -> int:
        """The tokens a request holds when done (for out-of-memory advice)."""
        return min(req.seq_len + req.remaining_tokens(), self.context_len)

    def abort(self, rid: str, message: str = "aborted by the client", status_code: Optional[int] = None
              ) -> Optional[Request]:
        for req in list(self.waiting) + self.running + ([self.prefilling] if self.prefilling else []):
            if req.rid == rid:
                self._finish(req, FinishReason("abort", message=message, status_code=status_code))
                return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def step(self) -> list[Request]:
        """Run one forward's worth of work; return the requests that got tokens or finished (including
        those finished between steps: aborted, or refused at admission)."""
        scheduled = self._schedule_prefill()
        if scheduled:
            touched = self._run_prefill(scheduled)
        elif self.running:
            touched = self._run_decode()
        else:
            touched = []
        seen = {id(r) for r in touched}
        out = touched + [r for r in self._finished_now if id(r) not in seen]
        self._finished_now = []
        return out

    # ------------------------------------------------------------------ memory
    def _reserve(self, reqs: Sequence[Request]) -> int:
        # One step's transient slots (a draft tree) plus a few tokens of growth per request.
        return sum(self.worker.slots_per_request + min(r.remaining_tokens(), _RESERVE_TOKENS) for r in reqs)

    def _release_kv(self, req: Request) -> None:
        self.worker.release(req)        # first: a drafter may clear state kept by the request's table row
        self.kv.release(req)

    # ------------------------------------------------------------------ prefill
    def _schedule_prefill(self) -> list[tuple[Request, int]]:
        budget = self.prefill_budget
        plan: list[tuple[Request, int]] = []
        if self.prefilling is not None:
            req = self.prefilling
            n = min(req.seq_len - req.kv_len, budget)
            if self.kv.available() < n:
                if not self.running:
                    self._abort_oom(req)     # it holds all there is and still does not fit
                return []
            plan.append((req, n))
            budget -= n
            if req.kv_len + n < req.seq_len:
                return plan
            self.prefilling = None
        admitted = list(self.running)
        for req in self._waiting_in_order():
            if budget <= 0 or len(admitted) >= self.max_running or self.kv.rows_available() == 0:
                break
            prefix, node = self.kv.match(req)
            self.kv.lock(node)
            extend = req.seq_len - len(prefix)
            n = min(extend, budget)
            if n < extend and not self.chunking:
                n = extend                                   # no chunking: the whole prompt or nothing
            # With nothing else running, admit without a reserve, so that work always progresses.
            need = n + self._reserve(admitted + [req]) if (plan or self.running) else n
            if self.kv.available() < need + sum(k for _, k in plan):
                self.kv.unlock(node)
                break
            self.waiting.remove(req)
            self.kv.admit(req, prefix, node)
            self.stats["cached_tokens"] += len(prefix)
            if not req.num_output:
                req.cached_tokens = len(prefix)
            req.status = Status.RUNNING
            plan.append((req, n))
            admitted.append(req)
            budget -= n
            if n < extend:
                self.prefilling = req
                break
        latest = max((r.arrival for r, _ in plan), default=None)
        for req in self.waiting:
            req.overtaken += latest is not None and req.arrival < latest
        return plan

    def _waiting_in_order(self) -> list[Request]:
        reqs = list(self.waiting)
        if self.kv.radix and self.args.schedule_policy == "lpm" and len(reqs) > 1:
            # Overtaken too often first, then longest cached prefix; stable, so arrival order breaks
            # ties. Matching refreshes LRU times, which is fine: these prefixes are about to be used.
            reqs.sort(key=lambda r: (r.overtaken < _MAX_OVERTAKEN, -len(self.kv.match(r)[0])))
        return reqs

    def _run_prefill(self, plan: list[tuple[Request, int]]) -> list[Request]:
        return self._isolating(plan, self._prefill)

    def _prefill(self, plan: list[tuple[Request, int]]) -> list[Request]:
        reqs, lens = [r for r, _ in plan], [n for _, n in plan]
        step = PrefillStep(reqs, lens, self.kv.alloc(sum(lens)))
        done = [r for i, r in enumerate(reqs) if step.completes(i)]
        result = self._forward(step)
        self.kv.commit(reqs, lens, step.slots)
        self.stats["prefill_tokens"] += sum(lens)
        self._keep_captured(reqs, result)
        for req, tokens, logprobs in zip(reqs, result.tokens, result.logprobs or [None] * len(reqs)):
            if tokens and not self._append(req, tokens, logprobs):
                self.running.append(req)
        return done

    # ------------------------------------------------------------------ decode
    def _run_decode(self) -> list[Request]:
        per_req = self.worker.slots_per_request
        if len(self.running) > 1 and self.kv.available() < per_req * len(self.running):
            wanting = (self.running + list(self.waiting))[:self.max_running]
            self.kv.budget.retracting(len(self.running), per_req, self.kv.available(),
                                      [self._full_length(r) for r in wanting])
        while self.kv.available() < per_req * len(self.running):
            if self.prefilling is not None:
                self._retract(self.prefilling)          # a half-prefilled prompt loses least
            elif len(self.running) == 1:
                self._abort_oom(self.running[0])
                return []
            else:
                self._retract(self._victim())
        return self._isolating(list(self.running), self._decode)

    def _decode(self, reqs: list[Request]) -> list[Request]:
        per_req = self.worker.slots_per_request
        step = DecodeStep(reqs, self.kv.alloc(per_req * len(reqs)).view(len(reqs), per_req))
        self._apply_decode(step, self._forward(step))
        return reqs

    def _forward(self, step) -> StepResult:
        try:
            return self.worker.forward(step)
        except Exception:
            self.kv.free(step.slots.flatten())      # nothing of the step was committed
            raise

    def _isolating(self, items: list, run) -> list[Request]:
        """run(items) -> the requests it touched. When a step fails, its requests run one by one: the
        one that fails alone ends with an error (500) and the others go on as if nothing happened."""
        try:
            return run(items)
        except DistributedError:
            raise                               # no request is to blame: the engine cannot go on
        except Exception as exc:
            if len(items) > 1:
                log.warning("a step of %d requests failed (%s); running them one by one", len(items), exc)
                return [req for item in items for req in self._isolating([item], run)]
            req = items[0][0] if isinstance(items[0], tuple) else items[0]
            log.exception("request %s failed; ending it", req.rid)
            self._fail(req, exc)
            return [req]

    def _fail(self, req: Request, exc: Exception) -> None:
        self._finish(req, FinishReason("abort", status_code=500, message=(
            f"internal error while generating ({type(exc).__name__}); see the server log")))

    def _apply_decode(self, step: DecodeStep, result: StepResult) -> None:
        slots, kept = step.slots, result.kept.to(step.slots.device)
        self.kv.commit(step.reqs, result.counts, slots[kept])
        self.kv.free(slots[~kept])          # rollback: rejected nodes and draft scratch
        self.stats["decode_steps"] += 1
        if result.drafts is not None:
            for req, drafts in zip(step.reqs, result.drafts):
                req.spec_verify_ct += 1
                req.spec_accepted_tokens += drafts
                self.spec_stats.record(drafts)
        self._keep_captured(step.reqs, result)
        for req, tokens, logprobs in zip(step.reqs, result.tokens, result.logprobs or [None] * len(step.reqs)):
            self._append(req, tokens, logprobs)     # a request that finishes leaves self.running

    def _keep_captured(self, reqs: Sequence[Request], result: StepResult) -> None:
        if result.captured is not None:
            for req, states in zip(reqs, result.captured):
                req.captured.append(states)

    def _victim(self) -> Request:
        # The request that has generated least loses least work (SGLang's choice too).
        return min(self.running, key=lambda r: (r.num_output, -r.prompt_len))

    def _retract(self, req: Request) -> None:
        if req is self.prefilling:
            self.prefilling = None
        else:
            self.running.remove(req)
        self._release_kv(req)
        req.status = Status.WAITING
        req.retractions += 1
        self.stats["retractions"] += 1
        self.waiting.appendleft(req)
        log.debug("retracted %s after %d tokens (KV full)", req.rid, req.num_output)

    # ------------------------------------------------------------------ output and stopping
    def _append(self, req: Request, tokens: Sequence[int], logprobs: Optional[Sequence] = None) -> bool:
        """Append tokens one at a time (with their logprobs, advancing the grammar) until one finishes
        the request; True when it finished. A failure here (detokenizing, say) ends this request alone."""
        try:
            for i, tok in enumerate(tokens):
                req.token_ids.append(tok)
                if logprobs is not None:
                    req.output_logprobs.append(logprobs[i])
                if req.first_token_time is None:
                    req.first_token_time = time.perf_counter()
                req.text += req.detok.step(req.token_ids)
                if req.grammar is not None and not req.grammar.accept_token(tok):
                    # Masks allow only what the grammar accepts: this is a bug, not the client's doing.
                    raise RuntimeError(f"the grammar refused committed token {tok}")
                reason = self._stop_reason(req, tok)
                if reason is not None:
                    self._finish(req, reason)
                    return True
        except Exception as exc:
            log.exception("request %s failed after its step; ending it", req.rid)
            self._fail(req, exc)
            return True
        return False

    def _stop_reason(self, req: Request, tok: int) -> Optional[FinishReason]:
        p = req.params
        if tok in p.stop_token_ids:
            return FinishReason("stop", matched=tok)
        if tok in self.eos_ids and not p.ignore_eos:
            return FinishReason("stop", matched=tok)
        if p.stop:
            # Only the tail can hold a new match: search from where the longest stop string could start.
            start = max(0, req.checked_text_len - max(len(s) for s in p.stop) + 1)
            req.checked_text_len = len(req.text)
            hits = [(req.text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                req.stop_text_cut = i + len(s) if p.no_stop_trim else i
                return FinishReason("stop", matched=s)
        if req.num_output >= p.max_new_tokens or req.seq_len >= self.context_len:
            return FinishReason("length")
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.prefilling is req:
            self.prefilling = None
        self._release_kv(req)
        try:
            req.text += req.detok.step(req.token_ids, final=True)
        except Exception:                   # a detokenizer that failed once: keep the text so far
            log.exception("request %s: the last text could not be decoded", req.rid)
        if req.stop_text_cut is not None:
            req.text = req.text[:req.stop_text_cut]
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self._finished_now.append(req)
