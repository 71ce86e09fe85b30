"""Scheduler: decides each step's work, and alone changes requests and KV bookkeeping.

A step is either a prefill (new or resumed requests, longest cached prefix first, long prompts split
into chunks) or a decode of every running request. The scheduler allocates the step's KV slots
through the KV manager, calls the worker once, and applies its StepResult: appends the tokens (cutting
an accepted run where a stop fires), commits the accepted tokens' slots and frees the rest. When decode
runs out of KV slots the cache is evicted first, then requests are retracted: their KV goes to the
radix cache (or is freed) and they wait to resume, recomputing only what was evicted meanwhile. No
request is dropped: one that cannot fit even alone is finished with an "abort" reason that says what
to raise.

Data flows one way: schedule() builds a step from the requests, the worker runs it and returns a
StepResult, apply(step, result) changes the requests; the worker never calls back. step() is that loop,
one step at a time. What a decode step drafts is the planner's choice (speculative/planner.py): the
scheduler asks it for the step's drafts and tells it what the step did.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Iterator, Optional, Sequence, Union

import torch

from engine.config import ServerArgs
from engine.core.detokenizer import IncrementalDetokenizer
from engine.errors import DistributedError
from engine.memory.kv_manager import KVManager
from engine.core.request import FinishReason, Request, Status
from engine.speculative.planner import PlannerFactory
from engine.speculative.stats import SpecStats
from engine.core.step import DecodeStep, PrefillStep, StepResult
from engine.core.worker import Worker

log = logging.getLogger(__name__)

# Tokens of growth kept in reserve per running request when admitting new ones, so that fresh
# admissions do not force retractions on the very next steps.
_RESERVE_TOKENS = 8
# Under the lpm policy a waiting request that later arrivals have overtaken this often goes first: a
# request sharing no cached prefix cannot be starved by a stream of ones that do.
_MAX_OVERTAKEN = 16
# Prompts prefilled in pieces at the same time: a shorter long prompt need not wait for a longer one.
_MAX_PARTIAL = 4

Step = Union[PrefillStep, DecodeStep]


class Scheduler:
    def __init__(self, args: ServerArgs, kv: KVManager, worker: Worker, tokenizer, eos_ids: Sequence[int],
                 context_len: int, max_running: int, device: str, planners: PlannerFactory):
        self.args, self.kv, self.tokenizer = args, kv, tokenizer
        self.eos_ids, self.context_len = set(eos_ids), context_len
        self.prefill_budget = args.prefill_chunk(device)
        self.chunking = args.chunked_prefill_size != 0
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilling: list[Request] = []         # requests part-way through a chunked prefill, oldest first
        self._prefilled_last = False
        # decode_rows: tokens the target's decode forwards ran (a request's root and draft tokens each).
        self.stats = {"retractions": 0, "cached_tokens": 0, "prefill_tokens": 0, "decode_steps": 0, "decode_rows": 0}
        self._planners = planners
        self._finished_now: list[Request] = []
        self.set_worker(worker, args)

    def set_worker(self, worker: Worker, args: ServerArgs) -> None:
        """Decode with another worker (another speculative configuration), between requests only: the
        radix cache is emptied, since its entries hold no KV of a draft that was not running, and a new
        planner decides what the worker drafts (speculative/planner.py)."""
        assert not self.has_work, "workers change between requests only"
        self.kv.flush()
        self.worker, self.args = worker, args
        self.spec_stats = SpecStats(args.speculative_num_steps) if worker.drafter else None
        self.planner = self._planners(worker, args, self.kv)

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

    @property
    def requests(self) -> list[Request]:
        """Every request not finished: waiting, running, or part-way through its prompt."""
        return list(self.waiting) + self.running + self.prefilling

    def abort(self, rid: str, message: str = "aborted by the client", status_code: Optional[int] = None
              ) -> Optional[Request]:
        for req in self.requests:
            if req.rid == rid:
                self._finish(req, FinishReason("abort", message=message, status_code=status_code))
                return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def step(self) -> list[Request]:
        """Schedule one step, run its forward and apply the result; return the requests that got tokens
        or finished (including those finished between steps: aborted, or refused at admission)."""
        step = self.schedule()
        touched = self._run(step) if step is not None else []
        self._decode_text(touched)
        seen = {id(r) for r in touched}
        out = touched + [r for r in self._finished_now if id(r) not in seen]
        self._finished_now = []
        return out

    # ------------------------------------------------------------------ memory
    def _reserve(self, reqs: Sequence[Request]) -> int:
        # One step's transient slots (a draft tree) plus a few tokens of growth per request.
        return sum(self.worker.slots_per_request + min(r.remaining_tokens(), _RESERVE_TOKENS) for r in reqs)

    def _release_kv(self, req: Request) -> None:
        if req.row is None:
            return
        self.worker.release(req)    # first: a drafter may clear state kept by the request's table row
        self.kv.release(req)
        req.row, req.kv_len, req.prefix_len, req.radix_node = None, 0, 0, None

    def _commit(self, reqs: Sequence[Request], counts: Sequence[int], slots: torch.Tensor) -> None:
        """Commit counts[i] tokens of reqs[i], their KV at the next counts[i] of `slots`."""
        self.kv.commit(reqs, counts, slots)
        for req, k in zip(reqs, counts):
            req.kv_len += k

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> Optional[Step]:
        """This step's work, its KV slots allocated: a prefill of prompt pieces, or a decode of every
        running request; None when there is nothing to run."""
        # Running streams decode between any two prefill steps: a burst of prompts or a long one in
        # pieces delays their next token by one prefill step, never more.
        plan = [] if self._prefilled_last and self.running else self._schedule_prefill()
        self._prefilled_last = bool(plan)
        if plan:
            return self._prefill_step(plan)
        if self.running and self._make_room():
            return self._decode_step(list(self.running))
        return None

    def apply(self, step: Step, result: StepResult) -> list[Request]:
        """Apply a step's result: commit KV, append tokens, finish requests; return those it touched."""
        if isinstance(step, PrefillStep):
            return self._apply_prefill(step, result)
        return self._apply_decode(step, result)

    # ------------------------------------------------------------------ prefill
    def _schedule_prefill(self) -> list[tuple[Request, int]]:
        """This step's prompt pieces: waiting prompts first, whole where they fit, else as one more
        prompt prefilled in pieces (at most _MAX_PARTIAL at a time); then the next pieces of those
        prompts, shortest remaining first. The oldest of them keeps an equal part of every step (at most a
        quarter), so that shorter prompts cannot stall it. A short prompt never waits for a long one to finish."""
        partial = self.prefilling
        if partial and self.kv.available() < min(_remaining(partial[0]), self.prefill_budget):
            if self.running:
                return []                   # decode steps free KV (by finishing or retracting)
            if len(partial) == 1:
                self._abort_oom(partial[0])     # it holds all there is and still does not fit
                return []
            self._retract(partial[-1])
        self._yield_share()
        oldest = partial[0] if partial else None
        # The oldest's floor: an equal part of the step among the client requests wanting prefill, at
        # most a quarter, so that one long prompt takes no more than its client's part while others wait.
        wanting = len({r.group for r in partial} | {r.group for r in self.waiting})
        floor = min(_remaining(oldest), max(1, self.prefill_budget // max(4, wanting))) if oldest else 0
        budget = self.prefill_budget - floor
        plan: list[tuple[Request, int]] = []
        admitted = self.running + partial
        held = Counter(r.group for r in admitted)
        share = self._share()
        for req in self._waiting_in_order(held):
            if budget <= 0 or len(admitted) >= self.max_running or self.kv.rows_available() == 0:
                break
            if held[req.group] >= share:
                continue                    # its client request has its share while others wait
            prefix, node = self.kv.match(req)
            extend = req.seq_len - len(prefix)
            n = min(extend, budget)
            if n < extend and not self.chunking:
                n = extend                  # no chunking: the whole prompt or nothing
            if n < extend and len(partial) >= _MAX_PARTIAL:
                continue                    # it goes in pieces: after one of those going now
            self.kv.lock(node)
            # With nothing else running, admit without a reserve, so that work always progresses.
            need = n + self._reserve(admitted + [req]) if (plan or self.running or partial) else n
            if self.kv.available() < need + sum(k for _, k in plan) + floor:
                self.kv.unlock(node)
                break
            self.waiting.remove(req)
            req.row = self.kv.admit(prefix)
            req.prefix_len = req.kv_len = len(prefix)
            req.radix_node = node
            self.stats["cached_tokens"] += len(prefix)
            if not req.num_output:
                req.cached_tokens = len(prefix)
            req.status = Status.RUNNING
            plan.append((req, n))
            admitted.append(req)
            held[req.group] += 1
            budget -= n
            if n < extend:
                partial.append(req)
        latest = max((r.arrival for r, _ in plan), default=None)
        for req in self.waiting:
            req.overtaken += latest is not None and req.arrival < latest
        started = {id(r) for r, _ in plan}
        for req in sorted(partial, key=_remaining):
            if id(req) in started:
                continue
            room = self.kv.available() - sum(k for _, k in plan)
            n = min(_remaining(req), budget + (floor if req is oldest else 0), room)
            if n > 0:
                plan.append((req, n))
                budget -= n - (floor if req is oldest else 0)
        fed = {id(r): n for r, n in plan}
        self.prefilling = [r for r in partial if r.kv_len + fed.get(id(r), 0) < r.seq_len]
        return plan

    def _share(self) -> int:
        """Most running sequences one client request may hold while another waits: an equal part of
        --max-running-requests among the client requests running or waiting."""
        groups = {r.group for r in self.running + self.prefilling} | {r.group for r in self.waiting}
        return max(1, self.max_running // max(1, len(groups)))

    def _yield_share(self) -> None:
        """With every running place taken and a client request waiting that holds none, take one back
        from the request holding most, when that is more than its share: the newcomer's wait is one
        step, not however long the other's choices run."""
        if len(self.running) + len(self.prefilling) < self.max_running or not self.waiting:
            return
        held = Counter(r.group for r in self.running + self.prefilling)
        if all(held[r.group] for r in self.waiting):
            return
        group, count = held.most_common(1)[0]
        decoding = [r for r in self.running if r.group == group]
        if count > self._share() and decoding:
            self._retract(self._victim(decoding))

    def _waiting_in_order(self, held: Counter) -> list[Request]:
        """Client requests holding fewest running places first; among equals, with the longest-prefix
        policy: overtaken too often first, then longest cached prefix; else arrival order."""
        reqs = list(self.waiting)
        if self.kv.radix and self.args.schedule_policy == "lpm" and len(reqs) > 1:
            # Matching refreshes LRU times, which is fine: these prefixes are about to be used.
            reqs.sort(key=lambda r: (r.overtaken < _MAX_OVERTAKEN, -len(self.kv.match(r)[0])))
        return sorted(reqs, key=lambda r: held[r.group])      # stable: the order above breaks ties

    def _prefill_step(self, plan: list[tuple[Request, int]]) -> PrefillStep:
        lens = [n for _, n in plan]
        return PrefillStep([r for r, _ in plan], lens, self.kv.alloc(sum(lens)))

    def _apply_prefill(self, step: PrefillStep, result: StepResult) -> list[Request]:
        done = [r for i, r in enumerate(step.reqs) if step.completes(i)]
        self._commit(step.reqs, step.lens, step.slots)
        self.stats["prefill_tokens"] += sum(step.lens)
        logprobs = result.logprobs or [None] * len(step.reqs)
        for i, req in enumerate(step.reqs):
            self._keep_captured(req, result, i)
            if result.tokens[i] and not self._append(req, result.tokens[i], logprobs[i]):
                self.running.append(req)
        return done

    # ------------------------------------------------------------------ decode
    def _make_room(self) -> bool:
        """Free KV for a decode step of every running request (evicting cache, retracting requests);
        False when none can run (the last one was too large and ended)."""
        per_req = self.worker.slots_per_request
        if len(self.running) > 1 and self.kv.available() < per_req * len(self.running):
            wanting = (self.running + list(self.waiting))[:self.max_running]
            self.kv.budget.retracting(len(self.running), per_req, self.kv.available(),
                                      [self._full_length(r) for r in wanting])
        while self.kv.available() < per_req * len(self.running):
            if self.prefilling:
                self._retract(self.prefilling[-1])      # a half-prefilled prompt loses least
            elif len(self.running) == 1:
                self._abort_oom(self.running[0])
                return False
            else:
                self._retract(self._victim())
        return True

    def _decode_step(self, reqs: list[Request]) -> DecodeStep:
        plan = self.planner.plan(reqs)
        chains, per_req = plan.chains, self.worker.slots_per_request
        if chains:
            per_req += max(map(len, chains))
            if self.kv.available() < per_req * len(reqs):
                chains, per_req = None, self.worker.slots_per_request      # no room: verify the chains later
        return DecodeStep(reqs, self.kv.alloc(per_req * len(reqs)).view(len(reqs), per_req), chains, plan.drafts,
                          plan.catch_up, plan.evidence)

    # ------------------------------------------------------------------ running a step
    def _run(self, step: Step) -> list[Request]:
        """Run a step's forward and apply its result; return the requests it touched. When a step fails,
        its requests that have not ended run one by one: the one that fails alone ends with an error (500)
        and the others go on as if nothing happened."""
        try:
            start = time.perf_counter()
            result = self._forward(step)
            if isinstance(step, DecodeStep):
                self.planner.observe(step, result, time.perf_counter() - start)
            return self.apply(step, result)
        except DistributedError:
            raise                               # no request is to blame: the engine cannot go on
        except Exception as exc:
            if len(step.reqs) > 1:
                log.warning("a step of %d requests failed (%s); running them one by one", len(step.reqs), exc)
                return [req for one in self._one_by_one(step) for req in self._run(one)]
            req = step.reqs[0]
            if req.finished:                    # aborted meanwhile
                return []
            log.exception("request %s failed; ending it", req.rid)
            self._fail(req, exc)
            return [req]

    def _one_by_one(self, step: Step) -> Iterator[Step]:
        """A failed step's work again, a step per request not ended, each built when the last has run."""
        if isinstance(step, PrefillStep):
            for req, n in zip(step.reqs, step.lens):
                if not req.finished:
                    yield self._prefill_step([(req, n)])
        else:
            for req in step.reqs:
                if not req.finished:
                    yield self._decode_step([req])

    def _forward(self, step: Step) -> StepResult:
        try:
            return self.worker.forward(step)
        except Exception:
            self.kv.free(step.slots.flatten())      # nothing of the step was committed
            raise

    def _fail(self, req: Request, exc: Exception) -> None:
        self._finish(req, FinishReason("abort", status_code=500, message=(
            f"internal error while generating ({type(exc).__name__}); see the server log")))

    def _apply_decode(self, step: DecodeStep, result: StepResult) -> list[Request]:
        """Commit each request's accepted tokens (their KV at the `kept` slots, in step.slots' order),
        free the step's other slots (rejected nodes, draft scratch) and append the tokens."""
        self._commit(step.reqs, result.counts, step.slots[result.kept])
        self.kv.free(step.slots[~result.kept])
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += result.rows
        logprobs = result.logprobs or [None] * len(step.reqs)
        for i, req in enumerate(step.reqs):
            if result.drafts is not None:
                req.spec_verify_ct += 1
                req.spec_accepted_tokens += result.drafts[i]
                self.spec_stats.record(result.drafts[i])
            self._keep_captured(req, result, i)
            if result.predicted is not None and step.chains[i]:
                req.prediction.verified(len(step.chains[i]), result.predicted[i])
            self._append(req, result.tokens[i], logprobs[i])     # a request that finishes leaves self.running
        return list(step.reqs)

    def _keep_captured(self, req: Request, result: StepResult, i: int) -> None:
        if result.captured is not None:
            req.captured.append(result.captured[i])

    def _victim(self, among: Optional[Sequence[Request]] = None) -> Request:
        # The request that has generated least loses least work (SGLang's choice too).
        return min(among or self.running, key=lambda r: (r.num_output, -r.prompt_len))

    def _retract(self, req: Request) -> None:
        if req in self.prefilling:
            self.prefilling.remove(req)
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
                if req.prediction is not None:
                    req.prediction.follow(tok)
                if logprobs is not None:
                    req.output_logprobs.append(logprobs[i])
                if req.first_token_time is None:
                    req.first_token_time = time.perf_counter()
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
        """Whether appending tok finished the request (where it has stop strings, searching its text
        from where the last search stopped)."""
        p = req.params
        if tok in p.stop_token_ids:
            return FinishReason("stop", matched=tok)
        if tok in self.eos_ids and not p.ignore_eos:
            return FinishReason("stop", matched=tok)
        if p.stop:
            req.text += req.detok.catch_up(req.token_ids)       # searched in the text: decoded token by token
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
        for queue in (self.running, self.waiting, self.prefilling):
            if req in queue:
                queue.remove(req)
        self._release_kv(req)
        # A matched stop token (EOS among them) is not decoded into the text, unless no_stop_trim, as SGLang
        # trims it: kept special tokens (skip_special_tokens false) would otherwise end the text with it.
        ids = req.token_ids
        if isinstance(reason.matched, int) and not req.params.no_stop_trim:
            ids = ids[:-1]
        try:
            req.text += req.detok.catch_up(ids)
            req.text += req.detok.step(ids, final=True)
        except Exception:                   # a detokenizer that failed once: keep the text so far
            log.exception("request %s: the last text could not be decoded", req.rid)
        if req.stop_text_cut is not None:
            req.text = req.text[:req.stop_text_cut]
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self._finished_now.append(req)

    def _decode_text(self, reqs: Sequence[Request]) -> None:
        """The text of the tokens _append left undecoded (requests without stop strings), once per step.
        A failure ends that request alone."""
        for req in reqs:
            if not req.finished:
                try:
                    req.text += req.detok.catch_up(req.token_ids)
                except Exception as exc:
                    log.exception("request %s failed after its step; ending it", req.rid)
                    self._fail(req, exc)


def _remaining(req: Request) -> int:
    """Prompt tokens (or tokens to recompute after a retraction) still to prefill."""
    return req.seq_len - req.kv_len
