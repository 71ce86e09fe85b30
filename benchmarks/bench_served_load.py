"""Served throughput under concurrency: spec serve configurations and llama-server on the same GGUF.

    M=~/.cache/spec-models
    python benchmarks/bench_served_load.py --model $M/qwen2.5-coder-1.5b/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --draft $M/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        [--configs llama-server,plain,NGRAM,STANDALONE] [--concurrency 1,4,8,16,32] [--requests 8] [--rounds 2]

Every server is started first and stays loaded; at each concurrency level they take the same load in
turn, in the listed order and then in reverse, round after round (a pair of rounds also starts from
the next server), so a machine getting busier or quieter during a round favours none of them:
max(--requests, concurrency) chat prompts (MT-Bench first turns and GSM8K questions in turn, fresh at
every level and round: no server gets a prompt it has cached), sent by `concurrency` clients at once,
streamed, greedy, --max-tokens new tokens at most. Reported per level and server: aggregate output
tokens/s (all completion tokens over the wall time from the first request sent to the last answer,
prefill included; median over rounds) and its ratio to spec plain (the median of the ratios paired
round by round, with their range), time to first token and latency p50/p99 over the level's
requests, how many greedy outputs equal spec plain's, and for spec servers the work a token cost: the
rows their decode forwards ran (spec_decode_rows_total) over the tokens generated. Plain decoding runs
one row a token (a little under: the first comes from the prompt's forward); speculation more where
drafts are rejected, fewer where they are accepted; the same where it drafts nothing.

Configurations: `plain` (spec serve's defaults), `NGRAM`, `STANDALONE` (with --draft), `EAGLE3=DIR`
(a head), each with --speculative-adaptive on (the default; `NAME:off` turns it off), and
`llama-server` (--slots slots, continuous batching), built once from the llama.cpp that PyPI's
llama-cpp-python sdist vendors (benchmarks/bench_llamacpp.py). Servers use --threads threads each.
Run it alone on the machine: a second busy process skews every figure, and llama.cpp's threads most.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "benchmarks"))
from bench_llamacpp import build_llama_cpp, cpu_flags  # noqa: E402

DATASETS = HERE.parent / "shared" / "datasets"


# ------------------------------------------------------------------ prompts
def prompt_pool(seed: int) -> list[str]:
    """MT-Bench first turns and GSM8K questions in turn, each set shuffled."""
    mt = [json.loads(line)["turns"][0] for line in (DATASETS / "mt_bench" / "question.jsonl").open()]
    gsm = [json.loads(line)["turns"][0] for line in (DATASETS / "gsm8k" / "question.jsonl").open()]
    rng = random.Random(seed)
    rng.shuffle(mt)
    rng.shuffle(gsm)
    out = []
    for i in range(max(len(mt), len(gsm))):
        out += [p[i] for p in (mt, gsm) if i < len(p)]
    return out


# ------------------------------------------------------------------ servers
class Server:
    def __init__(self, name: str, command: list[str], port: int, model_name: str):
        self.name, self.command, self.port, self.model_name = name, command, port, model_name
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/bench_served_load.{name.replace('/', '_')}.{port}.log", "w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit(f"{self.name} not ready after {timeout:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def spec_server(config: str, model: str, draft: Optional[str], port: int, threads: int) -> Server:
    name, _, adaptive = config.partition(":")
    algo, _, head = name.partition("=")
    command = ["spec", "serve", "--model", model, "--port", str(port), "--num-threads", str(threads),
               "--log-level", "warning"]
    if algo != "plain":
        command += ["--speculative-algorithm", algo, "--speculative-adaptive", adaptive or "on"]
    if algo == "STANDALONE":
        if not draft:
            raise SystemExit("STANDALONE needs --draft GGUF")
        command += ["--speculative-draft-model-path", draft]
    if head:
        command += ["--speculative-draft-model-path", head]
    return Server(config, command, port, "default")


def llama_server(model: str, port: int, threads: int, slots: int, context: int, cache: Path) -> Server:
    bin_dir = build_llama_cpp(cache, ("llama-server",))
    command = [str(bin_dir / "llama-server"), "-m", model, "--port", str(port), "-t", str(threads), "-tb",
               str(threads), "--parallel", str(slots), "-c", str(slots * context), "-ngl", "0", "--no-webui"]
    return Server("llama-server", command, port, "default")


# ------------------------------------------------------------------ load
async def one(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int) -> dict:
    body = {"model": server.model_name, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, chunks, usage = None, [], 0, None
    async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"{server.name}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
                    chunks += 1
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft": (first or end) - start, "latency": end - start, "tokens": tokens, "text": "".join(text)}


async def level(server: Server, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    # A connection per request: llama-server may close a kept-alive one just as it is reused.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800), limits=limits) as client:
        async def limited(p: str) -> dict:
            async with gate:
                return await one(client, server, p, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        wall = time.perf_counter() - start
    return {"wall": wall, "tok_s": sum(r["tokens"] for r in results) / wall, "results": results}


def decode_rows(server: Server) -> Optional[float]:
    """The rows spec serve's decode forwards have run so far (spec_decode_rows_total); None for
    llama-server."""
    if server.name == "llama-server":
        return None
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("spec_decode_rows_total "):
            return float(line.split()[1])
    raise SystemExit(f"{server.name}: /metrics has no spec_decode_rows_total")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# ------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF file every server loads")
    ap.add_argument("--draft", help="GGUF of the STANDALONE draft")
    ap.add_argument("--configs", default="llama-server,plain,NGRAM,STANDALONE")
    ap.add_argument("--concurrency", default="1,4,8,16,32")
    ap.add_argument("--requests", type=int, default=8, help="requests per level at least (concurrency if more)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--slots", type=int, default=8, help="llama-server's parallel slots")
    ap.add_argument("--context", type=int, default=2048, help="llama-server's context per slot")
    ap.add_argument("--port", type=int, default=30200, help="first port; one per server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--llama-cache", type=Path, default=Path.home() / ".cache" / "spec" / "llama.cpp")
    args = ap.parse_args()

    configs = args.configs.split(",")
    if "plain" not in configs:
        raise SystemExit("--configs must include plain: the ratios are against it")
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, flags: {cpu_flags()}")
    print(f"# model {args.model}; {args.threads} threads a server; {args.max_tokens} new tokens at most, greedy, "
          f"streamed; {args.rounds} rounds; llama-server {args.slots} slots")
    servers = []
    try:
        for i, config in enumerate(configs):
            port = args.port + i
            servers.append(llama_server(args.model, port, args.threads, args.slots, args.context, args.llama_cache)
                           if config == "llama-server" else spec_server(config, args.model, args.draft, port,
                                                                         args.threads))
        for s in servers:
            s.wait_ready(900)
        pool = prompt_pool(args.seed)
        report = {}
        for c in levels:
            n = max(args.requests, c)
            runs = {s.name: [] for s in servers}
            for r in range(args.rounds):
                prompts, pool = pool[:n], pool[n:]
                start = r // 2 % len(servers)
                order = servers[start:] + servers[:start]
                order = order if r % 2 == 0 else order[::-1]
                for s in order:
                    before = decode_rows(s)
                    out = asyncio.run(level(s, prompts, c, args.max_tokens))
                    out["rows"] = None if before is None else decode_rows(s) - before
                    runs[s.name].append(out)
                    print(f"  c={c} round {r + 1} {s.name}: {out['tok_s']:.1f} tok/s", flush=True)
            report[c] = summarize(runs)
            print_level(c, n, report[c])
        if args.json:
            args.json.write_text(json.dumps({str(k): v for k, v in report.items()}, indent=1))
    finally:
        for s in servers:
            s.stop()


def summarize(runs: dict[str, list[dict]]) -> dict:
    plain = runs["plain"]
    out = {}
    for name, rounds in runs.items():
        results = [res for run in rounds for res in run["results"]]
        same = sum(a["text"] == b["text"] for run, ref in zip(rounds, plain)
                   for a, b in zip(run["results"], ref["results"]))
        out[name] = {"tok_s": statistics.median(run["tok_s"] for run in rounds),
                     "rounds_tok_s": [run["tok_s"] for run in rounds],
                     "ttft_p50": pct([x["ttft"] for x in results], 0.5),
                     "ttft_p99": pct([x["ttft"] for x in results], 0.99),
                     "lat_p50": pct([x["latency"] for x in results], 0.5),
                     "lat_p99": pct([x["latency"] for x in results], 0.99),
                     "same_as_plain": same, "requests": len(results),
                     "rows_per_token": None if rounds[0]["rows"] is None else
                     sum(run["rows"] for run in rounds) / sum(x["tokens"] for x in results)}
    for name, v in out.items():
        # Paired round by round (same prompts, taken minutes apart at most): the machine's drift between
        # rounds cancels, which a ratio of medians would keep.
        ratios = sorted(run["tok_s"] / ref["tok_s"] for run, ref in zip(runs[name], plain))
        v.update(vs_plain=statistics.median(ratios), vs_plain_min=ratios[0], vs_plain_max=ratios[-1])
    return out


def print_level(c: int, n: int, rows: dict) -> None:
    print(f"\n## concurrency {c} ({n} requests a round)\n")
    print("| server | tok/s | vs plain (rounds' range) | TTFT p50 / p99 s | latency p50 / p99 s | greedy = plain "
          "| decode rows a token |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, v in rows.items():
        work = "" if v["rows_per_token"] is None else f"{v['rows_per_token']:.2f}"
        print(f"| {name} | {v['tok_s']:.1f} | {v['vs_plain']:.2f}x ({v['vs_plain_min']:.2f}-{v['vs_plain_max']:.2f}) | "
              f"{v['ttft_p50']:.2f} / {v['ttft_p99']:.2f} | "
              f"{v['lat_p50']:.1f} / {v['lat_p99']:.1f} | {v['same_as_plain']} of {v['requests']} | {work} |")
    print(flush=True)


if __name__ == "__main__":
    main()
