"""The first minute of a server: time until /health turns 200, then the latency of the first requests
(different prompts of one length, so that no prefix is cached), each against the one after it.

    python benchmarks/bench_first_request.py [--fresh] [-- SPEC SERVE FLAGS...]

`spec serve` runs as a child process with the given flags (default model: smollm2-135m). --fresh starts
it with empty kernel and conversion caches (SPEC_KERNEL_CACHE, SPEC_CACHE_DIR in a temporary folder), as
on a machine that never ran spec: conversion and kernel builds then count in the time to ready. Run it
alone: a busy second process on 2 cores skews every figure.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

PROMPTS = ["Write a haiku about the sea.", "Write a haiku about a tree.", "Write a haiku about the moon.",
           "Write a haiku about a city.", "Write a haiku about the rain."]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fresh", action="store_true", help="empty kernel and conversion caches")
    p.add_argument("--port", type=int, default=30124)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("serve", nargs="*", help="flags for spec serve (after --)")
    a = p.parse_args()
    env = dict(os.environ)
    tmp = tempfile.TemporaryDirectory()
    if a.fresh:
        env |= {"SPEC_KERNEL_CACHE": f"{tmp.name}/kernels", "SPEC_CACHE_DIR": f"{tmp.name}/cache"}
    cmd = ["spec", "serve", "--port", str(a.port), *a.serve]
    start = time.perf_counter()
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{a.port}"
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            while True:
                if server.poll() is not None:
                    print(server.stdout.read())
                    return 1
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            ready = time.perf_counter() - start
            latencies = []
            for prompt in PROMPTS:
                t = time.perf_counter()
                r = client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": prompt}], "max_tokens": a.max_tokens,
                    "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                latencies.append(time.perf_counter() - t)
    finally:
        server.terminate()
        log = server.communicate(timeout=60)[0]
    kernels = next((line.split("INFO ", 1)[-1] for line in log.splitlines() if "CPU kernels built" in line), "-")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {' '.join(cmd)}"
          f"{' (fresh caches)' if a.fresh else ''}")
    print(f"# {kernels}")
    print(f"ready after {ready:.1f} s")
    print("request latencies: " + ", ".join(f"{x:.3f} s" for x in latencies))
    print(f"first / second: {latencies[0] / latencies[1]:.2f}x; first / median of the rest: "
          f"{latencies[0] / statistics.median(latencies[1:]):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
