"""Three maximal request bodies at once against a served tiny model: the worst /health latency and an
innocent request's time to its first token while they are read and parsed, each beside the same figure
in a quiet phase of the same run.

    python benchmarks/bench_big_bodies.py [--mb 16] [--rounds 3] [-- SPEC SERVE FLAGS...]

`spec serve` runs as a child process (the clients' threads would otherwise share its GIL) on a tiny
random model (tests/tiny.py). A big body is one prompt of 6-digit token ids (a 150k vocabulary's) as
/generate's input_ids, as large as --max-request-body-mb lets through: far past the context, so each is
refused with a 400. The innocent request is a 3-token prompt with max_new_tokens 1. The issue's targets
(/health within 100 ms, first token within 3x quiet) are printed beside the figures, as a JSON line.
Run it alone: a busy second process on 2 cores skews every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BODIES = 3
INNOCENT = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
HEALTH_EVERY_S = 0.01


def big_body(mib: int) -> bytes:
    """One prompt of 6-digit token ids, as close under `mib` MiB as whole ids allow."""
    head, tail = b'{"input_ids": [', b'], "sampling_params": {"max_new_tokens": 1}}'
    ids = (mib * 2 ** 20 - len(head) - len(tail) + 2) // 8          # "123456, " per id, the last without ", "
    return head + b", ".join([b"123456"] * ids) + tail


def post_raw(port: int, body: bytes) -> int:
    """POST /generate over a plain socket (sendall leaves the GIL to the other threads); the status."""
    with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1])


class HealthPoller(threading.Thread):
    """GET /health every HEALTH_EVERY_S; each latency with the time it was sent."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.samples, self.stop = url, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=600) as client:
            while not self.stop.is_set():
                sent = time.perf_counter()
                client.get("/health").raise_for_status()
                self.samples.append((sent, time.perf_counter() - sent))
                time.sleep(HEALTH_EVERY_S)

    def worst(self, start: float, end: float) -> float:
        return max((lat for sent, lat in self.samples if start <= sent <= end), default=0.0)


def first_token(client: httpx.Client) -> float:
    """An innocent request's latency: its one token."""
    start = time.perf_counter()
    client.post("/generate", json=INNOCENT).raise_for_status()
    return time.perf_counter() - start


def bodies_at_once(client: httpx.Client, port: int, body: bytes, statuses: list) -> tuple[list[float], float, float]:
    """BODIES big bodies sent at once (their statuses appended to `statuses`), and innocent requests one
    after another until they are answered: those requests' latencies, and when the round began and ended."""
    senders = [threading.Thread(target=lambda: statuses.append(post_raw(port, body))) for _ in range(BODIES)]
    start = time.perf_counter()
    for t in senders:
        t.start()
    latencies = [first_token(client)]
    while any(t.is_alive() for t in senders):
        latencies.append(first_token(client))
    for t in senders:
        t.join()
    return latencies, start, time.perf_counter()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=16, help="--max-request-body-mb of the server (the bodies' size)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of three big bodies")
    p.add_argument("--quiet-requests", type=int, default=20)
    p.add_argument("--port", type=int, default=30125)
    p.add_argument("serve", nargs="*", help="more flags for spec serve (after --)")
    a = p.parse_args()
    from tests.tiny import make_model

    model = make_model(Path(tempfile.mkdtemp()) / "tiny", "llama")
    cmd = ["spec", "serve", "--model-path", str(model), "--dtype", "float32", "--max-total-tokens", "8192",
           "--port", str(a.port), "--max-request-body-mb", str(a.mb), *a.serve]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{a.port}"
    body = big_body(a.mb)
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"spec serve exited with {server.returncode}")
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            statuses = []
            bodies_at_once(client, a.port, body, statuses)      # starts the body parser's children: not measured
            poller = HealthPoller(url)
            poller.start()
            quiet_start = time.perf_counter()
            quiet = [first_token(client) for _ in range(a.quiet_requests)]
            quiet_end = time.perf_counter()
            rounds = [bodies_at_once(client, a.port, body, statuses) for _ in range(a.rounds)]
            poller.stop.set()
            poller.join()
    finally:
        server.terminate()
        server.wait(60)
    health_quiet = poller.worst(quiet_start, quiet_end)
    health_loaded = max(poller.worst(start, end) for _, start, end in rounds)
    loaded = [latency for latencies, _, _ in rounds for latency in latencies]
    summary = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "body_mib": round(len(body) / 2 ** 20, 2), "bodies_at_once": BODIES, "rounds": a.rounds,
        "statuses": sorted(set(statuses)),
        "health_worst_ms_quiet": round(health_quiet * 1000, 1),
        "health_worst_ms_loaded": round(health_loaded * 1000, 1),
        "first_token_ms_quiet": round(statistics.median(quiet) * 1000, 1),
        "first_token_ms_loaded": round(statistics.median(loaded) * 1000, 1),
        "first_token_p99_ms_loaded": round(statistics.quantiles(loaded, n=100)[98] * 1000, 1),
        "first_token_worst_ms_loaded": round(max(loaded) * 1000, 1), "innocent_requests_loaded": len(loaded),
        "first_token_ratio": round(statistics.median(loaded) / statistics.median(quiet), 2),
        "first_token_p99_ratio": round(statistics.quantiles(loaded, n=100)[98] / statistics.median(quiet), 2),
        "first_token_worst_ratio": round(max(loaded) / statistics.median(quiet), 2),
    }
    summary["targets_met"] = summary["health_worst_ms_loaded"] <= 100 and summary["first_token_worst_ratio"] <= 3
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
