"""A live HTTP server on a tiny model, in this process, for the server tests: `serve` starts one on a
free port and yields a `Live` (its URL, engine and metrics); `sse` reads a streaming response."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine, ServerArgs
from engine.server import make_server
from tests.planning import untimed


def sse(response: httpx.Response):
    """The data fields of a streaming response. Keep the iterator while reading: httpx closes the
    connection when it is dropped, which the server rightly takes as a client disconnect."""
    return (line[6:] for line in response.iter_lines() if line.startswith("data: "))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(model_dir, **flags) -> ServerArgs:
    """A tiny model's fp32 server on a free port, named "tiny"."""
    return ServerArgs(model_path=str(model_dir), dtype="float32", max_total_tokens=8192, served_model_name="tiny",
                      port=free_port(), **flags)


class Live:
    def __init__(self, url: str, headers: dict, engine: Engine, server):
        self.url, self.headers, self.engine, self.server = url, headers, engine, server
        self.serving = server.config.app.state.serving

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 60), **kw)

    def metrics(self) -> dict[str, float]:
        """Every sample as 'name{label="value"}' -> value (parsing it is part of the check)."""
        with self.http() as c:
            text = c.get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_metrics(self, ok, timeout: float = 60.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if ok(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


@contextlib.contextmanager
def serve(args: ServerArgs, headers: dict | None = None, planner=untimed):
    """The server of `args`, its drafts sized by a pinned step cost (tests.planning) unless `planner`
    says otherwise: what a test sees must not depend on how fast the machine is."""
    engine = Engine(server_args=args, planner=planner)
    server = make_server(engine, args)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield Live(f"http://127.0.0.1:{server.port}", headers or {}, engine, server)
    finally:
        server.should_exit = True
        thread.join(60)
