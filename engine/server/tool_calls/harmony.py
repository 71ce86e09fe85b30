"""gpt-oss: OpenAI's Harmony format, where a call is a message to a function on the commentary channel
(one line here, split for width):

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

The recipient may also stand before <|channel|>; <|start|>assistant is left out of the answer's first
message, and <|call|>, a stop token, out of its end. Other messages (analysis, final) stay content as
written: --reasoning-parser gpt-oss is what splits them into reasoning_content and content. Its markers
are special tokens: the server must detokenize with them (skip_special_tokens false).
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from engine.server.tool_calls.format import Step, ToolFormat, parse_json, structural_tag, tags_format, tool_call

START, CHANNEL, MESSAGE, CALL = "<|start|>assistant", "<|channel|>", "<|message|>", "<|call|>"
FUNCTIONS = "functions."
# A message's header: the recipient before or after the channel, then the content type.
HEADER = re.compile(r"(?:<\|start\|>assistant)?\s*(?:to=([^\s<]+)\s*)?<\|channel\|>(\w+)\s*(?:to=([^\s<]+))?\s*"
                    r"(?:<\|constrain\|>)?\s*\w*\s*<\|message\|>")
HEADER_MAX = 256           # a header not closed by then is not one


class Harmony(ToolFormat):
    name = "gpt-oss"
    openers = (START, CHANNEL)

    def open(self, text: str, pos: int, final: bool) -> Optional[Step]:
        opener = START if text.startswith(START, pos) else CHANNEL
        body = text.find(MESSAGE, pos, pos + HEADER_MAX)
        if body < 0:
            if not final and len(text) - pos < HEADER_MAX:
                return None
            return "text", opener, pos + len(opener), None
        body += len(MESSAGE)
        header = HEADER.fullmatch(text, pos, body)
        recipient = header and (header.group(1) or header.group(3))
        if not recipient or not recipient.startswith(FUNCTIONS):
            return "text", opener, pos + len(opener), None
        call_end = text.find(CALL, body)
        if call_end < 0 and not final:
            return None
        arguments = parse_json(text[body:call_end] if call_end >= 0 else text[body:])
        end = call_end + len(CALL) if call_end >= 0 else len(text)
        if not isinstance(arguments, dict):
            return "text", text[pos:end], end, None
        return "calls", [tool_call(recipient[len(FUNCTIONS):], arguments)], end, None

    def structural_tag(self, tools: Sequence, choice, parallel: bool, compact: bool = False) -> str:
        return structural_tag(tags_format(
            tools, choice, parallel, compact,
            lambda name: f"{CHANNEL}commentary to={FUNCTIONS}{name} <|constrain|>json{MESSAGE}", CALL, START))
