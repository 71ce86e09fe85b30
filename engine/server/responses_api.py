"""OpenAI's Responses API, POST /v1/responses: the conversation goes through the chat template and is
generated as a chat completion is; the answer is a response object whose output items (reasoning, a
message, function calls) are built as the text grows, and streamed as OpenAI's numbered events."""

from __future__ import annotations

import copy
import json
import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from engine.core.sampling_params import SamplingParams
from engine.server import tool_calls, usage
from engine.server.choice_output import ChoiceParser, Delta
from engine.server.engine_loop import Submission, finish_type
from engine.server.errors import APIError, error_responses
from engine.server.limits import JSONBodyRoute
from engine.server.openai_api import ANY_OBJECT, STREAMED, offered_tool_format, tool_constraint
from engine.server.protocol import Tool
from engine.server.responses_protocol import FunctionChoice, ResponsesRequest
from engine.server.serving import Serving, engine_abort
from engine.server.tool_calls import ToolFormat

router = APIRouter(route_class=JSONBodyRoute)

# The Responses API's names for SGLang's sampling parameters, for error messages.
NAMES = {"max_new_tokens": "max_output_tokens", "json_schema": "text.format", "structural_tag": "tools"}


@router.post("/v1/responses", responses=STREAMED | error_responses(400, 503))
async def create_response(body: ResponsesRequest, http: HTTPRequest):
    """A model response to `input` (text, or a conversation of message and function-call items), whole
    or, with `"stream": true`, as server-sent events. Nothing is stored."""
    serving: Serving = http.app.state.serving
    template_kwargs = body.chat_template_kwargs or {}
    calls = offered_tool_format(serving, [t.name for t in body.tools] if body.tools else None, body.tool_choice,
                                body.tool_choice.name if isinstance(body.tool_choice, FunctionChoice) else None,
                                code="invalid_value")
    tools = body.chat_tools() if calls else None
    sampling = body.sampling_params() | _constraint(body, tools, calls,
                                                    serving.args.constrained_json_disable_any_whitespace)
    sampling = tool_calls.tool_sampling(serving.reasoning_sampling(sampling, template_kwargs), tools)
    offered = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    messages = body.messages()
    if not messages:
        raise APIError(400, "input holds only reasoning items, which add nothing to the prompt (chat templates drop "
                            "earlier turns' thinking); send a message or instructions too.", param="input",
                       code="invalid_value")
    prompt = await serving.chat_prompt(messages, offered, template_kwargs)
    reqs = await serving.make_requests([prompt], sampling, default_max_tokens=serving.context_len, names=NAMES,
                                       http=http)
    output = _Output(body, serving, len(prompt))
    parser = ChoiceParser(serving.reasoning, calls, template_kwargs, offered=tools)
    sub = serving.submit(reqs)
    if body.stream:
        return serving.stream(sub, _events(sub, output, parser), named=True)
    outs = await serving.wait(sub, http)
    if outs is None:
        return Response(status_code=499)      # the client is gone; nobody reads this
    err = engine_abort(outs[0])
    if err is not None:
        raise err
    output.add(parser.feed(outs[0]["text"], final=True))
    *_, done = output.finish(outs[0], parser.reasoned)
    return JSONResponse(done["response"])


def _constraint(body: ResponsesRequest, tools: Optional[list[Tool]], calls: Optional[ToolFormat],
                compact: bool) -> dict:
    """The grammar that text.format or tool_choice asks for, as SGLang sampling params (`tools`: those the
    prompt offers, None: none; `calls`: the format the model writes calls in)."""
    text_kind = body.text.format.type if body.text and body.text.format else "text"
    if text_kind == "text":
        return tool_constraint(calls, tools, body.chat_tool_choice(), body.parallel_tool_calls is not False, compact,
                               code="unsupported_parameter")
    if tools is not None:
        raise APIError(400, "A JSON text.format cannot be combined with tools here: a JSON answer rules out tool "
                            "calls. Pass tool_choice 'none', or leave one of them out.", param="text.format",
                       code="unsupported_parameter")
    if text_kind == "json_object":
        return {"json_schema": ANY_OBJECT}
    return {"json_schema": json.dumps(body.text.format.schema_)}


class _Output:
    """A response's output items, built from the parsed text as it grows, and each change told as the
    stream events OpenAI sends for it, numbered in order. One item is written at a time: text of another
    kind (reasoning, message) or a call closes the item before it."""

    def __init__(self, body: ResponsesRequest, serving: Serving, prompt_tokens: int):
        self.prompt_tokens, self.reasoning_end = prompt_tokens, serving.reasoning_end
        self.items: list[dict] = []
        self.open: Optional[dict] = None
        self.seq = 0
        # The response object in OpenAI's order of fields; status, output, usage and the like change as it goes.
        self.base = {
            "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "completed_at": None, "error": None, "incomplete_details": None,
            "model": serving.model_name, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": SamplingParams.temperature if body.temperature is None else body.temperature,
            "top_p": SamplingParams.top_p if body.top_p is None else body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "tool_choice": _dumped(body.tool_choice) or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": _dumped(body.text and body.text.format) or {"type": "text"}},
            "reasoning": {"effort": None, "summary": None}, "truncation": "disabled", "store": False,
            "background": False, "previous_response_id": None, "user": body.user, "metadata": body.metadata or {},
            "output": [], "usage": None}

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def response(self, status: str, **fields) -> dict:
        return {**self.base, "status": status, "output": self.items, **fields}

    def start(self) -> list[dict]:
        begun = self.response("in_progress")
        return [self.event("response.created", response=begun), self.event("response.in_progress", response=begun)]

    def add(self, delta: Delta) -> list[dict]:
        events = self._write("reasoning", delta.reasoning) if delta.reasoning else []
        events += self._write("message", delta.content) if delta.content else []
        for call in delta.calls:
            events += self._call(call)
        return events

    def finish(self, out: dict, reasoned: bool) -> list[dict]:
        """The last events, ending with response.completed, or response.incomplete when the answer ran
        out of tokens (max_output_tokens, or the context); `reasoned`: the output entered a reasoning
        (ChoiceParser.reasoned)."""
        cut = finish_type(out) == "length"
        status = "incomplete" if cut else "completed"
        events = [] if self.items or self.open else self._open("message")     # an empty answer is an empty message
        events += self._close(status)
        done = self.response(status, usage=self._usage(out, reasoned),
                             incomplete_details={"reason": "max_output_tokens"} if cut else None,
                             **({} if cut else {"completed_at": int(time.time())}))
        return events + [self.event(f"response.{status}", response=done)]

    def _usage(self, out: dict, reasoned: bool) -> dict:
        """The Responses API's usage, its reasoning tokens and the server's speculation figures counted
        as on chat (usage.py)."""
        meta = out["meta_info"]
        reasoning = usage.reasoning_tokens(out["output_ids"], self.reasoning_end) if reasoned else 0
        counts = {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": meta["cached_tokens"]},
                  "output_tokens": meta["completion_tokens"],
                  "output_tokens_details": {"reasoning_tokens": reasoning},
                  "total_tokens": self.prompt_tokens + meta["completion_tokens"]}
        speculated = usage.spec([out])
        return counts | ({"spec": speculated} if speculated is not None else {})

    def failed(self, err: APIError) -> dict:
        return self.event("response.failed", response=self.response("failed", error={
            "code": err.code, "message": err.message}))

    # --- items ---------------------------------------------------------------------------------------
    def _write(self, kind: str, text: str) -> list[dict]:
        events = [] if self.open and self.open["type"] == kind else self._close("completed") + self._open(kind)
        item, where = self.open, self._where()
        item["content"][0]["text"] += text
        if kind == "message":
            return events + [self.event("response.output_text.delta", **where, delta=text, logprobs=[])]
        return events + [self.event("response.reasoning_text.delta", **where, delta=text)]

    def _call(self, call: dict) -> list[dict]:
        """A tool call (the parsers give them whole): its item, its arguments in one delta, done."""
        events = self._close("completed")
        self.open = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                     "call_id": call["id"], "name": call["function"]["name"], "arguments": ""}
        events.append(self.event("response.output_item.added", output_index=len(self.items),
                                 item=copy.deepcopy(self.open)))
        self.open["arguments"] = call["function"]["arguments"]
        events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                 output_index=len(self.items), delta=self.open["arguments"]))
        return events + self._close("completed")

    def _open(self, kind: str) -> list[dict]:
        if kind == "message":
            self.open = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                         "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            self.open = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": "in_progress", "summary": [],
                         "content": []}
            part = {"type": "reasoning_text", "text": ""}
        added = self.event("response.output_item.added", output_index=len(self.items), item=copy.deepcopy(self.open))
        self.open["content"].append(part)
        return [added, self.event("response.content_part.added", **self._where(), part=dict(part))]

    def _close(self, status: str) -> list[dict]:
        item = self.open
        if item is None:
            return []
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=len(self.items), arguments=item["arguments"]))
        else:
            part, where = item["content"][0], self._where()
            if item["type"] == "message":
                events.append(self.event("response.output_text.done", **where, text=part["text"], logprobs=[]))
            else:
                events.append(self.event("response.reasoning_text.done", **where, text=part["text"]))
            events.append(self.event("response.content_part.done", **where, part=dict(part)))
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=len(self.items), item=copy.deepcopy(item)))
        self.items.append(item)
        self.open = None
        return events

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}


def _dumped(value) -> Optional[dict]:
    return value.model_dump(by_alias=True, exclude_none=True) if hasattr(value, "model_dump") else value


async def _events(sub: Submission, output: _Output, parser: ChoiceParser) -> AsyncIterator[dict]:
    for event in output.start():
        yield event
    async for _ in sub.updates():
        out = sub.latest[0]
        err = engine_abort(out)
        if err is not None:
            yield output.failed(err)
            return
        for event in output.add(parser.feed(out["text"], final=finish_type(out) is not None)):
            yield event
    for event in output.finish(sub.latest[0], parser.reasoned):
        yield event
