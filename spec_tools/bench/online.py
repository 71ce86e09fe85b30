"""Online passes: conversations sent to a running OpenAI-compatible server (`spec serve`, SGLang, vLLM, ...)
through streaming /v1/chat/completions, timed on the client: time to first token, gaps between streamed
chunks, end to end. Token counts come from the stream's usage (requested with include_usage); acceptance
from /get_server_info before and after each pass, where the server has it (spec and SGLang do).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Optional, Sequence

import httpx

from spec_tools.bench import BenchError
from spec_tools.bench.datasets import Conversation
from spec_tools.bench.measure import OnTurn, PassResult, SpecCounts, TurnResult
from spec_tools.bench.offline import sampling_for

CONNECT_TIMEOUT_S = 10.0
# A long prompt on a busy server may take a while before its first byte.
READ_TIMEOUT_S = 600.0


def base_url(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"--url {url!r} must start with http:// or https://, e.g. http://127.0.0.1:30000.")
    return url.removesuffix("/v1")


class OnlineBackend:
    def __init__(self, url: str, name: str, *, concurrency: int, max_new_tokens: int, temperature: float,
                 seed: int = 0, api_key: Optional[str] = None, prediction: bool = False):
        self.url, self.name, self.prediction = base_url(url), name, prediction
        self.concurrency, self.max_new_tokens = concurrency, max_new_tokens
        self.temperature, self.seed = temperature, seed
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = self._model_name()
        self.server_info = self._server_info() or {}

    # ------------------------------------------------------------------ plain requests
    def _get(self, path: str) -> Optional[dict]:
        """GET a JSON document; None when the server has no such route."""
        try:
            r = httpx.get(self.url + path, headers=self.headers, timeout=CONNECT_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise BenchError(f"Cannot reach the server at {self.url} ({type(exc).__name__}: {exc}); start one with "
                             "`spec serve` or check --url.") from None
        if r.status_code == 401:
            raise BenchError(f"{self.url} refused the API key (401); pass the server's key with --api-key.")
        if r.status_code != 200:
            return None
        try:
            return r.json()
        except ValueError:
            return None

    def _model_name(self) -> str:
        models = self._get("/v1/models")
        data = (models or {}).get("data") or []
        if not data:
            raise BenchError(f"{self.url} is not an OpenAI-compatible server: GET /v1/models lists no model.")
        return data[0]["id"]

    def _server_info(self) -> Optional[dict]:
        return self._get("/get_server_info")

    def _counts(self) -> Optional[SpecCounts]:
        info = self._server_info()
        return SpecCounts.from_server_info(info) if info else None

    # ------------------------------------------------------------------ a pass
    def run(self, conversations: Sequence[Conversation], on_turn: OnTurn) -> PassResult:
        before = self._counts()
        t0 = time.perf_counter()
        results = asyncio.run(self._run(conversations, on_turn))
        duration = time.perf_counter() - t0
        after = self._counts()
        measured = after is not None and before is not None and after.verify_ct > before.verify_ct
        return PassResult(results, duration, spec=after - before if measured else None)

    async def _run(self, conversations: Sequence[Conversation], on_turn: OnTurn) -> list[TurnResult]:
        limit = asyncio.Semaphore(self.concurrency)
        results: list[TurnResult] = []
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        async with httpx.AsyncClient(timeout=timeout, headers=self.headers,
                                     limits=httpx.Limits(max_connections=self.concurrency)) as client:
            async def converse(conv: Conversation) -> None:
                async with limit:
                    messages: list[dict] = []
                    for turn, text in enumerate(conv.turns):
                        messages.append({"role": "user", "content": text})
                        result = await self._turn(client, conv, turn, messages)
                        messages.append({"role": "assistant", "content": result.output})
                        results.append(result)
                        on_turn(self.name, result)

            await asyncio.gather(*(converse(c) for c in conversations))
        return results

    async def _turn(self, client: httpx.AsyncClient, conv: Conversation, turn: int, messages: list[dict]) -> TurnResult:
        params = sampling_for(conv, turn, self.max_new_tokens, self.temperature, self.seed, self.prediction)
        body = {"model": self.model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": params["max_new_tokens"], "temperature": params["temperature"], "seed": params["seed"]}
        if "prediction" in params:
            body["prediction"] = {"type": "content", "content": params["prediction"]}
        if params["ignore_eos"]:
            body["ignore_eos"] = True       # SGLang's and vLLM's extension, for fixed output lengths
        text, chunks, usage = [], [], None
        start = time.perf_counter()
        try:
            async with client.stream("POST", self.url + "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:300]
                    raise BenchError(f"{self.url}/v1/chat/completions answered {response.status_code}: {detail}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        raise BenchError(f"{self.url} failed request {conv.id}: {error.get('message', error)}")
                    usage = event.get("usage") or usage
                    delta = "".join((c.get("delta") or {}).get("content") or "" for c in event.get("choices") or ())
                    if delta:
                        text.append(delta)
                        chunks.append(time.perf_counter())
        except httpx.HTTPError as exc:
            raise BenchError(f"Lost the server at {self.url} during request {conv.id} "
                             f"({type(exc).__name__}: {exc}).") from None
        end = time.perf_counter()
        gaps = [b - a for a, b in zip(chunks, chunks[1:])]
        # Without usage (a server ignoring include_usage), each content chunk is counted as one token.
        completion = usage["completion_tokens"] if usage else len(chunks)
        details = (usage or {}).get("completion_tokens_details") or {}
        predicted = ((details["accepted_prediction_tokens"], details["rejected_prediction_tokens"])
                     if "accepted_prediction_tokens" in details else None)
        return TurnResult(conv.id, conv.category, turn, usage["prompt_tokens"] if usage else 0, completion,
                          chunks[0] - start if chunks else None, end - start, gaps, "".join(text),
                          predicted=predicted)
