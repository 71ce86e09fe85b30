"""EngineLoop: runs the Engine on its own thread and hands outputs to the asyncio event loop.

The Engine is not thread-safe, so only the loop thread touches it: the HTTP side sends commands
(add, abort) through a thread-safe queue and never waits for a step; after each step the loop thread
passes every touched request's output to the event loop in one `call_soon_threadsafe`, and never waits
for HTTP. The model's forward runs in torch kernels that release the GIL, so the event loop serves
HTTP meanwhile (docs/serving.md has the thread-versus-process measurement behind this design).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable, Optional, Sequence

from engine.engine import Engine
from engine.errors import DistributedError
from engine.core.request import Request

log = logging.getLogger(__name__)

# The abort messages of requests failed by a bug in the engine loop itself (answered 500) and of those
# still running when shutdown's grace period ran out (503).
INTERNAL_ERROR = "internal error while generating; see the server log"
SHUTTING_DOWN = "the server is shutting down"
# /health answers 503 once the loop has held requests this long without making progress (no step
# changed anything): a real step, even a long prefill chunk on CPU, takes far less.
STALL_S = 60.0


def finish_type(out: Optional[dict]) -> Optional[str]:
    """"stop", "length" or "abort" once the request finished, else None."""
    reason = out["meta_info"]["finish_reason"] if out else None
    return reason["type"] if reason else None


class Submission:
    """The requests of one HTTP call (n choices per prompt) and their newest outputs, on the event loop.

    Outputs are cumulative (text and token ids so far), so a reader that falls behind skips straight
    to the newest one instead of replaying every step."""

    def __init__(self, reqs: Sequence[Request]):
        self.rids = [r.rid for r in reqs]
        self.latest: list[Optional[dict]] = [None] * len(reqs)
        self.times: list[Optional[float]] = [None] * len(reqs)    # when each newest output was made
        self._ready: asyncio.Queue[int] = asyncio.Queue()

    def put(self, index: int, out: dict, at: float) -> None:
        self.latest[index], self.times[index] = out, at
        self._ready.put_nowait(index)

    @property
    def done(self) -> bool:
        return all(finish_type(o) for o in self.latest)

    def unfinished(self) -> list[str]:
        return [rid for rid, o in zip(self.rids, self.latest) if not finish_type(o)]

    async def updates(self) -> AsyncIterator[list[int]]:
        """The indices with new output since the last yield, until every request has finished."""
        while not self.done:
            ready = {await self._ready.get()}
            while not self._ready.empty():
                ready.add(self._ready.get_nowait())
            yield sorted(ready)

    async def wait(self) -> list[dict]:
        async for _ in self.updates():
            pass
        return list(self.latest)


# Observer of every output on the event loop: (previous output or None, its time, output, time).
OutputHook = Callable[[Optional[dict], Optional[float], dict, float], None]


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.on_output: Optional[OutputHook] = None
        self.queued = 0                    # accepted requests without output yet (event loop side)
        self.snapshot = self._snapshot()   # replaced by the loop thread after every step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._subs: dict[str, tuple[Submission, int]] = {}     # written by the loop thread only
        self._stopping = False
        self.stall_s = STALL_S
        self._progress_at = time.monotonic()     # the last step that changed anything (loop thread)
        self._event_loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread = threading.Thread(target=self._run, name="spec-engine-loop", daemon=True)
        # A tensor-parallel rank that died or stopped answering ends the loop: `fatal` says why, and
        # on_fatal(message) is called (the server stops). A rank that dies while the loop idles says so too.
        self.fatal: Optional[str] = None
        self.on_fatal: Callable[[str], None] = lambda message: None
        engine.on_rank_failure(lambda message: self._inbox.put(("fatal", message, None)))

    # ------------------------------------------------------------------ event loop side
    def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def healthy(self) -> bool:
        """Alive, and making progress whenever it holds requests."""
        return self.alive and (not self._subs or time.monotonic() - self._progress_at < self.stall_s)

    def submit(self, reqs: Sequence[Request]) -> Submission:
        sub = Submission(reqs)
        self.queued += len(reqs)
        self._inbox.put(("add", list(reqs), sub))
        return sub

    def abort(self, rids: Sequence[str]) -> None:
        if rids:
            self._inbox.put(("abort", list(rids), None))

    def request_stop(self) -> None:
        """Abort whatever is still queued or running (each answered SHUTTING_DOWN), then end the thread."""
        self._inbox.put(("stop", None, None))

    def stop(self, timeout: float = 30.0) -> bool:
        """request_stop, and wait for the thread to end (blocking); False if it has not ended in time."""
        self.request_stop()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _on_event_loop(self, batch: list[tuple[Submission, int, dict]], at: float) -> None:
        for sub, index, out in batch:
            prev = sub.latest[index]
            if prev is None:
                self.queued -= 1
            if self.on_output is not None:
                self.on_output(prev, sub.times[index], out, at)
            sub.put(index, out, at)

    # ------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        try:
            while not (self._stopping and not self._subs):
                try:
                    self._take_commands()
                    touched = self.engine.step()        # also flushes requests aborted or refused meanwhile
                    snapshot = self._snapshot()
                    if touched or snapshot != self.snapshot:
                        self._progress_at = time.monotonic()
                    self.snapshot = snapshot            # first: whoever sees an output sees figures as fresh
                    self._deliver(touched)
                except DistributedError as exc:         # the ranks are out of step: nothing can run
                    self.fatal = str(exc)
                    log.error("%s; stopping the server", exc)
                    self._stopping = True
                    self._fail_in_flight(f"the server stopped: {exc}", also_queued=True)
                    self.on_fatal(self.fatal)
                    return
                except Exception:                       # a bug: fail what is in flight, keep serving
                    log.exception("the engine loop failed; aborting the requests in flight")
                    self._fail_in_flight(INTERNAL_ERROR)
        finally:    # whatever ends the thread (stop, a BaseException), no request may wait for it forever
            self._fail_in_flight(SHUTTING_DOWN if self._stopping else INTERNAL_ERROR, also_queued=True)

    def _take_commands(self) -> None:
        """Apply every queued command; when the engine has nothing to do, sleep until one arrives."""
        block = not self.engine.has_work and not self._stopping
        while True:
            try:
                kind, payload, sub = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                if not self._subs:                  # an idle engine's progress clock starts now
                    self._progress_at = time.monotonic()
                for index, req in enumerate(payload):
                    self._subs[req.rid] = (sub, index)
                    self.engine.add_request(req)
                    if self._stopping:
                        self.engine.abort(req.rid, SHUTTING_DOWN, 503)
            elif kind == "abort":
                for rid in payload:
                    self.engine.abort(rid)
            elif kind == "fatal":
                raise DistributedError(f"tensor parallelism stopped: {payload}")
            else:
                self._stopping = True
                for rid in list(self._subs):
                    self.engine.abort(rid, SHUTTING_DOWN, 503)

    def _deliver(self, touched: Sequence[Request]) -> None:
        batch = []
        for req in touched:
            target = self._subs.get(req.rid)
            if target is None:
                continue
            if req.finished:
                del self._subs[req.rid]
            out = self.engine.output_dict(req)
            out["meta_info"].setdefault("spec_verify_ct", req.spec_verify_ct)
            batch.append((*target, out))
        self._send(batch)

    def _send(self, batch: list[tuple[Submission, int, dict]]) -> None:
        if not batch:
            return
        try:
            self._event_loop.call_soon_threadsafe(self._on_event_loop, batch, time.perf_counter())
        except RuntimeError:        # the event loop has closed: nobody is listening any more
            pass

    def _fail_in_flight(self, message: str, also_queued: bool = False) -> None:
        """Abort every request held (and, with also_queued, every one still in the inbox) with `message`,
        and reset the engine."""
        while also_queued and not self._inbox.empty():
            kind, payload, sub = self._inbox.get()
            if kind == "add":
                self._subs.update((req.rid, (sub, index)) for index, req in enumerate(payload))
        if not self._subs:
            return
        batch = []
        for rid, (sub, index) in self._subs.items():
            reason = {"type": "abort", "message": message,
                      "status_code": 500 if message == INTERNAL_ERROR else 503}
            batch.append((sub, index, {"text": "", "output_ids": [], "meta_info": {
                "id": rid, "prompt_tokens": 0, "completion_tokens": 0, "spec_verify_ct": 0, "cached_tokens": 0,
                "finish_reason": reason, "e2e_latency": 0.0, "ttft": None}}))
        self._subs.clear()
        self._send(batch)
        if self.fatal:
            return              # the engine cannot run a step to release the requests' memory
        try:
            self.engine.abort_all()
        except Exception:
            log.exception("could not reset the engine after a failed step")

    def _snapshot(self) -> dict:
        """Engine figures for /metrics and /get_server_info (read on the event loop without locks)."""
        return self.engine.stats()
