"""Tool calls in the model's own format: --tool-call-parser names it (SGLang's names), else it is read
from the chat template. A format turns output text into OpenAI `tool_calls`, as a whole or as a stream
of deltas (`ToolFormat.parser()`), and builds the xgrammar structural tag that tool_choice "required" or a
named function constrains the output to (`ToolFormat.structural_tag`, which raises CannotConstrain where
the format cannot be expressed as one: the server answers 400 with its message).
"""

from __future__ import annotations

from typing import Optional

from engine.server.tool_calls.format import CannotConstrain, ToolFormat
from engine.server.tool_calls.hermes import Hermes, template_speaks_hermes

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(),)}

__all__ = ["CannotConstrain", "FORMATS", "ToolFormat", "tool_format"]


def tool_format(name: Optional[str], chat_template: Optional[str]) -> Optional[ToolFormat]:
    """The format --tool-call-parser names, else the one the chat template writes calls in (Hermes
    <tool_call> blocks), else None: the model has no tool calls this server can read."""
    if name is not None:
        return FORMATS[name]
    return FORMATS["qwen25"] if template_speaks_hermes(chat_template) else None


# The names the server used before it knew formats by name, until its callers move to tool_format.
template_speaks_tools = template_speaks_hermes
structural_tag = FORMATS["qwen25"].structural_tag


def ToolCallParser():                   # noqa: N802  (the class it stood for)
    return FORMATS["qwen25"].parser()
