"""Tool calling in the Qwen / Hermes format: each call is a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

in the assistant's text (Qwen2.5, Qwen3, Hermes and the models trained on their templates). This
module decides whether a model's chat template speaks it, builds the xgrammar structural tag that
`tool_choice` "required" or a named function constrains the output to, and turns output text into
OpenAI `tool_calls`, as a whole or as a stream of deltas.
"""

from __future__ import annotations

import json
import uuid
from typing import Optional, Sequence

from engine.engine import hold_back_stop_prefix

START, END = "<tool_call>", "</tool_call>"


def template_speaks_tools(chat_template: Optional[str]) -> bool:
    """The template renders a `tools` list and Hermes-style <tool_call> blocks."""
    return bool(chat_template) and "tools" in chat_template and START in chat_template


def structural_tag(tools: Sequence, choice, parallel: bool, compact: bool = False) -> str:
    """The xgrammar structural tag (JSON text) for tool_choice "required" (one call or more, of any of
    `tools`; only one when not `parallel`) or a named function (exactly one call of it). Arguments are
    held to each function's parameter schema; `compact`: at most one whitespace character between
    their tokens (--constrained-json-disable-any-whitespace)."""
    def tag(function) -> dict:
        content = {"type": "json_schema", "json_schema": function.parameters or {"type": "object"}}
        return {"type": "tag", "begin": f'{START}\n{{"name": {json.dumps(function.name)}, "arguments": ',
                "content": content | ({"max_whitespace_cnt": 1} if compact else {}), "end": f"}}\n{END}"}

    if choice == "required":
        fmt = {"type": "tags_with_separator", "tags": [tag(t.function) for t in tools], "separator": "\n",
               "at_least_one": True, "stop_after_first": not parallel}
    else:
        fmt = tag(next(t.function for t in tools if t.function.name == choice.function.name))
    return json.dumps({"type": "structural_tag", "format": fmt})


def _call(block: str) -> Optional[dict]:
    """One <tool_call> block's JSON as an OpenAI tool call, or None when it is not one."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


class ToolCallParser:
    """Splits growing output text into content and tool calls. `feed` takes the whole text so far and
    returns what it adds: (content delta, new calls). Text that could still turn into a <tool_call> is
    held back until it does or cannot; a block that is not valid JSON stays content, as written."""

    def __init__(self):
        self.pos = 0                  # text consumed
        self.in_call = False
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        content, calls = [], []

        def say(piece: str) -> None:
            if piece.strip() or not self.calls:      # the newlines between calls are no message
                content.append(piece)

        while True:
            if self.in_call:
                end = text.find(END, self.pos)
                if end < 0:
                    if final:             # an unfinished block is text, not a call
                        say(START + text[self.pos:])
                        self.pos = len(text)
                    break
                call = _call(text[self.pos:end])
                if call is None:
                    say(START + text[self.pos:end + len(END)])
                else:
                    calls.append(call)
                    self.calls += 1
                self.pos, self.in_call = end + len(END), False
                continue
            start = text.find(START, self.pos)
            if start >= 0:
                say(text[self.pos:start])
                self.pos, self.in_call = start + len(START), True
                continue
            shown = text if final else hold_back_stop_prefix(text, [START])
            say(shown[self.pos:])
            self.pos = max(self.pos, len(shown))
            break
        return "".join(content), calls
