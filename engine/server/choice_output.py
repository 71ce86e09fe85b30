"""One choice's output text as the OpenAI APIs show it: the reasoning apart (engine/server/reasoning.py),
then the tool calls out of the answer (engine/server/tool_calls/). The chat completions and the
Responses API both read it.

`ChoiceParser.feed(text, final)` takes the whole text so far and returns what it adds, a `Delta`: a
stream sends each one; fed once with final=True it is the whole message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine.server.reasoning import ReasoningFormat
from engine.server.tool_calls import ToolFormat


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)       # OpenAI tool calls, each whole


class ChoiceParser:
    """reasoning: the server's reasoning format (None: no --reasoning-parser, the output is all answer);
    tools: the tool-call format, or None where the request offers no tools; template_kwargs: the
    request's chat_template_kwargs (they say whether it thinks); stream_reasoning false: each stretch of
    reasoning is sent whole, once it closes or the output ends inside it; separate false
    (separate_reasoning): the reasoning stays in the content, as written, and is only followed, for
    `reasoned`; offered: the request's tools (chat shape), whose parameter schemas type the arguments
    of a format that writes them as text."""

    def __init__(self, reasoning: Optional[ReasoningFormat], tools: Optional[ToolFormat],
                 template_kwargs: Optional[dict] = None, stream_reasoning: bool = True, separate: bool = True,
                 offered: Optional[list] = None):
        self.reasoning = reasoning.parser(template_kwargs or {}) if reasoning else None
        schemas = {t.function.name: t.function.parameters for t in offered or ()}
        self.tools = tools.parser(schemas) if tools else None
        self.stream_reasoning, self.separate = stream_reasoning, separate
        self.answer = ""              # the text after the reasoning so far: what the tool-call parser reads
        self.held = ""                # reasoning not sent yet (stream_reasoning false)

    @property
    def calls(self) -> int:
        """How many tool calls went out so far."""
        return self.tools.calls if self.tools else 0

    @property
    def reasoned(self) -> bool:
        """Whether the output so far entered a reasoning: its tokens up to the reasoning's end are
        reasoning tokens (usage.reasoning_tokens)."""
        return self.reasoning is not None and self.reasoning.reasoned

    def feed(self, text: str, final: bool = False) -> Delta:
        if self.reasoning is None or not self.separate:
            if self.reasoning is not None:
                self.reasoning.feed(text, final)
            reasoning, answer = "", text[len(self.answer):]
        else:
            reasoning, answer = self.reasoning.feed(text, final)
            if not self.stream_reasoning:
                self.held += reasoning
                reasoning = ""
                if final or not self.reasoning.in_reasoning:
                    reasoning, self.held = self.held, ""
        self.answer += answer
        if self.tools is None:
            return Delta(reasoning, answer)
        content, calls = self.tools.feed(self.answer, final)
        return Delta(reasoning, content, calls)
