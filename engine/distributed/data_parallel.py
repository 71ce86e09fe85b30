"""--dp-size N: N replicas of the server on this machine behind sglang-router.

Each replica is a `spec serve` process of its own on a free port of 127.0.0.1 (with its own
--tp-size ranks; on a GPU machine replica i sees GPUs i*tp .. i*tp+tp-1). Once every replica answers
/health, sglang-router (SGLang's router, a separate PyPI package: `pip install sglang-router`, or
spec's `router` extra) starts on --host:--port with their URLs and --router-policy, and this process
watches them all: a replica or the router that exits stops everything, with a message naming it;
SIGTERM or Ctrl-C stops them in order (the router, then the replicas, each given time to finish).
The router forwards the client's Authorization header, so --api-key holds at the replicas; the router
gets the key too, for its own calls to them (/server_info, /model_info).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Optional

import httpx

from engine.config import ServerArgs
from engine.distributed.launch import free_port
from engine.errors import ConfigError

log = logging.getLogger(__name__)

# How long each child gets to exit after SIGTERM before it is killed.
STOP_S = 30.0
_REPLICA = ("import json, sys; from engine.config import ServerArgs; from engine.server import run_server; "
            "run_server(ServerArgs.from_dict(json.loads(sys.argv[1])))")


class Child:
    def __init__(self, name: str, cmd: list[str], env: Optional[dict] = None):
        self.name = name
        # A session of its own: the terminal's Ctrl-C reaches this process only, which stops children in order.
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve_replicas(args: ServerArgs) -> int:
    """Run the replicas and the router until a signal or a failure; the exit status."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ConfigError("--dp-size needs sglang-router, the router the replicas are served behind: "
                          "pip install sglang-router (or spec's extra: pip install 'spec[router]').")
    ports = [free_port() for _ in range(args.dp_size)]
    replicas = [_replica(args, i, port) for i, port in enumerate(ports)]
    children: list[Child] = list(replicas)
    stop = _stop_on_signals()
    try:
        failed = _wait_healthy(replicas, ports, stop)
        if failed is None and not stop.requested:
            urls = [f"http://127.0.0.1:{port}" for port in ports]
            children.insert(0, _router(args, urls))
            failed = _wait_router(children[0], args, stop)
            if failed is None and not stop.requested:
                policy = args.router_policy or "cache_aware"
                print(f"spec serve: ready at http://{args.host}:{args.port} | sglang-router ({policy}) over "
                      f"{args.dp_size} replicas: {', '.join(urls)}", flush=True)
                failed = _watch(children, stop)
    finally:
        for child in children:
            child.stop()
    if failed:
        print(f"error: {failed}; the server stopped", file=sys.stderr, flush=True)
        return 1
    return 0


def _replica(args: ServerArgs, index: int, port: int) -> Child:
    values = dataclasses.asdict(dataclasses.replace(args, dp_size=1, router_policy=None, host="127.0.0.1", port=port))
    env = dict(os.environ)
    if args.device != "cpu" and _gpus():
        env["CUDA_VISIBLE_DEVICES"] = ",".join(_gpus()[index * args.tp_size:(index + 1) * args.tp_size])
    else:   # replicas share the cores, as tensor-parallel ranks do (each would take them all)
        values["num_threads"] = args.num_threads or max(1, (os.cpu_count() or 1) // (args.dp_size * args.tp_size))
    return Child(f"replica {index} (port {port})", [sys.executable, "-c", _REPLICA, json.dumps(values)], env)


def _router(args: ServerArgs, urls: list[str]) -> Child:
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host, "--port", str(args.port),
           "--worker-urls", *urls, "--policy", args.router_policy or "cache_aware",
           "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1",
           "--log-level", "debug" if args.log_level == "debug" else "warn"]   # info traces each registration step
    key = args.api_key or os.environ.get("SPEC_API_KEY")
    if key:
        cmd += ["--api-key", key]
    return Child("sglang-router", cmd)


class _Stop:
    requested = False


def _stop_on_signals() -> _Stop:
    stop = _Stop()

    def handle(*_):
        stop.requested = True

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    return stop


def _exited(children: list[Child]) -> Optional[str]:
    for child in children:
        code = child.proc.poll()
        if code is not None:
            return f"{child.name} exited with status {code}"
    return None


def _wait_healthy(replicas: list[Child], ports: list[int], stop: _Stop) -> Optional[str]:
    """Wait for every replica's /health (model loading takes a while); a replica that exits fails it."""
    pending = set(range(len(replicas)))
    while pending and not stop.requested:
        failed = _exited(replicas)
        if failed:
            return failed
        for i in sorted(pending):
            if _get(f"http://127.0.0.1:{ports[i]}/health") == 200:
                pending.discard(i)
        time.sleep(0.5)
    return None


def _wait_router(router: Child, args: ServerArgs, stop: _Stop) -> Optional[str]:
    while not stop.requested:
        if router.proc.poll() is not None:
            return f"{router.name} exited with status {router.proc.returncode} before it served"
        if _get(f"http://{_connect_host(args.host)}:{args.port}/health") == 200:
            return None
        time.sleep(0.3)
    return None


def _watch(children: list[Child], stop: _Stop) -> Optional[str]:
    while not stop.requested:
        failed = _exited(children)
        if failed:
            return failed
        time.sleep(0.5)
    return None


def _get(url: str) -> Optional[int]:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)


def _gpus() -> list[str]:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES' list when set), for the replicas to split."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]
