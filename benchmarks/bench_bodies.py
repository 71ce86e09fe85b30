"""Large request bodies against a running server: each body's status and time, and the worst `/health`
latency while it is read, parsed and validated (polled every 10 ms from another thread).

    python benchmarks/bench_bodies.py [--model smollm2-135m]

Bodies: 200,000 chat messages (6.7 MB), and 2,000,000 token ids to /generate and /v1/completions
(16 MB with JSON, past the 16 MiB default body limit). Run it alone: a busy second process on 2 cores
skews every figure.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx

from engine.config import ServerArgs
from engine.engine import Engine
from engine.loader.fetch import fetch_model
from engine.server import make_server

PORT = 30123
BODIES = {
    "200k chat messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 200_000,
                                                    "max_tokens": 1}),
    "2M token ids to /generate": ("/generate", {"input_ids": list(range(2_000_000)),
                                               "sampling_params": {"max_new_tokens": 1}}),
    "2M token ids to /v1/completions": ("/v1/completions", {"prompt": list(range(2_000_000)), "max_tokens": 1}),
}


def worst_health(url: str, stop: threading.Event, worst: list[float]) -> None:
    with httpx.Client() as client:
        while not stop.is_set():
            start = time.perf_counter()
            client.get(url + "/health")
            worst[0] = max(worst[0], time.perf_counter() - start)
            time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    args = ServerArgs(model_path=str(fetch_model(ap.parse_args().model)), port=PORT)
    server = make_server(Engine(server_args=args), args)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{PORT}"
    for name, (route, body) in BODIES.items():
        content = json.dumps(body)
        stop, worst = threading.Event(), [0.0]
        poller = threading.Thread(target=worst_health, args=(url, stop, worst))
        poller.start()
        time.sleep(0.3)
        start = time.perf_counter()
        r = httpx.post(url + route, content=content, headers={"content-type": "application/json"}, timeout=120)
        took = time.perf_counter() - start
        time.sleep(0.3)
        stop.set()
        poller.join()
        print(f"{name} ({len(content) / 2 ** 20:.1f} MiB): {r.status_code} in {took:.2f} s; worst /health "
              f"{worst[0] * 1000:.0f} ms; {r.json()['error']['message'][:100] if r.is_error else ''}", flush=True)
    server.should_exit = True


if __name__ == "__main__":
    main()
