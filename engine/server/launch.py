"""run_server: load the engine, serve it with uvicorn, print one ready line, stop cleanly on SIGTERM/Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from typing import Callable, TypeVar

import uvicorn

from engine.config import ServerArgs
from engine.engine import Engine
from engine.server.app import ENGINE_STOP_S, create_app
from engine.server.limits import ReadDeadlineProtocol

log = logging.getLogger(__name__)
T = TypeVar("T")

# In-flight requests get this long to finish after SIGTERM/Ctrl-C; then they are aborted, and each is
# answered (a stream's error event, a 503) within ANSWER_S more, before the connections close.
GRACEFUL_SHUTDOWN_S = 30.0
ANSWER_S = 5.0


def run_server(args: ServerArgs) -> None:
    """`spec serve`: blocks until SIGTERM or Ctrl-C, then returns once in-flight requests are done.
    With --dp-size, runs the replicas and their router instead; with --node-rank > 0, this machine's
    tensor-parallel ranks (engine/distributed/). Exits with status 1 when a tensor-parallel rank fails."""
    _setup_logging(args.log_level)
    if args.dp_size > 1:
        from engine.distributed.data_parallel import serve_replicas

        sys.exit(serve_replicas(args))
    if args.node_rank > 0:
        from engine.distributed.launch import serve_node

        sys.exit(serve_node(args, Engine))
    log.info("loading %s", args.model_path)
    engine = on_own_thread(lambda: Engine(server_args=args))
    server = make_server(engine, args)
    loop = server.config.app.state.serving.loop
    failures: list[str] = []

    def stop(message: str) -> None:
        failures.append(message)
        server.should_exit = True

    loop.on_fatal = stop
    engine.on_rank_failure(stop)        # directly too: the engine thread may be stuck in a collective
    server.run()
    # A second Ctrl-C skips the app's own shutdown; the engine thread must still end before the
    # interpreter does, or torch's threads abort the process (SIGABRT) on their way out.
    stopped = loop.stop(timeout=ENGINE_STOP_S)
    if failures:
        print(f"error: {loop.fatal or f'tensor parallelism stopped: {failures[0]}'}; the server stopped",
              file=sys.stderr, flush=True)
    if not stopped:
        log.error("the engine did not stop within %g s; exiting without it", ENGINE_STOP_S)
        sys.stderr.flush()
        os._exit(1)
    if failures:
        sys.exit(1)
    engine.shutdown()


def on_own_thread(build: Callable[[], T]) -> T:
    """build() run on a thread that then ends: its result, or its exception raised here.

    The engine's steps run on the engine thread (engine_loop.py) and use OpenMP. A thread that ran
    OpenMP work and lives on, as the main thread does serving HTTP, keeps its OpenMP workers; with more
    of them than cores, libgomp stops spinning between parallel regions and puts its workers to sleep
    at every one, so that every step pays to wake them (docs/serving.md, "How it runs"). Loading,
    conversion and the start-up timings run OpenMP work, so the engine is built apart. Ctrl-C while it
    loads exits at once (130)."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = build()
        except BaseException as exc:   # noqa: BLE001 - raised again on the calling thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="spec-load", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        sys.stderr.flush()
        os._exit(130)
    if "error" in box:
        raise box["error"]
    return box["result"]


def make_server(engine: Engine, args: ServerArgs) -> "Server":
    config = uvicorn.Config(create_app(engine, args), host=args.host, port=args.port, log_config=None,
                            # uvicorn's own startup lines give way to ours; its warnings and errors still show
                            log_level="debug" if args.log_level == "debug" else "warning",
                            access_log=args.log_level == "debug", http=ReadDeadlineProtocol,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S + ANSWER_S)
    return Server(config, args)


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, args: ServerArgs):
        super().__init__(config)
        self.args = args
        self.grace_s = GRACEFUL_SHUTDOWN_S

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if self.force_exit:         # a second Ctrl-C: answer what still runs now, not after the grace period
            self.config.app.state.serving.loop.request_stop()

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's graceful shutdown, except that requests still running when the grace period ends
        are aborted and answered (a stream ends with an error event) instead of cut off mid-response."""
        loop = self.config.app.state.serving.loop
        timer = asyncio.get_running_loop().call_later(self.grace_s, loop.request_stop)
        try:
            await super().shutdown(sockets)
            if self.force_exit:     # uvicorn stopped waiting and skips the app's shutdown: do both, briefly
                if self.server_state.tasks:
                    await asyncio.wait(self.server_state.tasks, timeout=ANSWER_S)
                await self.lifespan.shutdown()
        finally:
            timer.cancel()

    @property
    def port(self) -> int:
        return self.servers[0].sockets[0].getsockname()[1]

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host = self.servers[0].sockets[0].getsockname()[0]
            url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
            args = self.config.app.state.serving.args
            ranks = f" | tensor parallel over {args.tp_size} ranks" if args.tp_size > 1 else ""
            print(f"spec serve: ready at {url} | model {self.config.app.state.serving.model_name} | "
                  f"speculative: {describe_speculative(args)}{ranks}", flush=True)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises a caught SIGTERM/SIGINT once it has shut down, which would end the process with
        # status 143 or a KeyboardInterrupt; a requested, clean shutdown should exit 0.
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def describe_speculative(args: ServerArgs) -> str:
    if not args.speculative_algorithm:
        return "off"
    steps, topk, tokens = args.speculative_tree
    draft = f", draft {args.speculative_draft_model_path}" if args.speculative_draft_model_path else ""
    return f"{args.speculative_algorithm} (steps {steps}, topk {topk}, draft tokens {tokens}{draft})"


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
