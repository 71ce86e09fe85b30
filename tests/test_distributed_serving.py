"""`spec serve` beyond one process, over loopback: tensor-parallel ranks and data-parallel replicas.

- A tensor-parallel rank that dies stops the server: it exits with status 1 and a line naming the rank.
- --dp-size 2 behind sglang-router: concurrent OpenAI and SGLang-native requests are answered through
  the router, both replicas serve some, and /v1/models names the model.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.serving import free_port
from tests.tiny import make_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("model"), "llama", seed=3)


@contextlib.contextmanager
def serving(model_dir, ready_timeout: float = 120, **flags):
    """`run_server` in a child process; yields (process, URL) once its ready line is out."""
    port = free_port()
    values = dict(model_path=str(model_dir), dtype="float32", max_total_tokens=2048, port=port, log_level="warning",
                  **flags)
    code = f"from engine import ServerArgs; from engine.server import run_server; run_server(ServerArgs(**{values!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + ready_timeout
        line = ""
        while not line.startswith(f"spec serve: ready at http://127.0.0.1:{port}") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()
        yield proc, f"http://127.0.0.1:{port}", line
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_a_rank_that_dies_stops_the_server(model_dir):
    with serving(model_dir, tp_size=2) as (proc, url, _):
        body = {"prompt": "one two", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        rank = next(p for p in psutil.Process(proc.pid).children()
                    if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline()))
        rank.kill()
        assert proc.wait(30) == 1
        err = proc.stderr.read()
    assert "error: tensor parallelism stopped: rank 1 was killed by signal SIGKILL; the server stopped" in err


def test_replicas_behind_the_router_share_concurrent_requests(model_dir):
    pytest.importorskip("sglang_router")
    with serving(model_dir, dp_size=2, router_policy="round_robin") as (proc, url, ready):
        replicas = ready.split("replicas: ")[1].strip().split(", ")
        requests = [("/v1/completions", {"model": "any", "prompt": f"count {i}", "max_tokens": 4}) for i in range(4)]
        requests += [("/v1/chat/completions", {"model": "any", "messages": [{"role": "user", "content": f"hi {i}"}],
                                               "max_tokens": 4}) for i in range(2)]
        requests += [("/generate", {"text": f"abc {i}", "sampling_params": {"max_new_tokens": 4}}) for i in range(2)]
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            answers = list(pool.map(lambda r: httpx.post(url + r[0], json=r[1], timeout=60), requests))
        assert [a.status_code for a in answers] == [200] * len(requests), [a.text for a in answers]
        assert all(a.json()["choices"] for a in answers[:6]) and all(a.json()["output_ids"] for a in answers[6:])
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]] == [model_dir.name]
        served = [httpx.get(f"{r}/get_server_info", timeout=10).json()["prefill_tokens"] for r in replicas]
        assert len(served) == 2 and all(n > 0 for n in served)
    assert proc.returncode == 0


def test_two_nodes_over_loopback(model_dir):
    """--nnodes 2: node 1's `spec serve --node-rank 1` runs rank 1 and follows node 0's engine; it exits
    when node 0 shuts down."""
    from engine import Engine
    from tests.lossless import GREEDY

    addr = f"127.0.0.1:{free_port()}"
    flags = ["--model", str(model_dir), "--dtype", "float32", "--max-total-tokens", "2048", "--tp-size", "2",
             "--nnodes", "2", "--dist-init-addr", addr, "--log-level", "warning"]
    node1 = subprocess.Popen([sys.executable, "-c", "from spec_cli.main import app; app()", "serve", *flags,
                              "--node-rank", "1"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        kw = dict(model_path=str(model_dir), dtype="float32", max_total_tokens=2048)
        with Engine(**kw) as one:
            want = one.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY)["output_ids"]
        with Engine(**kw, tp_size=2, nnodes=2, dist_init_addr=addr) as two:
            assert two.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY)["output_ids"] == want
        assert node1.wait(30) == 0, node1.stderr.read()
        assert node1.stdout.readline().startswith(f"spec serve: node 1 runs ranks 1-1, following rank 0 at {addr}")
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
