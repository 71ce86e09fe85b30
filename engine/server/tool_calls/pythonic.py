"""pythonic: calls as a Python list of function calls with keyword arguments (Llama 3.2 and 4 with a
pythonic template, and others prompted so), optionally between Llama 4's <|python_start|> and
<|python_end|>:

    [get_weather(city="Paris", days=3), get_time(zone="CET")]

Arguments must be literals (strings, numbers, True/False/None, lists and dicts of them), read with
Python's ast, never evaluated. The whole list goes out at once, when it closes. There is no structural
tag for it: tool_choice "required" or a named function is refused.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Optional

from engine.server.tool_calls.format import Step, ToolFormat, bracket_end, tool_call

PY_START, PY_END = "<|python_start|>", "<|python_end|>"
LIST, AFTER = "list", "after"          # states: the list is next; the list is over, <|python_end|> may follow
SPACE = re.compile(r"\s*")
# The opening of a list of calls: "[", a function name, "(".
OPENING = re.compile(r"\[\s*[A-Za-z_]\w*\(")
# Text so far that may still become that opening.
MAYBE_OPENING = re.compile(r"\[\s*([A-Za-z_]\w*)?")
# Python's strings (or one the text so far leaves open) and brackets: what the list's end is found by.
TOKENS = re.compile(r"""'(?:[^'\\\n]|\\.)*(?:'|$)|"(?:[^"\\\n]|\\.)*(?:"|$)|[\[\](){}]""", re.DOTALL)


def parse_calls(source: str) -> Optional[list[dict]]:
    """A Python list of calls with literal keyword arguments as tool calls, or None when it is not one."""
    try:
        tree = ast.parse(source, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and all(k.arg for k in node.keywords)):
                return None
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            json.dumps(arguments)                      # a set or bytes has no JSON form
            calls.append(tool_call(node.func.id, arguments))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class Pythonic(ToolFormat):
    name = "pythonic"
    openers = ("[", PY_START)

    def open(self, text: str, pos: int, final: bool) -> Optional[Step]:
        if text.startswith(PY_START, pos):
            return "mark", PY_START, pos + len(PY_START), LIST
        return self._list(text, pos, pos, final)

    def inside(self, text: str, pos: int, state, final: bool) -> Optional[Step]:
        start = SPACE.match(text, pos).end()
        if state == LIST:
            if start == len(text):
                return ("text", text[pos:], start, None) if final else None
            return self._list(text, pos, start, final) if text[start] == "[" else ("text", text[pos:start], start, None)
        if text.startswith(PY_END, start):
            return "mark", text[pos:start + len(PY_END)], start + len(PY_END), None
        if not final and PY_END.startswith(text[start:]):
            return None
        return "mark", "", pos, None

    def _list(self, text: str, pos: int, start: int, final: bool) -> Optional[Step]:
        """The list of calls opening at text[start] (`pos`..`start`: what leads to it)."""
        if not OPENING.match(text, start):
            maybe = MAYBE_OPENING.match(text, start)
            if maybe.end() == len(text) and not final:
                return None
            return "text", text[pos:start + 1], start + 1, None       # a bracket, not calls
        end = bracket_end(text, start, TOKENS)
        if end < 0:
            return ("text", text[pos:], len(text), None) if final else None
        calls = parse_calls(text[start:end])
        if calls is None:
            return "text", text[pos:end], end, None
        return "calls", calls, end, AFTER
