"""Serving: what every generation route shares. Turn a validated body into engine Requests (all checks
happen here, on the HTTP side, so a bad request is a 400 before it reaches the engine), submit them,
then wait for them or stream them, aborting whatever is left when the client goes away.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import AsyncIterator, Optional, Sequence, Union

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from engine.config import ServerArgs
from engine.engine import Engine
from engine.errors import RequestError
from engine.core.request import Request
from engine.core.sampling_params import CONSTRAINTS, SamplingParams
from engine.server.engine_loop import SHUTTING_DOWN, EngineLoop, Submission, finish_type
from engine.server.errors import APIError, error_body
from engine.server.metrics import ServerMetrics
from engine.server.protocol import ChatMessage
from engine.server.reasoning import reasoning_format
from engine.server.tokenize import Tokenizer

log = logging.getLogger(__name__)


class Serving:
    def __init__(self, engine: Engine, args: ServerArgs):
        # The engine's copy of the flags: resolved against the model (the tree chosen when left to auto).
        self.engine, self.args = engine, engine.args
        args = engine.args
        self.model_name = args.served_model_name or os.path.basename(str(args.model_path).rstrip("/"))
        self.context_len = engine.context_len
        self.tokenizer = Tokenizer(engine.tokenizer, self.context_len)
        if args.chat_template:          # checked when the flags were (engine/config.py)
            self.tokenizer.hf.chat_template = Path(args.chat_template).read_text(encoding="utf-8")
        self.reasoning = reasoning_format(args.reasoning_parser)
        # Where a grammar starts in the output of a request that thinks (SamplingParams.reasoning_end).
        self.reasoning_end = tuple(self.tokenizer.hf.encode(self.reasoning.end, add_special_tokens=False)) \
            if self.reasoning else None
        if self.reasoning_end and len(self.reasoning_end) > 1:
            log.warning("--reasoning-parser %s: %r is %d tokens for this tokenizer, not one as in the models it is "
                        "for; a grammar starts only where the output spells it in exactly these tokens",
                        self.reasoning.name, self.reasoning.end, len(self.reasoning_end))
        self.api_key = args.api_key or os.environ.get("SPEC_API_KEY") or None
        self.loop = EngineLoop(engine)
        tree = args.speculative_tree
        self.metrics = ServerMetrics(lambda: self.loop.snapshot, lambda: self.loop.queued, tree[2] if tree else None)
        self.loop.on_output = self.metrics.observe     # the metrics read the loop's figures, and it feeds them

    # ------------------------------------------------------------------ checks and request building
    def check_model(self, model: str) -> None:
        """For GET /v1/models/{model}: any other name than the served model's (or its --model-path) is a 404."""
        if model is not None and model not in (self.model_name, self.args.model_path):
            raise APIError(404, f"The model {model!r} does not exist; this server serves {self.model_name!r}.",
                           param="model", code="model_not_found")

    def check_count(self, generations: int, param: str) -> None:
        """Before any tokenizing: a request asking for more generations than the queue holds is refused."""
        if generations > self.args.max_queued_requests:
            raise APIError(400, f"This request asks for {generations} generations (n x prompts) but the queue holds "
                                f"{self.args.max_queued_requests} (--max-queued-requests).", param=param)

    async def chat_prompt(self, messages: Sequence[ChatMessage], tools: Optional[list[dict]] = None,
                          template_kwargs: Optional[dict] = None) -> list[int]:
        """The chat template over the messages (and the tools offered, and the request's
        chat_template_kwargs), with the assistant turn opened."""
        if not getattr(self.tokenizer.hf, "chat_template", None):
            raise APIError(400, f"The model {self.model_name!r} has no chat template; use /v1/completions with "
                                "a plain prompt.", param="messages")
        turns = []
        for m in messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(p.text for p in content)
            turn = {"role": m.role, "content": content or ""} | ({"name": m.name} if m.name else {})
            if m.tool_calls:
                turn["tool_calls"] = [_template_call(c) for c in m.tool_calls]
            if m.tool_call_id is not None:
                turn["tool_call_id"] = m.tool_call_id
            turns.append(turn)
        return await self.tokenizer.encode_chat(turns, param="messages", tools=tools, template_kwargs=template_kwargs)

    def reasoning_sampling(self, sampling: dict, template_kwargs: dict) -> dict:
        """A chat request's sampling params as the reasoning parser needs them: its markers kept in the
        text where they are special tokens, and a grammar (of any kind) starting where the reasoning ends,
        so that it constrains the answer, not the thinking (in requests that think)."""
        if self.reasoning is None:
            return sampling
        sampling = {**sampling, "skip_special_tokens": False} if self.reasoning.special_markers else sampling
        if self.reasoning.thinks(template_kwargs) and any(sampling.get(k) is not None for k in CONSTRAINTS):
            sampling = {**sampling, "reasoning_end": self.reasoning_end}
        return sampling

    async def make_requests(self, prompts: Sequence[Sequence[int]], sampling: Union[dict, list[dict]], *,
                            default_max_tokens: int, names: Optional[dict[str, str]] = None,
                            http: Optional[HTTPRequest] = None, **options) -> list[Request]:
        """Requests for each prompt times `n` (choice k of a seeded request samples with
        a seed of its own, sampling.choice_seed).
        `sampling` holds SGLang sampling_params, one dict for all prompts or one per prompt; `names` maps
        their names to the route's own (max_new_tokens -> max_tokens) for error messages; `options`
        are Engine.make_request's (return_logprob, top_logprobs_num). Grammars compile in the compiler
        process (engine/core/grammar_worker.py), waited for off the event loop, and stopped when the `http`
        client goes away (CompileCancelled)."""
        names = names or {}
        if not prompts:
            raise RequestError("The prompt is empty; pass some text or token ids.")
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(samplings) != len(prompts):
            raise RequestError(f"Got {len(samplings)} sampling_params for {len(prompts)} prompts.", "sampling_params")
        plan = []
        for ids, values in zip(prompts, samplings):
            given = values.get("max_new_tokens") is not None
            values = {**values, "max_new_tokens": values["max_new_tokens"] if given else default_max_tokens}
            try:
                params = SamplingParams.from_dict(values)
            except RequestError as exc:
                raise _renamed(exc, names) from None
            self._check_fits(ids)
            if given:
                self.check_max_tokens(params.max_new_tokens, names.get("max_new_tokens", "max_new_tokens"))
            if params.n > self.args.max_n:
                raise APIError(400, f"n is {params.n}, more choices than this server gives one request "
                                    f"({self.args.max_n}, --max-n).", param=names.get("n", "n"))
            plan.append((list(ids), params))
        self.check_count(sum(params.n for _, params in plan), "n")
        base = uuid.uuid4().hex[:16]
        reqs = []
        for i, (ids, params) in enumerate(plan):
            try:
                grammar = await self._compile(params, http) if params.constraint else None
                reqs += self.engine.make_choices(ids, params, rid=f"{base}-{i}", grammar=grammar, group=base,
                                                 **options)
            except RequestError as exc:
                raise _renamed(exc, names) from None
        return reqs

    async def _compile(self, params: SamplingParams, http: Optional[HTTPRequest]):
        """The request's grammar, compiled on a worker thread that waits for the compiler process; the
        client's leaving first stops the compile (CompileCancelled)."""
        gone = threading.Event()
        compiling = asyncio.ensure_future(asyncio.to_thread(self.engine.compile_grammar, params, gone.is_set))
        watch = asyncio.ensure_future(_disconnected(http)) if http is not None else None
        try:
            await asyncio.wait({compiling} | ({watch} if watch else set()), return_when=asyncio.FIRST_COMPLETED)
            if not compiling.done():
                gone.set()
            return await compiling
        finally:
            if watch is not None:
                watch.cancel()

    def check_max_tokens(self, max_tokens: int, param: str) -> None:
        # Past what the prompt leaves of the context, the answer ends there ("length"), as llama.cpp's
        # does; only a value past the whole context is a mistake (openapi.json says so too).
        if max_tokens > self.context_len:
            raise APIError(400, f"{param} is {max_tokens}, more than the context length {self.context_len}. "
                                f"Lower {param}.", param=param, code="context_length_exceeded")

    def _check_fits(self, ids: list[int]) -> None:
        if len(ids) >= self.context_len:
            raise APIError(400, f"The prompt has {len(ids)} tokens but the context length is {self.context_len}; "
                                "shorten it.", code="context_length_exceeded")
        pool = self.engine.kv_capacity
        if len(ids) + 1 > pool:
            raise APIError(400, f"The prompt has {len(ids)} tokens but the KV cache holds {pool}.",
                           code="context_length_exceeded")

    # ------------------------------------------------------------------ running requests
    def submit(self, reqs: Sequence[Request]) -> Submission:
        if not self.loop.alive:
            raise APIError(503, "The server is shutting down." if self.loop.stopping else
                                "The engine has stopped after a failure; see the server log.",
                           headers={"Retry-After": "5"})
        if self.loop.queued + len(reqs) > self.args.max_queued_requests:
            raise APIError(503, f"The server queue is full ({self.loop.queued} requests waiting); retry shortly.",
                           code="queue_full", headers={"Retry-After": "1"})
        self.metrics.prompt_tokens.inc(sum(r.prompt_len for r in reqs))
        return self.loop.submit(reqs)

    async def wait(self, sub: Submission, http: HTTPRequest) -> Optional[list[dict]]:
        """Every final output, or None when the client disconnected first (its requests are aborted)."""
        waiter = asyncio.ensure_future(sub.wait())
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            finished = waiter.done()
            if not finished:
                waiter.cancel()
                self.loop.abort(sub.unfinished())
        return waiter.result() if finished else None

    def stream(self, sub: Submission, events: AsyncIterator[dict], named: bool = False) -> StreamingResponse:
        """Server-sent events, then `data: [DONE]`; or, `named`, each under its type (an `event:` line
        before its data) and no [DONE], as OpenAI's Responses API streams. A client that disconnects
        aborts what is left."""
        def sse(data: dict, name: Optional[str]) -> str:
            return (f"event: {name}\n" if named else "") + f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        async def body():
            try:
                async for event in events:
                    yield sse(event, event.get("type"))
            except Exception as exc:    # a bug: the stream's status is sent already, so it ends with an error event
                log.exception("internal error while streaming")
                err = APIError(500, f"Internal server error ({type(exc).__name__}); see the server log.")
                yield sse(error_event(err), "error")
            finally:
                self.loop.abort(sub.unfinished())
            if not named:
                yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def engine_abort(out: dict) -> Optional[APIError]:
    """An engine-side abort as the error to answer with, by the status the engine gave it: 500 when the
    engine failed on the request, 400 when it cannot be served as sent, else 503 (shutting down, or the
    KV cache cannot hold it now)."""
    if finish_type(out) != "abort":
        return None
    reason = out["meta_info"]["finish_reason"]
    message = reason.get("message") or "the request was aborted"
    status = reason.get("status_code") or 503
    if status == 500:
        return APIError(500, f"The request could not be completed: {message}.", code="internal_error")
    if status == 400:
        return APIError(400, f"The request cannot be served: {message}.", code="invalid_request")
    return APIError(503, f"The request could not be completed: {message}.", code="aborted",
                    headers={"Retry-After": "5"} if message == SHUTTING_DOWN else None)


def error_event(err: APIError) -> dict:
    return error_body(err.status, err.message, err.param, err.code)


async def _disconnected(http: HTTPRequest) -> None:
    """Returns once the client has closed the connection (the body has been read already)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _renamed(exc: RequestError, names: dict[str, str]) -> RequestError:
    """A sampling-parameter error told in the route's own parameter names."""
    if exc.param not in names:
        return exc
    return RequestError(str(exc).replace(exc.param, names[exc.param], 1), names[exc.param])


def _template_call(call) -> dict:
    """An OpenAI tool call as chat templates read it: arguments as an object where they are a JSON object.
    Else they stay text, as the model wrote them: OpenAI takes back whatever a model generated."""
    try:
        arguments = json.loads(call.function.arguments)
    except (ValueError, RecursionError):        # not JSON, or nested past the parser
        arguments = None
    if not isinstance(arguments, dict):
        arguments = call.function.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
