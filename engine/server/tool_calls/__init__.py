"""Tool calls in the model's own format: --tool-call-parser names it (SGLang's names), else it is read
from the chat template. A format turns output text into OpenAI `tool_calls`, as a whole or as a stream
of deltas (`ToolFormat.parser()`), and builds the xgrammar structural tag that tool_choice "required" or a
named function constrains the output to (`ToolFormat.structural_tag`, which raises CannotConstrain where
the format cannot be expressed as one: the server answers 400 with its message).
"""

from __future__ import annotations

from typing import Optional

from engine.server.tool_calls.deepseek import DeepSeekV3
from engine.server.tool_calls.format import CannotConstrain, ToolFormat
from engine.server.tool_calls.harmony import Harmony
from engine.server.tool_calls.hermes import Hermes, template_speaks_hermes
from engine.server.tool_calls.llama3 import Llama3
from engine.server.tool_calls.mistral import Mistral
from engine.server.tool_calls.pythonic import Pythonic
from engine.server.tool_calls.qwen3_coder import Qwen3Coder, template_speaks_qwen3_coder

# --tool-call-parser's names, SGLang's: "qwen" and "hermes" name the same <tool_call> blocks as "qwen25".
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3(), Mistral(), DeepSeekV3(), Pythonic(),
                                                      Harmony(), Qwen3Coder())}
FORMATS |= {"qwen": FORMATS["qwen25"], "hermes": FORMATS["qwen25"]}

__all__ = ["CannotConstrain", "FORMATS", "ToolFormat", "tool_format", "tool_sampling"]


def tool_format(name: Optional[str], chat_template: Optional[str]) -> Optional[ToolFormat]:
    """The format --tool-call-parser names, else the one the chat template writes calls in (Qwen3-Coder's
    <function=...> tags or Hermes <tool_call> blocks), else None: the model has no tool calls this server
    can read."""
    if name is not None:
        return FORMATS[name]
    if template_speaks_qwen3_coder(chat_template):
        return FORMATS["qwen3_coder"]
    return FORMATS["qwen25"] if template_speaks_hermes(chat_template) else None


def tool_sampling(sampling: dict, tools: Optional[list]) -> dict:
    """A request's sampling params where it offers tools (tool_choice not "none"): detokenized with the
    special tokens, as SGLang does for every format, since the markers of several ([TOOL_CALLS],
    <|python_tag|>, Harmony's) are special tokens that the parser would otherwise never see."""
    return {**sampling, "skip_special_tokens": False} if tools else sampling
