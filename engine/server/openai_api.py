"""OpenAI's /v1/chat/completions and /v1/completions: request in, response or SSE chunks out."""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator, Optional, Sequence

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from engine.server import logprobs as lp_format
from engine.server import tool_calls, usage
from engine.server.choice_output import ChoiceParser, Delta
from engine.server.engine_loop import Submission, finish_type
from engine.server.errors import APIError, error_responses
from engine.server.limits import JSONBodyRoute
from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.server.serving import Serving, engine_abort, error_event
from engine.server.tool_calls import ToolFormat

router = APIRouter(route_class=JSONBodyRoute)
# JSON, or server-sent events with "stream": true.
STREAMED = {200: {"content": {"text/event-stream": {}}}}

# Text completions default to 16 tokens, as OpenAI's do; chat runs to the end of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# OpenAI's names for SGLang's sampling parameters, for error messages.
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
# response_format json_object: any JSON object (xgrammar's strict mode would otherwise allow only {}).
ANY_OBJECT = json.dumps({"type": "object", "additionalProperties": True})


@router.post("/v1/chat/completions", responses=STREAMED | error_responses(400, 503))
async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
    serving: Serving = http.app.state.serving
    serving.check_count(body.n, "n")
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
    if body.max_completion_tokens is not None and body.max_tokens is not None:
        serving.check_max_tokens(body.max_tokens, "max_tokens")    # the one not used is still checked
    template_kwargs = body.chat_template_kwargs or {}
    named = body.tool_choice.function.name if body.tool_choice not in (None, "none", "auto", "required") else None
    calls = offered_tool_format(serving, [t.function.name for t in body.tools] if body.tools else None,
                                body.tool_choice, named)
    tools = body.tools if calls else None
    compact = serving.args.constrained_json_disable_any_whitespace
    sampling = body.sampling_params(body.max_completion_tokens or body.max_tokens) | _constraint(body, tools, calls,
                                                                                                 compact)
    sampling = tool_calls.tool_sampling(serving.reasoning_sampling(sampling, template_kwargs), tools)
    offered = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    prompt = await serving.chat_prompt(body.messages, offered, template_kwargs)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    names = {**OPENAI_NAMES, "max_new_tokens": param, "json_schema": "response_format", "structural_tag": "tools"}
    reqs = await serving.make_requests([prompt], sampling, default_max_tokens=serving.context_len, names=names,
                                       http=http, return_logprob=bool(body.logprobs),
                                       top_logprobs_num=body.top_logprobs or 0)
    parsers = [ChoiceParser(serving.reasoning, calls, template_kwargs, body.stream_reasoning,
                            body.separate_reasoning, tools) for _ in reqs]
    shape = _Shape("chatcmpl", "chat.completion", serving, [len(prompt)], bool(body.logprobs), parsers=parsers,
                   reasoning=serving.reasoning is not None and body.separate_reasoning)
    return await _respond(serving, http, reqs, body.stream, body.include_usage, shape, [""] * len(reqs))


def offered_tool_format(serving: Serving, names: Optional[list[str]], choice, named: Optional[str],
                        code: Optional[str] = None) -> Optional[ToolFormat]:
    """The format the model writes tool calls in when a request offers tools (None: it offers none, or
    tool_choice is "none"), after checking the tools' `names` (None: no tools), tool_choice and the
    function it `named` (None: none named); `code`: the route's error code for a bad value. Chat
    completions and the Responses API alike."""
    if not names:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools to choose from.", param="tool_choice", code=code)
        return None
    if choice == "none":
        return None
    calls = tool_calls.tool_format(serving.args.tool_call_parser, getattr(serving.tokenizer.hf, "chat_template", None))
    if calls is None:
        raise APIError(400, f"The model {serving.model_name!r} has no chat template for tools in a format this "
                            "server parses (see --tool-call-parser); leave tools out.", param="tools",
                       code="unsupported_parameter")
    if len(set(names)) < len(names):
        raise APIError(400, "Tool names must be unique.", param="tools", code=code)
    if named is not None and named not in names:
        raise APIError(400, f"tool_choice names {named!r}, which is not among the tools.", param="tool_choice",
                       code=code)
    return calls


def tool_constraint(calls: Optional[ToolFormat], tools: Optional[list], choice, parallel: bool, compact: bool,
                    code: Optional[str] = None) -> dict:
    """The structural tag that tool_choice "required" or a named function holds the answer to, in the
    model's own format `calls` (none for "auto", or without tools), as SGLang sampling params; a format
    that cannot be constrained is a 400 (`code`: the route's)."""
    if not tools or choice in (None, "auto"):
        return {}
    try:
        return {"structural_tag": calls.structural_tag(tools, choice, parallel, compact)}
    except tool_calls.CannotConstrain as exc:
        raise APIError(400, str(exc), param="tool_choice", code=code) from None


def _constraint(body: ChatCompletionRequest, tools: Optional[list], calls: Optional[ToolFormat], compact: bool) -> dict:
    """The grammar that response_format or tool_choice asks for, as SGLang sampling params."""
    fmt, choice = body.response_format, body.tool_choice
    if fmt is None or fmt.type == "text":
        return tool_constraint(calls, tools, choice, body.parallel_tool_calls is not False, compact)
    if tools:
        raise APIError(400, "response_format cannot be combined with tools here: a JSON answer rules out tool "
                            "calls. Pass tool_choice 'none', or leave one of them out.", param="response_format")
    if body.json_schema is not None or body.regex is not None or body.ebnf is not None:
        raise APIError(400, "Pass response_format or one of json_schema, regex and ebnf, not both.",
                       param="response_format")
    if fmt.type == "json_object":
        return {"json_schema": ANY_OBJECT}
    return {"json_schema": json.dumps(fmt.json_schema.schema_)}


@router.post("/v1/completions", responses=STREAMED | error_responses(400, 503))
async def completions(body: CompletionRequest, http: HTTPRequest):
    serving: Serving = http.app.state.serving
    if body.echo and body.logprobs is not None:
        raise APIError(400, "logprobs with echo would need the prompt's logprobs, which this server does not "
                            "compute; drop echo or logprobs.", param="logprobs", code="unsupported_parameter")
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    serving.check_count(len(prompt) * body.n, "n")
    if prompt and isinstance(prompt[0], str):
        prompts = await serving.tokenizer.encode(prompt)
    else:
        prompts = [list(p) for p in prompt]
    reqs = await serving.make_requests(prompts, body.sampling_params(body.max_tokens),
                                       default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS, names=OPENAI_NAMES, http=http,
                                       return_logprob=body.logprobs is not None, top_logprobs_num=body.logprobs or 0)
    echoes = [""] * len(reqs)
    if body.echo:
        texts = prompt if isinstance(prompt[0], str) else await serving.tokenizer.decode(prompts)
        echoes = [texts[i // body.n] for i in range(len(reqs))]
    shape = _Shape("cmpl", "text_completion", serving, [len(p) for p in prompts], body.logprobs is not None)
    return await _respond(serving, http, reqs, body.stream, body.include_usage, shape, echoes)


class _Shape:
    """What differs between chat and text completion responses, and the fields they share. `parsers`: each
    chat choice's ChoiceParser; `reasoning`: chat messages carry reasoning_content."""

    def __init__(self, id_prefix: str, obj: str, serving: Serving, prompt_lens: Sequence[int], logprobs: bool,
                 parsers: Optional[list[ChoiceParser]] = None, reasoning: bool = False):
        self.chat, self.tokenizer, self.logprobs = obj == "chat.completion", serving.tokenizer, logprobs
        self.parsers, self.reasoning = parsers, reasoning
        self.reasoning_end = serving.reasoning_end if self.chat else None     # reasoning tokens end with it
        self.base = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                     "model": serving.model_name}
        self.prompt_tokens = sum(prompt_lens)

    def usage(self, outs: Sequence[Optional[dict]]) -> dict:
        """Over the choices' outputs, with chat's reasoning tokens where the server has a reasoning parser
        (those of the choices whose parser saw a reasoning)."""
        reasoning = None if self.reasoning_end is None else sum(
            usage.reasoning_tokens(o["output_ids"], self.reasoning_end) for o, p in zip(outs, self.parsers)
            if o and p.reasoned)
        return usage.of(self.prompt_tokens, outs, reasoning)

    async def token_logprobs(self, out: dict, start: int, end: int, offset: int) -> Optional[dict]:
        """The choice's logprobs for output tokens start..end (`offset`: where token start's text begins)."""
        if not self.logprobs:
            return None
        texts = await lp_format.texts_for(self.tokenizer, out["meta_info"], start)
        if self.chat:
            return lp_format.chat(out["meta_info"], start, end, texts)
        return lp_format.completion(out["meta_info"], start, end, texts, offset)

    async def choice(self, index: int, text: str, out: dict, echo: str) -> dict:
        reason = out["meta_info"]["finish_reason"]
        finish = reason["type"]
        if self.chat:
            parsed = self.parsers[index].feed(text, final=True)
            message = {"role": "assistant", "content": parsed.content if parsed.content or not parsed.calls else None}
            if self.reasoning:
                message["reasoning_content"] = parsed.reasoning or None
            if parsed.calls:
                message["tool_calls"] = parsed.calls
                finish = "tool_calls" if finish == "stop" else finish
            body = {"message": message}
        else:
            body = {"text": echo + text}
        logprobs = await self.token_logprobs(out, 0, len(out["output_ids"]), len(echo))
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish, "matched_stop": reason.get("matched")}

    def chunk(self, index: int, delta: dict, reason: Optional[str], logprobs: Optional[dict] = None) -> dict:
        """delta: chat's delta fields ({"content": ...}, {"reasoning_content": ...}, {"tool_calls": [...]},
        {"role": ...}), or for text completions {"text": ...}."""
        choice = {"index": index, "delta": delta} if self.chat else {"index": index, "text": delta.get("text", "")}
        return {**self.base, "object": self.base["object"] + (".chunk" if self.chat else ""),
                "choices": [{**choice, "logprobs": logprobs, "finish_reason": reason}]}


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
    choices = [await shape.choice(i, o["text"], o, echoes[i]) for i, o in enumerate(outs)]
    return JSONResponse({**shape.base, "choices": choices, "usage": shape.usage(outs)})


async def _chunks(sub: Submission, shape: _Shape, include_usage: bool, echoes: Sequence[str]) -> AsyncIterator[dict]:
    n = len(sub.rids)
    sent, tokens_sent, calls_sent = [0] * n, [0] * n, [0] * n
    offsets = [len(e) for e in echoes]
    parsers = shape.parsers
    for i, echo in enumerate(echoes):         # opens each choice before the first token arrives
        if shape.chat:
            yield shape.chunk(i, {"role": "assistant", "content": ""}, None)
        elif echo:
            yield shape.chunk(i, {"text": echo}, None)
    async for ready in sub.updates():
        for i in ready:
            out = sub.latest[i]
            err = engine_abort(out)
            if err is not None:
                yield error_event(err)
                return
            text, reason = out["text"], finish_type(out)
            end = len(out["output_ids"])
            logprobs = await shape.token_logprobs(out, tokens_sent[i], end, offsets[i]) if end > tokens_sent[i] else None
            tokens_sent[i] = end
            if shape.chat:
                parsed = parsers[i].feed(text, final=reason is not None)
                reason = "tool_calls" if parsers[i].calls and reason == "stop" else reason
                fields, new = _delta_fields(parsed, calls_sent[i]), parsed.reasoning or parsed.content or parsed.calls
                calls_sent[i] += len(parsed.calls)
            else:
                fields, new, sent[i] = {"text": text[sent[i]:]}, text[sent[i]:], len(text)
                if logprobs:
                    offsets[i] += sum(len(t) for t in logprobs["tokens"])
            if new or reason or logprobs:
                yield shape.chunk(i, fields, reason, logprobs)
    if include_usage:
        yield {**shape.chunk(0, {}, None), "choices": [], "usage": shape.usage(sub.latest)}


def _delta_fields(parsed: Delta, first_call: int) -> dict:
    """A chat chunk's delta: the new reasoning, content (an empty one where nothing else is new, as in
    OpenAI's last chunk) and calls, numbered on from `first_call`."""
    fields = {"reasoning_content": parsed.reasoning} if parsed.reasoning else {}
    if parsed.content or not (parsed.reasoning or parsed.calls):
        fields["content"] = parsed.content
    if parsed.calls:
        fields["tool_calls"] = [{"index": first_call + k, **c} for k, c in enumerate(parsed.calls)]
    return fields
