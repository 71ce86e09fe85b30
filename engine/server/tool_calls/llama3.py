"""llama3: Llama 3.1, 3.2 and 3.3's JSON calls, written at the start of the answer or after
<|python_tag|>, several separated by ";":

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

"arguments" is read as well as "parameters". Text after the calls is content.
"""

from __future__ import annotations

import json
import re
from typing import Optional, Sequence

from engine.server.tool_calls.format import (Step, ToolFormat, json_call, json_end, parse_json, structural_tag,
                                             tags_format)

PYTHON_TAG = "<|python_tag|>"
CALLS = "calls"                  # the state inside a run of calls
SEPARATORS = re.compile(r"[\s;]*")


class Llama3(ToolFormat):
    name = "llama3"
    openers = (PYTHON_TAG,)

    def step(self, text: str, pos: int, state, final: bool) -> Optional[Step]:
        if state is None and pos == 0:            # a call may open the answer without the tag
            body = len(text) - len(text.lstrip())
            if body == len(text) and not final:
                return None
            if text.startswith("{", body):
                return "mark", text[:body], body, CALLS
        return super().step(text, pos, state, final)

    def open(self, text: str, pos: int, final: bool) -> Optional[Step]:
        return "mark", PYTHON_TAG, pos + len(PYTHON_TAG), CALLS

    def inside(self, text: str, pos: int, state, final: bool) -> Optional[Step]:
        start = SEPARATORS.match(text, pos).end()
        if start == len(text):
            return ("mark", text[pos:], start, None) if final else None
        if text[start] != "{":                    # the calls are over; what follows is content
            return "mark", text[pos:start], start, None
        end = json_end(text, start)
        if end < 0:
            return ("text", text[pos:], len(text), None) if final else None
        call = json_call(parse_json(text[start:end]), ("parameters", "arguments"))
        return ("calls", [call], end, CALLS) if call else ("text", text[pos:end], end, None)

    def structural_tag(self, tools: Sequence, choice, parallel: bool, compact: bool = False) -> str:
        return structural_tag(tags_format(tools, choice, parallel, compact,
                                          lambda name: f'{{"name": {json.dumps(name)}, "parameters": ', "}", "; "))
