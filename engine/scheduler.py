"""Scheduler: decides each step's work and keeps every request's KV bookkeeping.

A step is either a prefill (new or resumed requests, longest cached prefix first, long prompts split
into chunks) or a decode of every running request through the worker. When decode runs out of KV
slots the cache is evicted first, then requests are retracted: their KV goes to the radix cache (or is
freed) and they wait to resume, recomputing only what was evicted meanwhile. No request is dropped: one
that cannot fit even alone is finished with an "abort" reason that says what to raise.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Optional, Sequence

import torch

from engine.config import ServerArgs
from engine.detokenizer import IncrementalDetokenizer
from engine.memory.radix_cache import RadixCache
from engine.model_runner import ForwardItem, ModelRunner
from engine.request import FinishReason, Request, Status

log = logging.getLogger(__name__)

# Tokens of growth kept in reserve per running request when admitting new ones, so that fresh
# admissions do not force retractions on the very next steps.
_RESERVE_TOKENS = 8


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunner, tokenizer, worker, eos_ids: Sequence[int]):
        self.args = args
        self.runner = runner
        self.tokenizer = tokenizer
        self.worker = worker
        self.eos_ids = set(eos_ids)
        self.allocator = runner.allocator
        self.table = runner.req_to_token.table
        self.radix: Optional[RadixCache] = None if args.disable_radix_cache else RadixCache(self.allocator)
        self.prefill_budget = args.prefill_chunk(runner.device)
        self.chunking = args.chunked_prefill_size != 0
        self.max_running = runner.max_requests
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilling: Optional[Request] = None   # a request part-way through a chunked prefill
        self.stats = {"retractions": 0, "cached_tokens": 0, "prefill_tokens": 0, "decode_steps": 0}
        self._finished_now: list[Request] = []

    # ------------------------------------------------------------------ requests in and out
    def add(self, req: Request) -> None:
        req.detok = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens,
                                           req.params.spaces_between_special_tokens)
        if req.params.max_new_tokens == 0:
            self._finish(req, FinishReason("length"))
            return
        if len(req.prompt_ids) + 1 > self.allocator.size:
            self._abort_oom(req)
            return
        self.waiting.append(req)

    def _abort_oom(self, req: Request) -> None:
        self._finish(req, FinishReason("abort", message=(
            f"out of KV cache: the request needs {req.seq_len + 1} token slots and the KV pool holds "
            f"{self.allocator.size}; raise --max-total-tokens or --mem-fraction-static")))

    def abort(self, rid: str) -> Optional[Request]:
        for req in list(self.waiting) + self.running + ([self.prefilling] if self.prefilling else []):
            if req.rid == rid:
                self._finish(req, FinishReason("abort", message="aborted by the client"))
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
    def _free_slots(self) -> int:
        return self.allocator.available() + (self.radix.evictable_size() if self.radix else 0)

    def _alloc(self, n: int) -> torch.Tensor:
        short = n - self.allocator.available()
        if short > 0 and self.radix:
            self.radix.evict(short)
        slots = self.allocator.alloc(n)
        assert slots is not None, "callers check _free_slots first"
        return slots

    def _reserve(self, reqs: Sequence[Request]) -> int:
        # One step's transient slots (a draft tree) plus a few tokens of growth per request.
        return sum(self.worker.slots_per_request + min(r.remaining_tokens(), _RESERVE_TOKENS) for r in reqs)

    def _release_kv(self, req: Request) -> None:
        """Give back a request's KV: into the radix cache when on (what is cached there may be reused
        by the request itself on resume, or by others), else to the free list."""
        if req.row is None:
            return
        slots = self.table[req.row, :req.kv_len].clone()
        keep = min(req.kv_len, req.seq_len)        # KV past a cut (stop inside a speculative run) goes
        self.allocator.free(slots[keep:])
        if self.radix:
            dup = self.radix.insert(req.all_ids[:keep], slots[:keep])
            self.allocator.free(slots[req.prefix_len:dup])
            self.radix.dec_lock_ref(req.radix_node)
        else:
            self.allocator.free(slots[:keep])
        self.runner.req_to_token.free(req.row)
        self.worker.release(req)
        req.row, req.kv_len, req.prefix_len, req.radix_node = None, 0, 0, None

    # ------------------------------------------------------------------ prefill
    def _schedule_prefill(self) -> list[tuple[Request, int]]:
        budget = self.prefill_budget
        plan: list[tuple[Request, int]] = []
        if self.prefilling is not None:
            req = self.prefilling
            n = min(req.seq_len - req.kv_len, budget)
            if self._free_slots() < n:
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
            if budget <= 0 or len(admitted) >= self.max_running or self.runner.req_to_token.available() == 0:
                break
            prefix, node = self._match(req)
            if self.radix:
                self.radix.inc_lock_ref(node)
            extend = req.seq_len - len(prefix)
            n = min(extend, budget)
            if n < extend and not self.chunking:
                n = extend                                   # no chunking: the whole prompt or nothing
            # With nothing else running, admit without a reserve, so that work always progresses.
            need = n + self._reserve(admitted + [req]) if (plan or self.running) else n
            if self._free_slots() < need + sum(k for _, k in plan):
                if self.radix:
                    self.radix.dec_lock_ref(node)
                break
            self.waiting.remove(req)
            req.row = self.runner.req_to_token.alloc()
            req.prefix_len = req.kv_len = len(prefix)
            req.radix_node = node
            self.table[req.row, :len(prefix)] = prefix
            self.stats["cached_tokens"] += len(prefix)
            if not req.output_ids:
                req.cached_tokens = len(prefix)
            req.status = Status.RUNNING
            plan.append((req, n))
            admitted.append(req)
            budget -= n
            if n < extend:
                self.prefilling = req
                break
        return plan

    def _waiting_in_order(self) -> list[Request]:
        reqs = list(self.waiting)
        if self.radix and self.args.schedule_policy == "lpm" and len(reqs) > 1:
            # Longest cached prefix first; stable, so arrival order breaks ties. Matching refreshes
            # LRU times, which is fine: these prefixes are about to be used.
            reqs.sort(key=lambda r: -len(self._match(r)[0]))
        return reqs

    def _match(self, req: Request):
        if not self.radix:
            return torch.empty(0, dtype=torch.int64), None
        # Keep at least one token to compute: its logits give the next token.
        return self.radix.match_prefix(req.all_ids[:req.seq_len - 1])

    def _run_prefill(self, plan: list[tuple[Request, int]]) -> list[Request]:
        total = sum(n for _, n in plan)
        slots = self._alloc(total)
        items, last_rows, done = [], [], []
        offset = 0
        for req, n in plan:
            items.append(ForwardItem(req.row, req.kv_len, req.all_ids[req.kv_len:req.kv_len + n]))
            offset += n
            if req.kv_len + n == req.seq_len:
                last_rows.append(offset - 1)
                done.append(req)
        out = self.runner.forward(items, slots, torch.tensor(last_rows, dtype=torch.long), self.worker.capture_hidden)
        self.stats["prefill_tokens"] += total
        for req, n in plan:
            req.kv_len += n
        if done:
            for req, tok in zip(done, self.worker.sample_next(done, out.logits)):
                if not self._append(req, [tok]):
                    self.running.append(req)
        self.worker.after_prefill(plan, out)
        return done

    # ------------------------------------------------------------------ decode
    def _run_decode(self) -> list[Request]:
        per_req = self.worker.slots_per_request
        while self._free_slots() < per_req * len(self.running):
            if self.prefilling is not None:
                self._retract(self.prefilling)          # a half-prefilled prompt loses least
            elif len(self.running) == 1:
                self._abort_oom(self.running[0])
                return []
            else:
                self._retract(self._victim())
        short = per_req * len(self.running) - self.allocator.available()
        if short > 0 and self.radix:
            self.radix.evict(short)
        reqs = list(self.running)
        new_tokens = self.worker.decode(reqs)
        self.stats["decode_steps"] += 1
        for req, toks in zip(reqs, new_tokens):
            self._append(req, toks)             # a request that finishes leaves self.running
        return reqs

    def _victim(self) -> Request:
        # The request that has generated least loses least work (SGLang's choice too).
        return min(self.running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))

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
        log.debug("retracted %s after %d tokens (KV full)", req.rid, len(req.output_ids))

    # ------------------------------------------------------------------ output and stopping
    def _append(self, req: Request, tokens: Sequence[int]) -> bool:
        """Append tokens one at a time until one finishes the request; True when it finished."""
        for tok in tokens:
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = time.perf_counter()
            req.text += req.detok.step(req.output_ids)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
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
        if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.runner.context_len:
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
        req.text += req.detok.step(req.output_ids, final=True)
        if req.stop_text_cut is not None:
            req.text = req.text[:req.stop_text_cut]
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self._finished_now.append(req)
