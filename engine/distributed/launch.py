"""Starting one machine's tensor-parallel ranks, and watching them.

`spec serve` and `Engine(...)` are rank 0, in their own process: `join` spawns the machine's other ranks
(multiprocessing's spawn method: fresh interpreters, as CUDA requires), every rank joins the group
(group.py) and builds the same engine at its own sizes; the others then follow rank 0 (mirror.py).
The caller names the engine class a rank builds, so that this module needs none of the engine's.
On further machines (--node-rank > 0) `serve_node` spawns that machine's ranks and waits for them.

A rank that fails to start, or dies, stops everything with a message that names it, never a hang:
- each spawned rank reports its start-up error through a pipe before it exits, and a watcher thread
  on its parent sees it exit (its process sentinel); rank 0 stops waiting for the group at once;
- gloo ends a collective with a dead peer at once ("connection closed"), so a rank whose peer died
  fails its next collective, and the ranks other than 0 leave when rank 0 goes;
- every collective of the model group times out after --dist-timeout (NCCL's watchdog on a GPU).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

import torch

from engine.config import ServerArgs
from engine.distributed import group
from engine.distributed.mirror import STOP_S, Follower, Leader
from engine.errors import ConfigError

log = logging.getLogger(__name__)


# What a rank builds: engine.engine.Engine (passed in by whoever starts ranks; built as Engine(server_args=...)).
EngineClass = Callable[..., Any]


def join(args: ServerArgs, engine_class: EngineClass):
    """This process's part in tensor parallelism: None at --tp-size 1; a Follower in a rank that
    `_rank_main` started; otherwise rank 0's Leader, its machine's other ranks started (each building
    an `engine_class`) and joined."""
    joined = group.joined()
    if joined is not None and joined.rank != 0:
        return Follower(joined)
    if args.dp_size > 1:
        raise ConfigError("--dp-size runs server replicas behind a router: use `spec serve`.")
    if args.node_rank != 0:
        raise ConfigError("--node-rank > 0 runs only `spec serve`, which computes for node 0's server; the "
                          "Python Engine runs on node 0.")
    if args.tp_size == 1:
        return None
    if joined is not None:
        raise ConfigError("This process leads a tensor-parallel engine already; shut it down first (one per process).")
    device = _device(args)
    addr = args.dist_init_addr or f"127.0.0.1:{free_port()}"
    _set_threads(args, device)
    ranks = LocalRanks(args, addr, range(1, args.ranks_per_node), engine_class)
    try:
        group.init(0, args.tp_size, addr, device, args.dist_timeout, failed=lambda: ranks.dead)
    except BaseException:
        ranks.stop(timeout=0)
        raise
    return Leader(group.joined(), ranks)


class LocalRanks:
    """This machine's ranks `ranks`, each in a spawned process building an `engine_class`, watched by a
    thread."""

    def __init__(self, args: ServerArgs, addr: str, ranks: range, engine_class: EngineClass):
        context = multiprocessing.get_context("spawn")
        self.children: list[tuple[int, multiprocessing.Process, Connection]] = []
        for rank in ranks:
            reader, writer = context.Pipe(duplex=False)
            proc = context.Process(target=_rank_main, args=(args, rank, addr, writer, engine_class),
                                   name=f"spec-tp-rank-{rank}", daemon=True)
            proc.start()
            writer.close()
            self.children.append((rank, proc, reader))
        self.dead: Optional[str] = None         # what happened to the first rank that died
        self._stopping = False
        self._died = threading.Event()
        self._on_death: list[Callable[[str], None]] = []
        threading.Thread(target=self._watch, name="spec-tp-watch", daemon=True).start()

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call callback(message) (on the watcher thread) when a rank dies; at once if one has."""
        self._on_death.append(callback)
        if self.dead:
            callback(self.dead)

    def stopping(self) -> None:
        """The ranks are about to be told to stop: their exits are no deaths."""
        self._stopping = True

    def _watch(self) -> None:
        waiting = {proc.sentinel: (rank, proc, reader) for rank, proc, reader in self.children}
        while waiting:
            for sentinel in wait(list(waiting)):
                rank, proc, reader = waiting.pop(sentinel)
                proc.join()
                if self._stopping or self.dead or proc.exitcode == 0:     # 0: told to stop by rank 0
                    continue
                self.dead = f"rank {rank} {_exit_status(proc.exitcode)}{_reported(reader)}"
                log.error("tensor parallelism: %s", self.dead)
                self._died.set()
                for callback in self._on_death:
                    callback(self.dead)

    def wait_for_death(self, timeout: float) -> Optional[str]:
        """What happened to the first rank that died, waiting up to `timeout` s for one to."""
        self._died.wait(timeout)
        return self.dead

    def stop(self, timeout: float) -> None:
        """Give the ranks `timeout` s to exit (after rank 0's "stop"), then end those that have not."""
        self.stopping()
        for _, proc, _ in self.children:
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(STOP_S)


def _rank_main(args: ServerArgs, rank: int, addr: str, report: Connection, engine_class: EngineClass) -> None:
    """A spawned rank: join the group, build the engine, tell the parent it started (or why not), follow."""
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    try:
        device = _device(args)
        _set_threads(args, device)
        if device == "cuda":
            torch.cuda.set_device(rank % args.ranks_per_node)
        group.init(rank, args.tp_size, addr, device, args.dist_timeout)
        engine = engine_class(server_args=args)
    except BaseException as exc:   # noqa: BLE001 - whatever stops a rank is reported, then it exits
        report.send(" ".join(str(exc).split()) or type(exc).__name__)
        sys.exit(1)
    report.close()
    try:
        engine.follow()
    except Exception as exc:
        log.error("stopping: lost the other ranks (%s)", " ".join(str(exc).split())[:200])
        sys.exit(1)
    group.destroy()


def serve_node(args: ServerArgs, engine_class: EngineClass) -> int:
    """`spec serve --node-rank K` (K > 0): this machine's ranks, until they exit; returns the exit status."""
    first = args.node_rank * args.ranks_per_node
    ranks = LocalRanks(args, args.dist_init_addr, range(first, first + args.ranks_per_node), engine_class)
    print(f"spec serve: node {args.node_rank} runs ranks {first}-{first + args.ranks_per_node - 1}, following rank 0 "
          f"at {args.dist_init_addr}", flush=True)
    done = threading.Event()
    ranks.on_death(lambda message: done.set())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        while not done.wait(0.5) and any(proc.is_alive() for _, proc, _ in ranks.children):
            pass
    except KeyboardInterrupt:
        pass
    ranks.stop(timeout=STOP_S)
    if ranks.dead:
        print(f"error: {ranks.dead}", file=sys.stderr, flush=True)
        return 1
    return 0


def _device(args: ServerArgs) -> str:
    from engine.core.model_runner import resolve_device

    device = resolve_device(args.device)
    if device == "cuda" and torch.cuda.device_count() < args.ranks_per_node:
        raise ConfigError(f"--tp-size {args.tp_size} over {args.nnodes} node(s) needs {args.ranks_per_node} GPUs on this "
                          f"machine; it has {torch.cuda.device_count()}.")
    return device


def _set_threads(args: ServerArgs, device: str) -> None:
    """CPU ranks share the machine's cores (each would take them all)."""
    if device == "cpu" and not args.num_threads:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks_per_node))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_status(code: Optional[int]) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _reported(reader: Connection) -> str:
    """': <error>' when the rank reported why it stopped, else ''."""
    try:
        return f": {reader.recv()}" if reader.poll() else ""
    except (EOFError, OSError):
        return ""
