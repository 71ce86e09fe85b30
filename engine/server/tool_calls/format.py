"""What every tool-call format provides: a streaming parser of the model's text, and the xgrammar
structural tag that tool_choice "required" or a named function constrains the output to.

A format reads text as a series of steps (`ToolFormat.step`), each one of:
  ("text", str)   content, shown to the client as written;
  ("calls", list) OpenAI tool calls, each whole;
  ("mark", str)   markup around calls (an opening marker, a separator): dropped once its region holds a
                  call, else shown as content, as written.
The format's `state` says where it is (None: in content, anything else: inside a region of calls), so a
region's calls go out one by one as each completes. `ToolCallParser`, the streaming parser every format
shares, walks those steps over growing text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional, Sequence

from engine.text import hold_back_stop_prefix

# A JSON string (or one the text so far leaves open) or a bracket: what json_end counts brackets by.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*(?:"|$)|[\[\]{}]', re.DOTALL)

Step = tuple[str, Any, int, Any]     # (kind, text or calls, where the step ends, the state after it)


class CannotConstrain(ValueError):
    """The format has no structural tag for this tool_choice: the server answers 400 with this message."""


class ToolFormat:
    name: str
    # Strings that open a call or a region of calls; text that could still become one is held back.
    openers: Sequence[str] = ()

    def parser(self, tools: Optional[dict] = None) -> ToolCallParser:
        """A parser for one choice's output; `tools`: the offered functions' parameter schemas by name,
        which type the arguments of a format that writes them as text (the others need none)."""
        return ToolCallParser(self)

    def structural_tag(self, tools: Sequence, choice, parallel: bool, compact: bool = False) -> str:
        """The xgrammar structural tag (JSON text) for tool_choice "required" (one call or more, of any of
        `tools`; only one when not `parallel`) or a named function (exactly one call of it). Arguments are
        held to each function's parameter schema; `compact`: at most one whitespace character between
        their tokens (--constrained-json-disable-any-whitespace). Raises CannotConstrain where the format
        cannot be expressed as one."""
        raise CannotConstrain(f"The {self.name!r} tool-call format cannot be constrained to a call here, so "
                              "tool_choice 'required' or a named function is not served with it; use "
                              "tool_choice 'auto' and the tools' descriptions instead.")

    # --- parsing -------------------------------------------------------------------------------------
    def step(self, text: str, pos: int, state, final: bool) -> Optional[Step]:
        """The next step from `pos`, or None while the text so far cannot tell (never, when `final`)."""
        if state is not None:
            return self.inside(text, pos, state, final)
        start = min((i for i in (text.find(o, pos) for o in self.openers) if i >= 0), default=-1)
        if start == pos:
            return self.open(text, pos, final)
        if start > pos:
            return "text", text[pos:start], start, None
        shown = text if final else hold_back_stop_prefix(text, self.openers)
        return ("text", shown[pos:], len(shown), None) if len(shown) > pos else None

    def open(self, text: str, pos: int, final: bool) -> Optional[Step]:
        """The step at an opener (text[pos:] begins with one)."""
        raise NotImplementedError

    def inside(self, text: str, pos: int, state, final: bool) -> Optional[Step]:
        """The step inside a region of calls (formats whose calls come in regions)."""
        raise NotImplementedError


def json_end(text: str, pos: int) -> int:
    """Where the JSON object or array opening at text[pos] ends (just past its closing bracket), by its
    brackets outside strings; -1 while the text so far does not close it."""
    return bracket_end(text, pos, _JSON_TOKENS)


def bracket_end(text: str, pos: int, tokens: re.Pattern) -> int:
    """Just past the bracket that closes the one at text[pos], counting the brackets among `tokens`
    (a language's strings, which hide brackets, and its brackets); -1 while the text so far does not
    close it."""
    depth = 0
    for m in tokens.finditer(text, pos):
        if m.group() in "[({":
            depth += 1
        elif m.group() in "])}":
            depth -= 1
            if depth == 0:
                return m.end()
    return -1


def parse_json(text: str):
    """The JSON value of `text`, or None when it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def tool_call(name: str, arguments) -> dict:
    """An OpenAI tool call; `arguments` as parsed (an object), sent as JSON text."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def json_call(value, arguments_keys: Sequence[str] = ("arguments",)) -> Optional[dict]:
    """A JSON object {"name": ..., "arguments": {...}} (or another key of `arguments_keys` for the
    arguments; none: no arguments) as a tool call, or None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[k] for k in arguments_keys if k in value), {})
    return tool_call(value["name"], arguments) if isinstance(arguments, dict) else None


def tags_format(tools: Sequence, choice, parallel: bool, compact: bool, begin, end: str, separator: str) -> dict:
    """The structural tag format for calls written as `begin(name)`, the arguments as JSON, `end`, one
    after another with `separator` between them: any of `tools` (at least one) for "required", exactly
    one call of the named function otherwise."""
    def tag(function) -> dict:
        content = {"type": "json_schema", "json_schema": function.parameters or {"type": "object"}}
        return {"type": "tag", "begin": begin(function.name),
                "content": content | ({"max_whitespace_cnt": 1} if compact else {}), "end": end}

    if choice == "required":
        return {"type": "tags_with_separator", "tags": [tag(t.function) for t in tools], "separator": separator,
                "at_least_one": True, "stop_after_first": not parallel}
    return tag(next(t.function for t in tools if t.function.name == choice.function.name))


def structural_tag(fmt: dict) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt})


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
