"""Soak test for any OpenAI-compatible server: does it ever lie or fall over under mixed, hostile load?

    python benchmarks/soak.py --base-url http://127.0.0.1:30000 [--api-key KEY] [--model NAME]
                              [--concurrency 16] [--minutes 2] [--ignore-eos] [--json out.json]

`--concurrency` clients loop for `--minutes`, each request drawn at random: chat or text completions,
streamed or not, short to long prompts and outputs; some streams are cancelled mid-way, some requests
given up by a short client timeout, and some are poison (the bad inputs of spec's issue 18: strings
for numbers, unbounded top_k, lone surrogates, NUL, malformed JSON), which must get a 4xx. Greedy
requests over a fixed set of prompts are recorded along the way.

Reported: requests by outcome, failures by cause (any 5xx, a 2xx for poison, a stream ending with an
error event or without [DONE], a transport error, no answer or stream event within --request-timeout), p50/p99
latency and time to first token of the served ones. Afterwards: whether the server returns to idle
(no running or queued requests, no KV held; read from /metrics or /get_server_info where the server
is spec), and whether each recorded greedy output equals the same prompt run alone. Exit status 1 if
anything failed. Not a test: it measures a running server and prints figures.

`--adversaries K` runs the soak twice, --minutes each: as above, then with K more clients sending the
worst valid requests in turn (n at --max-n with long outputs, a prompt filling most of the context, a JSON
schema nested to the grammar depth limit) and ~10 MB bodies (refused: 4xx). Reported for both phases:
the other clients' time to first token and `/health` latency (polled every 100 ms), and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import sys
import time
from typing import Optional

import httpx

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "in the old library where speculative drafts are verified one step at a time").split()
# Greedy prompts recorded during the soak and rerun alone afterwards.
GREEDY = ["The capital of France is", "def fibonacci(n):", "List three colours:", "Once upon a time",
          "Explain speculative decoding in one sentence.", "1, 2, 3, 4,", "The opposite of hot is",
          "Translate 'good morning' to French:"]
GREEDY_TOKENS = 32
# Bad inputs a server must refuse with a 4xx: (route, raw JSON body).
POISON = [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "n": "2"}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "top_k": 1e30}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "top_k": 9223372036854775808}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stop": "\\ud800"}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10000000}'),
    ("/v1/chat/completions", '{"messages": []}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"'),
    ("/v1/completions", '{"prompt": "a\\u0000b", "max_tokens": 4}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "seed": "x"}'),
    ("/v1/completions", '{"prompt": [1, 2, -5], "max_tokens": 4}'),
]


def prompt_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Soak:
    def __init__(self, args):
        self.args = args
        self.outcomes: collections.Counter = collections.Counter()
        self.failures: collections.Counter = collections.Counter()
        self.examples: dict[str, str] = {}
        self.latency: list[float] = []
        self.ttft: list[float] = []
        self.slowest: list[tuple[float, str]] = []     # (time to first token, what the stream asked)
        self.greedy_seen: dict[tuple[str, int], set[str]] = collections.defaultdict(set)
        self.health: list[float] = []

    def fail(self, cause: str, detail: str) -> None:
        self.failures[cause] += 1
        self.examples.setdefault(cause, detail[:300])

    def body(self, chat: bool, prompt: str, max_tokens: int, **extra) -> dict:
        body = {"model": self.args.model, "max_tokens": max_tokens, **extra}
        if self.args.ignore_eos:
            body["ignore_eos"] = True
        return body | ({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})

    async def worker(self, client: httpx.AsyncClient, rng: random.Random, deadline: float) -> None:
        while time.monotonic() < deadline:
            kind = rng.choices(["stream", "plain", "cancel", "timeout", "poison", "greedy"],
                               weights=[35, 20, 10, 10, 15, 10])[0]
            try:
                await getattr(self, kind)(client, rng)
            except httpx.TimeoutException as exc:
                self.fail("no answer (or stream event) within --request-timeout", repr(exc))
            except httpx.HTTPError as exc:
                self.fail(f"transport error ({type(exc).__name__})", repr(exc))

    def random_request(self, rng: random.Random, **extra) -> tuple[str, dict]:
        chat = rng.random() < 0.5
        words = rng.choice([5, 20, 100, self.args.max_prompt_words])
        body = self.body(chat, prompt_text(rng, words), rng.choice([1, 16, 64, 128]), **extra)
        return ("/v1/chat/completions" if chat else "/v1/completions"), body

    async def plain(self, client, rng, path_body=None) -> Optional[dict]:
        path, body = path_body or self.random_request(rng, temperature=rng.choice([0.0, 0.7, 1.0]))
        start = time.perf_counter()
        r = await client.post(path, json=body)
        if r.status_code != 200:
            self.fail(f"HTTP {r.status_code}", r.text)
            return None
        self.outcomes["served"] += 1
        self.latency.append(time.perf_counter() - start)
        return r.json()

    async def stream(self, client, rng, cancel_after: Optional[int] = None) -> None:
        path, body = self.random_request(rng, temperature=rng.choice([0.0, 0.7, 1.0]), stream=True,
                                         stream_options={"include_usage": True})
        start, first, events = time.perf_counter(), None, []
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                self.fail(f"HTTP {r.status_code}", (await r.aread()).decode(errors="replace"))
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if first is None and _has_text(events[-1]):
                    first = time.perf_counter()
                if cancel_after is not None and len(events) >= cancel_after:
                    self.outcomes["cancelled by the client"] += 1
                    return              # leaving the block closes the connection mid-stream
        if any(e.startswith('{"error"') for e in events):
            self.fail("stream ended with an error event", next(e for e in events if e.startswith('{"error"')))
        elif not events or events[-1] != "[DONE]":
            self.fail("stream ended without [DONE]", events[-1] if events else "(no events)")
        else:
            self.outcomes["served"] += 1
            self.latency.append(time.perf_counter() - start)
            if first is not None:
                self.ttft.append(first - start)
                prompt = body.get("prompt") or body["messages"][0]["content"]
                self.slowest.append((first - start, f"{path.rsplit('/', 1)[-1]}, {len(prompt.split())} words, "
                                                    f"max_tokens {body['max_tokens']}"))

    async def cancel(self, client, rng) -> None:
        await self.stream(client, rng, cancel_after=rng.randint(1, 4))

    async def timeout(self, client, rng) -> None:
        path, body = self.random_request(rng, temperature=1.0)
        body["max_tokens"] = 256
        try:
            r = await client.post(path, json=body, timeout=rng.uniform(0.2, 2.0))
        except httpx.TimeoutException:
            self.outcomes["given up by a client timeout"] += 1
            return
        if r.status_code == 200:
            self.outcomes["served"] += 1
        else:
            self.fail(f"HTTP {r.status_code}", r.text)

    async def poison(self, client, rng) -> None:
        path, raw = rng.choice(POISON)
        if '"model"' not in raw and raw.startswith("{"):
            raw = '{"model": %s, %s' % (json.dumps(self.args.model), raw[1:])
        r = await client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
        if 400 <= r.status_code < 500:
            self.outcomes["poison refused (4xx)"] += 1
        else:
            self.fail(f"poison answered {r.status_code}", f"{path} {raw}: {r.text}")

    async def greedy(self, client, rng) -> None:
        prompt = rng.choice(GREEDY)
        out = await self.plain(client, rng, ("/v1/completions", self.body(False, prompt, GREEDY_TOKENS,
                                                                          temperature=0.0)))
        if out is not None:
            self.greedy_seen[(prompt, GREEDY_TOKENS)].add(out["choices"][0]["text"])


class Adversary:
    """The worst requests a client may validly send, and bodies too large to parse cheaply, in turn."""

    KINDS = ("many_choices", "long_prompt", "deep_schema", "big_body")

    def __init__(self, soak: Soak, context_len: int):
        self.soak, self.args, self.context_len = soak, soak.args, context_len

    async def worker(self, client: httpx.AsyncClient, rng: random.Random, deadline: float) -> None:
        while time.monotonic() < deadline:
            kind = rng.choice(self.KINDS)
            try:
                r = await getattr(self, kind)(client)
            except httpx.HTTPError as exc:
                self.soak.fail(f"adversary {kind}: transport error ({type(exc).__name__})", repr(exc))
                continue
            ok = 400 <= r.status_code < 500 if kind == "big_body" else r.status_code == 200
            if ok:
                self.soak.outcomes[f"adversary {kind}: {'refused (4xx)' if kind == 'big_body' else 'served'}"] += 1
            else:
                self.soak.fail(f"adversary {kind}: HTTP {r.status_code}", r.text)

    def chat(self, content: str, **extra) -> dict:
        return {"model": self.args.model, "messages": [{"role": "user", "content": content}], **extra}

    async def many_choices(self, client):
        return await client.post("/v1/chat/completions", json=self.chat(
            "Write a long story.", n=self.args.max_n, max_tokens=200, temperature=1.0, ignore_eos=True))

    async def long_prompt(self, client):
        # A word of WORDS is about 1.3 tokens: most of the context, room left for the answer.
        words = int(self.context_len * 0.6)
        return await client.post("/v1/completions", json={"model": self.args.model, "max_tokens": 16,
                                                           "prompt": prompt_text(random.Random(words), words)})

    async def deep_schema(self, client):
        schema: dict = {"type": "string"}
        for _ in range(self.args.schema_depth):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        return await client.post("/v1/chat/completions", json=self.chat(
            "Answer in JSON.", max_tokens=16, response_format={
                "type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}))

    async def big_body(self, client):
        return await client.post("/v1/completions", json={"model": self.args.model, "max_tokens": 1,
                                                           "prompt": list(range(1_500_000))})


async def probe_health(client: httpx.AsyncClient, soak: Soak, deadline: float) -> None:
    while time.monotonic() < deadline:
        start = time.perf_counter()
        await client.get("/health")
        soak.health.append(time.perf_counter() - start)
        await asyncio.sleep(0.1)


def _has_text(event: str) -> bool:
    """Whether a chunk carries generated text (a chat stream opens with a chunk holding only the role)."""
    choices = json.loads(event).get("choices") if event.startswith("{") else None
    return bool(choices) and bool(choices[0].get("text") or (choices[0].get("delta") or {}).get("content"))


async def idle_after(client: httpx.AsyncClient, timeout: float) -> str:
    """Waits for the server (spec) to hold no requests and no KV; says what it found."""
    deadline, last = time.monotonic() + timeout, "unknown"
    while time.monotonic() < deadline:
        r = await client.get("/get_server_info")
        if r.status_code != 200 or "kv_tokens_used" not in r.text:
            return "not checked: the server has no spec /get_server_info"
        info = r.json()
        m = await client.get("/metrics")
        queued = next((float(x.split()[-1]) for x in m.text.splitlines() if x.startswith("spec_num_queue_reqs ")), 0)
        last = (f"running {info['num_running_reqs']}, waiting {info['num_waiting_reqs']}, queued {queued:g}, "
                f"KV used {info['kv_tokens_used']} of {info['kv_tokens_total']} (cached prefixes "
                f"{info['kv_tokens_cached']})")
        if info["num_running_reqs"] == info["num_waiting_reqs"] == queued == info["kv_tokens_used"] == 0:
            return f"idle: {last}"
        await asyncio.sleep(0.5)
    return f"NOT idle after {timeout:g} s: {last}"


def pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    return f"{statistics.quantiles(values, n=100, method='inclusive')[q - 1]:.2f} s" if len(values) > 1 \
        else f"{values[0]:.2f} s"


async def run_phase(client: httpx.AsyncClient, args, adversaries: int, context_len: int,
                    seed: int) -> tuple[Soak, float]:
    soak = Soak(args)
    start = time.monotonic()
    deadline = start + args.minutes * 60
    adversary = Adversary(soak, context_len)
    await asyncio.gather(probe_health(client, soak, deadline),
                         *(soak.worker(client, random.Random(seed * 1000 + i), deadline)
                           for i in range(args.concurrency)),
                         *(adversary.worker(client, random.Random(seed * 1000 + 500 + i), deadline)
                           for i in range(adversaries)))
    return soak, time.monotonic() - start


def report(soak: Soak, elapsed: float, args, title: str) -> int:
    total = sum(soak.outcomes.values()) + sum(soak.failures.values())
    print(f"{title}: {args.concurrency} clients for {elapsed:.0f} s, {total} requests ({total / elapsed:.1f}/s)")
    for outcome, n in soak.outcomes.most_common():
        print(f"  {outcome}: {n}")
    print(f"  failed: {sum(soak.failures.values())}")
    for cause, n in soak.failures.most_common():
        print(f"    {cause}: {n}   e.g. {soak.examples[cause]}")
    print(f"  latency of served requests: p50 {pct(soak.latency, 50)}, p99 {pct(soak.latency, 99)}; "
          f"time to first token (streams): p50 {pct(soak.ttft, 50)}, p99 {pct(soak.ttft, 99)}")
    slowest = sorted(soak.slowest, reverse=True)[:3]
    print("  slowest first tokens: " + "; ".join(f"{t:.2f} s ({what})" for t, what in slowest))
    print(f"  /health: p50 {pct(soak.health, 50)}, p99 {pct(soak.health, 99)}, worst "
          f"{max(soak.health, default=0):.3f} s ({len(soak.health)} probes)")
    return sum(soak.failures.values())


async def main(args) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + args.adversaries + 8)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.request_timeout,
                                 limits=limits) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        args.model = args.model or card["id"]
        context_len = card.get("max_model_len") or 2048
        phases = [("without adversaries", 0)] + ([(f"with {args.adversaries} adversaries", args.adversaries)]
                                                 if args.adversaries else [])
        results = []
        for i, (title, k) in enumerate(phases):
            soak, elapsed = await run_phase(client, args, k, context_len, args.seed + i)
            results.append((title, soak, elapsed))
        idle = await idle_after(client, 120.0)
        seen: dict = collections.defaultdict(set)
        for _, soak, _ in results:
            for key, texts in soak.greedy_seen.items():
                seen[key] |= texts
        mismatches = []
        for (prompt, tokens), texts in sorted(seen.items()):
            body = results[0][1].body(False, prompt, tokens, temperature=0.0)
            alone = await client.post("/v1/completions", json=body)
            text = alone.json()["choices"][0]["text"] if alone.status_code == 200 else f"HTTP {alone.status_code}"
            if texts != {text}:
                mismatches.append((prompt, sorted(texts), text))

    failed = sum(report(soak, elapsed, args, f"{args.base_url} model {args.model}, {title}")
                 for title, soak, elapsed in results)
    if len(results) == 2:
        (_, calm, _), (_, hostile, _) = results
        ratio = (float(pct(hostile.ttft, 99).split()[0]) / float(pct(calm.ttft, 99).split()[0])
                 if calm.ttft and hostile.ttft else float("nan"))
        print(f"time to first token p99 with adversaries / without: {ratio:.2f}x")
    print(f"after the soak: {idle}")
    distinct = sum(len(s) for s in seen.values())
    print(f"greedy outputs equal to the same prompt alone: {len(seen) - len(mismatches)} of {len(seen)} prompts "
          f"({distinct} distinct outputs seen)")
    for prompt, texts, alone in mismatches:
        print(f"    {prompt!r}: under load {texts}, alone {alone!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({title: {"seconds": elapsed, "outcomes": soak.outcomes, "failures": soak.failures,
                               "examples": soak.examples, "latency_s": soak.latency, "ttft_s": soak.ttft,
                               "health_s": soak.health} for title, soak, elapsed in results}
                      | {"idle": idle, "greedy_mismatches": mismatches}, f, indent=1)
    return 1 if failed or mismatches or idle.startswith("NOT") else 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--api-key")
    p.add_argument("--model", help="default: the first model /v1/models lists")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--max-prompt-words", type=int, default=600, help="longest prompts drawn (words)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="a normal request (or stream event) not answered after this many seconds fails")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (SGLang, vLLM): outputs run to max_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adversaries", type=int, default=0,
                   help="a second phase with this many clients sending the worst valid requests (see above)")
    p.add_argument("--max-n", type=int, default=16,
                   help="n of the adversaries' many-choices request (the server's --max-n)")
    p.add_argument("--schema-depth", type=int, default=31,
                   help="objects nested in the adversaries' JSON schema (two JSON levels each, plus one: "
                        "spec refuses past 64 levels)")
    p.add_argument("--json", help="also write the figures to this file")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
