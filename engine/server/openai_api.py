"""OpenAI's /v1/chat/completions and /v1/completions: request in, response or SSE chunks out."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator, Optional, Sequence

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from engine.server.engine_loop import Submission, finish_type
from engine.server.errors import error_responses
from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.server.serving import Serving, engine_abort, error_event

router = APIRouter()
# JSON, or server-sent events with "stream": true.
STREAMED = {200: {"content": {"text/event-stream": {}}}}

# Text completions default to 16 tokens, as OpenAI's do; chat runs to the end of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# OpenAI's names for SGLang's sampling parameters, for error messages.
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


@router.post("/v1/chat/completions", responses=STREAMED | error_responses(400, 503))
async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
    serving: Serving = http.app.state.serving
    serving.check_body(body)
    serving.check_count(body.n, "n")
    prompt = await serving.chat_prompt(body.messages)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    reqs = serving.make_requests([prompt], body.sampling_params(body.max_completion_tokens or body.max_tokens),
                                 default_max_tokens=serving.context_len,
                                 names={**OPENAI_NAMES, "max_new_tokens": param})
    shape = _Shape("chatcmpl", "chat.completion", serving.model_name, [len(prompt)])
    return await _respond(serving, http, reqs, body.stream, body.include_usage, shape, [""] * len(reqs))


@router.post("/v1/completions", responses=STREAMED | error_responses(400, 503))
async def completions(body: CompletionRequest, http: HTTPRequest):
    serving: Serving = http.app.state.serving
    serving.check_body(body)
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    serving.check_count(len(prompt) * body.n, "n")
    if prompt and isinstance(prompt[0], str):
        prompts = await serving.tokenizer.encode(prompt)
    else:
        prompts = [list(p) for p in prompt]
    reqs = serving.make_requests(prompts, body.sampling_params(body.max_tokens),
                                 default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS, names=OPENAI_NAMES)
    echoes = [""] * len(reqs)
    if body.echo:
        texts = prompt if isinstance(prompt[0], str) else await serving.tokenizer.decode(prompts)
        echoes = [texts[i // body.n] for i in range(len(reqs))]
    shape = _Shape("cmpl", "text_completion", serving.model_name, [len(p) for p in prompts])
    return await _respond(serving, http, reqs, body.stream, body.include_usage, shape, echoes)


class _Shape:
    """What differs between chat and text completion responses, and the fields they share."""

    def __init__(self, id_prefix: str, obj: str, model: str, prompt_lens: Sequence[int]):
        self.chat = obj == "chat.completion"
        self.base = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                     "model": model}
        self.prompt_tokens = sum(prompt_lens)

    def usage(self, outs: Sequence[Optional[dict]]) -> dict:
        done = sum(o["meta_info"]["completion_tokens"] for o in outs if o)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def choice(self, index: int, text: str, out: dict) -> dict:
        reason = out["meta_info"]["finish_reason"]
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": index, **body, "logprobs": None, "finish_reason": reason["type"],
                "matched_stop": reason.get("matched")}

    def chunk(self, index: int, text: Optional[str], reason: Optional[str], role: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        return {**self.base, "object": self.base["object"] + (".chunk" if self.chat else ""),
                "choices": [{**choice, "logprobs": None, "finish_reason": reason}]}


async def _respond(serving: Serving, http: HTTPRequest, reqs, stream: bool, include_usage: bool, shape: _Shape,
                   echoes: Sequence[str]):
    sub = serving.submit(reqs)
    if stream:
        return serving.stream(sub, _chunks(sub, shape, include_usage, echoes))
    outs = await serving.wait(sub, http)
    if outs is None:
        return Response(status_code=499)      # the client is gone; nobody reads this
    for out in outs:
        err = engine_abort(out)
        if err is not None:
            raise err
    choices = [shape.choice(i, echoes[i] + o["text"], o) for i, o in enumerate(outs)]
    return JSONResponse({**shape.base, "choices": choices, "usage": shape.usage(outs)})


async def _chunks(sub: Submission, shape: _Shape, include_usage: bool, echoes: Sequence[str]) -> AsyncIterator[dict]:
    sent = [0] * len(sub.rids)
    for i, echo in enumerate(echoes):         # opens each choice before the first token arrives
        if shape.chat or echo:
            yield shape.chunk(i, echo, None, role=shape.chat)
    async for ready in sub.updates():
        for i in ready:
            out = sub.latest[i]
            err = engine_abort(out)
            if err is not None:
                yield error_event(err)
                return
            text = out["text"]
            delta, sent[i] = text[sent[i]:], len(text)
            reason = finish_type(out)
            if delta or reason:
                yield shape.chunk(i, delta, reason)
    if include_usage:
        yield {**shape.chunk(0, None, None), "choices": [], "usage": shape.usage(sub.latest)}
