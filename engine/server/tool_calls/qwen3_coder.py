"""qwen3_coder: Qwen3-Coder's calls, each a block of XML-like tags with the arguments as raw text

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is text, so its JSON type comes from the offered tool's parameter schema, as SGLang reads it:
strings (and parameters of no type, or not in the schema) stay as written; integers, numbers and
booleans are parsed, and values of any other type (object, array, ...) as JSON; a value that does not
parse stays a string, and null is null whatever the type. The tags cannot be held to a JSON schema by
an xgrammar structural tag, so tool_choice "required" or a named function is refused (CannotConstrain).
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from engine.server.tool_calls.format import Step, ToolCallParser, ToolFormat, parse_json, tool_call

START, END, FUNCTION_TAG = "<tool_call>", "</tool_call>", "<function="
FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
# One newline after the opening tag and one before the closing tag frame the value.
PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
SPACE = re.compile(r"\s*")
STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
INTEGER_TYPES = ("int", "uint", "long", "short", "unsigned")


def template_speaks_qwen3_coder(chat_template: Optional[str]) -> bool:
    """The template renders a `tools` list and calls as <tool_call> blocks of <function=...> tags."""
    return bool(chat_template) and "tools" in chat_template and START in chat_template and FUNCTION_TAG in chat_template


class Qwen3Coder(ToolFormat):
    name = "qwen3_coder"
    openers = (START,)

    def __init__(self, tools: Optional[dict] = None):
        self.tools = tools or {}          # function name -> its parameters' JSON schema

    def parser(self, tools: Optional[dict] = None) -> ToolCallParser:
        return ToolCallParser(Qwen3Coder(tools))

    def open(self, text: str, pos: int, final: bool) -> Optional[Step]:
        end = text.find(END, pos + len(START))
        if end < 0:          # an unfinished block is text, not a call
            return ("text", text[pos:], len(text), None) if final else None
        call = self._call(text[pos + len(START):end])
        end += len(END)
        return ("calls", [call], end, None) if call else ("text", text[pos:end], end, None)

    def _call(self, body: str) -> Optional[dict]:
        """The call a block's body writes, or None when it is not one."""
        function = FUNCTION.fullmatch(body)
        if function is None:
            return None
        name, params = function.group(1), function.group(2)
        schema = self.tools.get(name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        properties = properties if isinstance(properties, dict) else {}
        arguments, pos = {}, 0
        while (param := PARAMETER.match(params, pos)) is not None:
            arguments[param.group(1)] = typed(param.group(2), properties.get(param.group(1)))
            pos = param.end()
        return tool_call(name, arguments) if SPACE.fullmatch(params, pos) else None


def typed(value: str, schema: Any) -> Any:
    """A parameter's raw text as the JSON value its schema's type says (no schema: a string)."""
    if value.lower() == "null":
        return None
    if not isinstance(schema, dict):
        return value
    kind = schema.get("type", "string")
    if isinstance(kind, list):                # ["integer", "null"]: the type besides null
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).strip().lower()
    if kind in STRING_TYPES:
        return value
    if kind.startswith(INTEGER_TYPES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):        # inf and nan are no JSON numbers
            return value
        whole = number.is_integer() and not any(c in value.lower() for c in ".e")
        return int(number) if whole else number
    if kind in ("boolean", "bool", "binary"):
        return {"true": True, "false": False}.get(value.lower(), value)
    parsed = parse_json(value)            # objects, arrays and types of no JSON name
    return value if parsed is None else parsed
