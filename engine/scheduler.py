"""Scheduler: decides each step's work, and alone changes requests and KV bookkeeping.

A step is either a prefill (new or resumed requests, longest cached prefix first, long prompts split
into chunks) or a decode of every running request. The scheduler allocates the step's KV slots
through the KV manager, calls the worker once, and applies its StepResult: appends the tokens (cutting
an accepted run where a stop fires), commits the accepted tokens' slots and frees the rest. When decode
runs out of KV slots the cache is evicted first, then requests are retracted: their KV goes to the
radix cache (or is freed) and they wait to resume, recomputing only what was evicted meanwhile. No
request is dropped: one that cannot fit even alone is finished with an "abort" reason that says what
to raise.

With the overlap scheduler (--enable-overlap-schedule, SGLang's spec v2) forwards run on a thread of
their own, and step() returns the previous step's requests while the next forward runs, so their text is
decoded, and the caller streams them, meanwhile. A decode step is built ahead where it is sure to be the
next one (engine/ahead.py; _launch_ahead says when it is not): while step N's forward runs, step() takes
step N+1's KV slots, copies its requests and queues its forward behind N's; the forward thread resolves
N+1 from N's result (tokens, cached lengths, table entries, the requests N finished left out) and runs
it without waiting, and step() applies N once N+1 is under way. Otherwise step() applies N and then
schedules N+1, as without overlap. Either way the worker sees the batches it would see without overlap,
so outputs are the same. A request that ends while its step runs (an abort) gets nothing from that step,
and its KV, which the forward may be reading, is released once the step is back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from engine.ahead import copies, forward_ahead
from engine.config import ServerArgs
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import DistributedError
from engine.memory.kv_manager import KVManager
from engine.request import FinishReason, Request, Status
from engine.speculative.cost import StepCost
from engine.speculative.prediction import ANCHOR_MAX, chain_length
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
# Prompts prefilled in pieces at the same time: a shorter long prompt need not wait for a longer one.
_MAX_PARTIAL = 4
# A further row's share of a one-row decode step before step times are measured: on a CPU the weight
# kernels are compute-bound past one row; on a GPU rows are nearly free until the batch is large.
_PRIOR_ROW_COST = {"cpu": 0.12, "cuda": 0.01}


class _InFlight(NamedTuple):
    """A step launched on the forward thread (overlap scheduler), to apply at the next step()."""
    items: list                                 # what it was built from (prefill plan or requests)
    step: object                                # its PrefillStep or DecodeStep
    result: Future                              # the worker's StepResult
    apply: Callable                             # apply(step, result) -> the requests it touched
    run: Callable                               # items -> touched: build, forward and apply, now
    started: Optional[threading.Event] = None   # built ahead: set once its inputs are resolved


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
        self.prefilling: list[Request] = []         # requests part-way through a chunked prefill, oldest first
        self._prefilled_last = False
        self.stats = {"retractions": 0, "cached_tokens": 0, "prefill_tokens": 0, "decode_steps": 0}
        # What a decode forward of R rows costs here: sizes Predicted Output chains.
        self.cost = StepCost(_PRIOR_ROW_COST[device])
        self._finished_now: list[Request] = []
        self._forwards = (ThreadPoolExecutor(1, thread_name_prefix="spec-forward")
                          if args.enable_overlap_schedule else None)
        self._in_flight: Optional[_InFlight] = None
        # Ended while a step that may read their KV ran: (request, whether its drafter state is still to
        # release: not where a step built ahead dropped it).
        self._release_later: list[tuple[Request, bool]] = []
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

    @property
    def requests(self) -> list[Request]:
        """Every request not finished: waiting, running, or in a step in flight (a prefill's, whose
        requests join `running` when it is applied)."""
        held = list(self.waiting) + self.running + self.prefilling
        in_flight = self._in_flight.step.reqs if self._in_flight is not None else []
        ids = {id(r) for r in held}
        return held + [r for r in in_flight if not r.finished and id(r) not in ids]

    def abort(self, rid: str, message: str = "aborted by the client", status_code: Optional[int] = None
              ) -> Optional[Request]:
        for req in self.requests:
            if req.rid == rid:
                self._finish(req, FinishReason("abort", message=message, status_code=status_code))
                return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling or self._in_flight is not None)

    def step(self) -> list[Request]:
        """Run one forward's worth of work; return the requests that got tokens or finished (including
        those finished between steps: aborted, or refused at admission). Overlap scheduler: apply the
        step in flight, launch the next, and return the applied step's requests."""
        flight = self._in_flight
        self._in_flight = flight and self._launch_ahead(flight)
        touched = self._settle(flight) if flight else []
        if self._in_flight is not None and all(r.finished for r in self._in_flight.step.reqs):
            self.drain()            # built ahead for requests that flight finished: it runs none of them
        if self._in_flight is None:
            # Running streams decode between any two prefill steps: a burst of prompts or a long one
            # in pieces delays their next token by one prefill step, never more.
            scheduled = [] if self._prefilled_last and self.running else self._schedule_prefill()
            self._prefilled_last = bool(scheduled)
            if scheduled:
                touched += self._run_prefill(scheduled)
            elif self.running:
                touched += self._run_decode()
        self._decode_text(touched)          # overlap scheduler: while the step just launched runs
        seen = {id(r) for r in touched}
        out = touched + [r for r in self._finished_now if id(r) not in seen]
        self._finished_now = []
        return out

    # ------------------------------------------------------------------ memory
    def _reserve(self, reqs: Sequence[Request]) -> int:
        # One step's transient slots (a draft tree) plus a few tokens of growth per request.
        return sum(self.worker.slots_per_request + min(r.remaining_tokens(), _RESERVE_TOKENS) for r in reqs)

    def _release_kv(self, req: Request, drafter: bool = True) -> None:
        if self._in_flight is not None:     # the forward may be reading its KV and drafter state
            self._release_later.append((req, drafter))
            return
        if drafter:
            self.worker.release(req)    # first: a drafter may clear state kept by the request's table row
        self.kv.release(req)

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
            self.kv.admit(req, prefix, node)
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

    def _run_prefill(self, plan: list[tuple[Request, int]]) -> list[Request]:
        return self._run(plan, self._prefill_step, self._apply_prefill)

    def _prefill_step(self, plan: list[tuple[Request, int]]) -> PrefillStep:
        lens = [n for _, n in plan]
        return PrefillStep([r for r, _ in plan], lens, self.kv.alloc(sum(lens)))

    def _apply_prefill(self, step: PrefillStep, result: StepResult) -> list[Request]:
        live = [not r.finished for r in step.reqs]
        done = [r for i, r in enumerate(step.reqs) if live[i] and step.completes(i)]
        self._commit(step, step.lens, torch.tensor(live).repeat_interleave(torch.tensor(step.lens)), live)
        self.stats["prefill_tokens"] += sum(step.lens)
        logprobs = result.logprobs or [None] * len(step.reqs)
        for i, req in enumerate(step.reqs):
            if live[i]:
                self._keep_captured(req, result, i)
                if result.tokens[i] and not self._append(req, result.tokens[i], logprobs[i]):
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
            if self.prefilling:
                self._retract(self.prefilling[-1])      # a half-prefilled prompt loses least
            elif len(self.running) == 1:
                self._abort_oom(self.running[0])
                return []
            else:
                self._retract(self._victim())
        return self._run(list(self.running), self._decode_step, self._apply_decode)

    def _decode_step(self, reqs: list[Request]) -> DecodeStep:
        chains = self._chains(reqs)
        per_req = self.worker.slots_per_request + max(map(len, chains or [[]]))
        if chains and self.kv.available() < per_req * len(reqs):
            chains, per_req = None, self.worker.slots_per_request       # no room: verify the chains later
        return DecodeStep(reqs, self.kv.alloc(per_req * len(reqs)).view(len(reqs), per_req), chains)

    def _chains(self, reqs: list[Request]) -> Optional[list[list[int]]]:
        """Each request's Predicted Output chain for this step, as long as pays by the step cost model
        and its recent acceptance (none without a prediction); None when no request has one."""
        if all(r.prediction is None for r in reqs):
            return None
        rows = len(reqs) * self.worker.num_draft_tokens        # the step's rows without chains

        def cost(k: int) -> float:
            return self.cost.relative(rows, k)

        chains = []
        for r in reqs:
            p = r.prediction
            tail = r.token_ids[-ANCHOR_MAX:]
            left = p.remaining(tail) if p is not None else 0        # finds the place first, when lost
            room = min(left, r.remaining_tokens() - 1, self.context_len - r.seq_len - 1)
            chains.append(p.chain(tail, chain_length(p.chance, room, cost)) if left else [])
        return chains if any(chains) else None

    # ------------------------------------------------------------------ running a step
    def _run(self, items: list, build: Callable, apply: Callable) -> list[Request]:
        """Build the step of `items`, run its forward, apply the result; return the requests it touched.
        Overlap scheduler: launch the forward and return; the next step() applies it."""
        if self._forwards is None:
            return self._isolating(items, self._now(build, apply))
        step = build(items)
        self._in_flight = _InFlight(items, step, self._forwards.submit(self.worker.forward, step), apply,
                                    self._now(build, apply))
        return []

    def _now(self, build: Callable, apply: Callable) -> Callable:
        def run(items: list) -> list[Request]:
            step = build(items)
            start = time.perf_counter()
            result = self._forward(step)
            if result.rows:
                self.cost.observe(result.rows, time.perf_counter() - start)
            return apply(step, result)
        return run

    def _launch_ahead(self, flight: _InFlight) -> Optional[_InFlight]:
        """Overlap scheduler: queue the decode step that follows `flight` before flight's result is known
        (engine/ahead.py), where that step is sure to be the one scheduled after it: a decode of the same
        requests, less those flight's tokens finish. None where the next step must wait for flight's
        result: a prefill is due (requests waiting, a prompt part-way), flight is a prefill, a request's
        stop test needs its text (stop strings) or its grammar, a prediction's chain needs the tokens,
        hidden states are captured, a request that ended meanwhile has drafter state to release, or KV
        is short (only free slots are taken, so that nothing is evicted or retracted earlier than without
        building ahead)."""
        reqs = self.running
        if not (isinstance(flight.step, DecodeStep) and reqs and not self.waiting and not self.prefilling
                and [r for r in flight.step.reqs if not r.finished] == reqs and not self.worker.capture
                and all(r.grammar is None and not r.params.stop and r.prediction is None for r in reqs)
                and not any(drafter for _, drafter in self._release_later)
                and self.kv.unused() >= self.worker.slots_per_request * len(reqs)):
            return None
        step, started = self._decode_step(list(reqs)), threading.Event()
        launched = self._forwards.submit(forward_ahead, self.worker, self.kv.table, flight.step, flight.result,
                                         step, copies(reqs), self._stop_reason, started)
        return _InFlight(list(reqs), step, launched, self._apply_ahead,
                         self._now(self._decode_step, self._apply_decode), started)

    def _apply_ahead(self, step: DecodeStep, out: tuple[DecodeStep, Optional[StepResult]]) -> list[Request]:
        ran, result = out
        ids = {id(r) for r in ran.reqs}
        self.kv.free(step.slots[[b for b, r in enumerate(step.reqs) if id(r) not in ids]].flatten())
        return self._apply_decode(ran, result) if ran.reqs else []

    def close(self) -> None:
        """Stop the forward thread (overlap scheduler), after applying the step in flight."""
        if self._forwards is not None:
            self.drain()
            self._forwards.shutdown()

    def drain(self) -> list[Request]:
        """Overlap scheduler: wait for the step in flight and apply it, launching none; return the
        requests it touched."""
        flight, self._in_flight = self._in_flight, None
        return self._settle(flight) if flight else []

    def _settle(self, flight: _InFlight) -> list[Request]:
        """Wait for a launched step and apply it; return the requests it touched. Requests that ended
        while it ran get nothing from it; their KV, which it may have read, is released once it is back
        (before applying it: in the order a scheduler without overlap releases it). A step built ahead
        of this one (in self._in_flight) is applied after once it is under way, and cancelled where this
        one fails: its inputs never came."""
        items, step, result, apply, run = flight[:5]
        ahead = self._in_flight

        def first(_) -> list[Request]:
            try:
                try:
                    out = self._forward(step, result)
                    if ahead is not None:
                        ahead.started.wait()
                finally:
                    self._release_waiting()
                return apply(step, out)
            except Exception:
                self._cancel_ahead()
                raise

        return self._isolating(items, run, first=first)

    def _release_waiting(self) -> None:
        waiting, self._release_later = self._release_later, []
        for req, drafter in waiting:
            if drafter:             # never while a step built ahead runs (_launch_ahead waits for these)
                self.worker.release(req)
            self.kv.release(req)

    def _cancel_ahead(self) -> None:
        ahead, self._in_flight = self._in_flight, None
        if ahead is not None:
            try:
                ahead.result.result()
            except Exception:
                pass                # it ran nothing where the step it follows failed
            self.kv.free(ahead.step.slots.flatten())

    def _forward(self, step, launched: Optional[Future] = None) -> StepResult:
        try:
            return launched.result() if launched is not None else self.worker.forward(step)
        except Exception:
            self.kv.free(step.slots.flatten())      # nothing of the step was committed
            raise

    def _isolating(self, items: list, run: Callable, first: Optional[Callable] = None) -> list[Request]:
        """(first or run)(items) -> the requests it touched. When a step fails, its requests that have
        not ended run one by one: the one that fails alone ends with an error (500) and the others go on
        as if nothing happened."""
        try:
            return (first or run)(items)
        except DistributedError:
            raise                               # no request is to blame: the engine cannot go on
        except Exception as exc:
            live = [item for item in items if not _request(item).finished]     # some may have been aborted
            if len(items) > 1:
                log.warning("a step of %d requests failed (%s); running them one by one", len(items), exc)
                return [req for item in live for req in self._isolating([item], run)]
            if not live:
                return []
            req = _request(live[0])
            log.exception("request %s failed; ending it", req.rid)
            self._fail(req, exc)
            return [req]

    def _fail(self, req: Request, exc: Exception) -> None:
        self._finish(req, FinishReason("abort", status_code=500, message=(
            f"internal error while generating ({type(exc).__name__}); see the server log")))

    def _apply_decode(self, step: DecodeStep, result: StepResult) -> list[Request]:
        live = [not r.finished for r in step.reqs]
        self._commit(step, result.counts, result.kept & torch.tensor(live)[:, None], live)
        self.stats["decode_steps"] += 1
        logprobs = result.logprobs or [None] * len(step.reqs)
        for i, req in enumerate(step.reqs):
            if not live[i]:
                continue
            if result.drafts is not None:
                req.spec_verify_ct += 1
                req.spec_accepted_tokens += result.drafts[i]
                self.spec_stats.record(result.drafts[i])
            self._keep_captured(req, result, i)
            if result.predicted is not None and step.chains[i]:
                req.prediction.verified(len(step.chains[i]), result.predicted[i])
            self._append(req, result.tokens[i], logprobs[i])     # a request that finishes leaves self.running
        return [r for r, ok in zip(step.reqs, live) if ok]

    def _commit(self, step, counts: Sequence[int], kept: torch.Tensor, live: Sequence[bool]) -> None:
        """Commit counts[i] tokens of each live request, their KV at the `kept` slots (in step.slots'
        order), and free the step's other slots: rejected nodes, draft scratch, and all of a request
        that ended while its step ran (rollback)."""
        self.kv.commit(step.reqs, [n if ok else 0 for n, ok in zip(counts, live)], step.slots[kept])
        self.kv.free(step.slots[~kept])

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
                if req.params.stop:             # searched in the text: decoded token by token, now
                    req.text += req.detok.catch_up(req.token_ids)
                if req.grammar is not None and not req.grammar.accept_token(tok):
                    # Masks allow only what the grammar accepts: this is a bug, not the client's doing.
                    raise RuntimeError(f"the grammar refused committed token {tok}")
                reason = self._stop_reason(req, tok)
                if reason is not None:
                    # A step built ahead holding the request dropped it, by the same test, and released
                    # its drafter state (engine/ahead.py).
                    self._finish(req, reason, drafter=self._in_flight is None or req not in self._in_flight.step.reqs)
                    return True
        except Exception as exc:
            log.exception("request %s failed after its step; ending it", req.rid)
            self._fail(req, exc)
            return True
        return False

    def _stop_reason(self, req: Request, tok: int) -> Optional[FinishReason]:
        """Whether appending tok finished the request. Reads nothing but the request and, where it has
        stop strings, changes its text state: without them, the forward thread tests copies with it."""
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

    def _finish(self, req: Request, reason: FinishReason, drafter: bool = True) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        self._release_kv(req, drafter)
        try:
            req.text += req.detok.catch_up(req.token_ids)
            req.text += req.detok.step(req.token_ids, final=True)
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
        Overlap scheduler: while the next step's forward runs. A failure ends that request alone."""
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


def _request(item) -> Request:
    """The request of a step item: a request, or a prefill plan's (request, tokens)."""
    return item[0] if isinstance(item, tuple) else item
