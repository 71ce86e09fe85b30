"""deepseekv3: DeepSeek-V3's (and R1's) calls, in a block of calls each with its arguments as a JSON code
block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time ... <｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from engine.server.tool_calls.format import Step, ToolFormat, parse_json, structural_tag, tags_format, tool_call

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
CALLS = "calls"                       # the state inside the block of calls
SPACE = re.compile(r"\s*")
CALL = re.compile(re.escape(CALL_BEGIN) + r"function" + re.escape(SEP) + r"([^\n]+)\n```json\n(.*)\n```"
                  + re.escape(CALL_END), re.DOTALL)


class DeepSeekV3(ToolFormat):
    name = "deepseekv3"
    openers = (CALLS_BEGIN,)

    def open(self, text: str, pos: int, final: bool) -> Optional[Step]:
        return "mark", CALLS_BEGIN, pos + len(CALLS_BEGIN), CALLS

    def inside(self, text: str, pos: int, state, final: bool) -> Optional[Step]:
        start = SPACE.match(text, pos).end()
        rest = text[start:start + len(CALL_BEGIN)]
        if text.startswith(CALLS_END, start):
            end = start + len(CALLS_END)
            return "mark", text[pos:end], end, None
        if not text.startswith(CALL_BEGIN, start):
            if not final and (CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest)):
                return None                    # a marker may still be coming
            return "text", text[pos:start], start, None
        end = text.find(CALL_END, start)
        if end < 0:
            return ("text", text[pos:], len(text), None) if final else None
        end += len(CALL_END)
        call = CALL.fullmatch(text, start, end)
        arguments = parse_json(call.group(2)) if call else None
        if not isinstance(arguments, dict):
            return "text", text[pos:end], end, CALLS
        return "calls", [tool_call(call.group(1).strip(), arguments)], end, CALLS

    def structural_tag(self, tools: Sequence, choice, parallel: bool, compact: bool = False) -> str:
        calls = tags_format(tools, choice, parallel, compact,
                            lambda name: f"{CALL_BEGIN}function{SEP}{name}\n```json\n", f"\n```{CALL_END}", "\n")
        return structural_tag({"type": "tag", "begin": CALLS_BEGIN, "content": calls, "end": CALLS_END})
