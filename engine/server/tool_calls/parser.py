"""The streaming parser every tool-call format shares: it walks a format's steps over growing text."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.server.tool_calls.format import ToolFormat


class ToolCallParser:
    """Splits growing output text into content and tool calls. `feed` takes the whole text so far and
    returns what it adds: (content delta, new calls); each call goes out whole, once its text is complete
    and valid. Text that could still turn into a call is held back until it does or cannot; a call whose
    text is not valid stays content, as written. `calls`: how many calls went out so far."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.pos = 0                  # text consumed
        self.state = None             # the format's: None in content, else inside a region of calls
        self.marks = ""               # the markup of a region that holds no call yet
        self.region_calls = 0
        self.blank = ""               # whitespace since the last call
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        content, calls = [], []

        def say(piece: str) -> None:
            if self.calls and not piece.strip():
                self.blank += piece             # whitespace after a call waits for text to go with
            else:
                content.append(self.blank + piece)
                self.blank = ""

        while self.pos < len(text) or self.state is not None:
            step = self.fmt.step(text, self.pos, self.state, final)
            if step is None:
                break
            kind, value, self.pos, self.state = step
            if kind == "calls":
                calls += value
                self.calls += len(value)
                self.region_calls += len(value)
                self.marks = self.blank = ""     # the whitespace between calls is no message
            elif kind == "mark":
                if not self.region_calls:
                    self.marks += value
            else:
                say(self.marks + value)
                self.marks = ""
            if self.state is None:
                if self.marks:              # a region that closed without a call was content
                    say(self.marks)
                self.marks, self.region_calls = "", 0
        return "".join(content), calls
