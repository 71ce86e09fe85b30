"""mistral: Mistral's calls after [TOOL_CALLS], as a JSON list (Mistral 7B v0.3, Nemo, Mixtral, Small)

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

or, in the newer tokenizers' compact form, each call after its own marker:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{...}
"""

from __future__ import annotations

import json
import re
from typing import Optional, Sequence

from engine.server.tool_calls.format import (Step, ToolFormat, json_call, json_end, parse_json, structural_tag,
                                             tags_format, tool_call)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
START, LIST = "start", "list"             # states: after the marker; inside the JSON list
SPACE = re.compile(r"\s*")
LIST_SEPARATORS = re.compile(r"[\s,]*")
# A compact call's name, then [ARGS].
COMPACT = re.compile(r"([\w.-]+)(\[ARGS\])?")


class Mistral(ToolFormat):
    name = "mistral"
    openers = (TOOL_CALLS,)

    def open(self, text: str, pos: int, final: bool) -> Optional[Step]:
        return "mark", TOOL_CALLS, pos + len(TOOL_CALLS), START

    def inside(self, text: str, pos: int, state, final: bool) -> Optional[Step]:
        if state == LIST:
            return self._in_list(text, pos, final)
        start = SPACE.match(text, pos).end()
        if start == len(text):
            return ("mark", text[pos:], start, None) if final else None
        if text[start] == "[":
            return "mark", text[pos:start + 1], start + 1, LIST
        return self._compact(text, pos, start, final)

    def _in_list(self, text: str, pos: int, final: bool) -> Optional[Step]:
        start = LIST_SEPARATORS.match(text, pos).end()
        if start == len(text):
            return ("text", text[pos:], start, None) if final else None
        if text[start] == "]":
            return "mark", text[pos:start + 1], start + 1, None
        if text[start] != "{":
            return "text", text[pos:start], start, None
        end = json_end(text, start)
        if end < 0:
            return ("text", text[pos:], len(text), None) if final else None
        call = json_call(parse_json(text[start:end]))
        return ("calls", [call], end, LIST) if call else ("text", text[pos:end], end, None)

    def _compact(self, text: str, pos: int, start: int, final: bool) -> Optional[Step]:
        name = COMPACT.match(text, start)
        if name is None or not name.group(2):
            if name is not None and ARGS.startswith(text[name.end():]) and not final:
                return None                       # [ARGS] may still be coming
            return "text", text[pos:start], start, None
        args = SPACE.match(text, name.end()).end()
        if args == len(text) and not final:
            return None
        if not text.startswith("{", args):
            return "text", text[pos:args], args, None
        end = json_end(text, args)
        if end < 0:
            return ("text", text[pos:], len(text), None) if final else None
        arguments = parse_json(text[args:end])
        if not isinstance(arguments, dict):
            return "text", text[pos:end], end, None
        return "calls", [tool_call(name.group(1), arguments)], end, None

    def structural_tag(self, tools: Sequence, choice, parallel: bool, compact: bool = False) -> str:
        calls = tags_format(tools, choice, parallel, compact,
                            lambda name: f'{{"name": {json.dumps(name)}, "arguments": ', "}", ", ")
        return structural_tag({"type": "tag", "begin": f"{TOOL_CALLS} [", "content": calls, "end": "]"})
