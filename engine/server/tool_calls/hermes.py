"""qwen25: the Qwen / Hermes format, each call a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

in the assistant's text (Qwen2.5, Qwen3, Hermes and the models trained on their templates). It is the
format read from a chat template that writes <tool_call> blocks when no --tool-call-parser is given.
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

from engine.server.tool_calls.format import Step, ToolFormat, json_call, structural_tag, tags_format

START, END = "<tool_call>", "</tool_call>"


def template_speaks_hermes(chat_template: Optional[str]) -> bool:
    """The template renders a `tools` list and Hermes-style <tool_call> blocks."""
    return bool(chat_template) and "tools" in chat_template and START in chat_template


class Hermes(ToolFormat):
    name = "qwen25"
    openers = (START,)

    def open(self, text: str, pos: int, final: bool) -> Optional[Step]:
        end = text.find(END, pos + len(START))
        if end < 0:          # an unfinished block is text, not a call
            return ("text", text[pos:], len(text), None) if final else None
        try:
            call = json_call(json.loads(text[pos + len(START):end]))
        except ValueError:
            call = None
        end += len(END)
        return ("calls", [call], end, None) if call else ("text", text[pos:end], end, None)

    def structural_tag(self, tools: Sequence, choice, parallel: bool, compact: bool = False) -> str:
        return structural_tag(tags_format(tools, choice, parallel, compact,
                                          lambda name: f'{START}\n{{"name": {json.dumps(name)}, "arguments": ',
                                          f"}}\n{END}", "\n"))
