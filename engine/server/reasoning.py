"""Reasoning parsers (--reasoning-parser, SGLang's names): a thinking model's output split into its
reasoning and its answer, as a transform of the detokenized text.

A parser's `feed(text, final)` takes the whole text so far and returns what it adds: (reasoning delta,
answer delta). Text that could still become a marker (a `</think>` split across tokens or stream
chunks) is held back until it does or cannot; reasoning that never closes (the output ran out inside
it) stays reasoning. The markers themselves are in neither part.

  deepseek-r1, qwen3-thinking  The chat template opens <think> in the prompt: the output starts in the
                               reasoning, and </think> ends it (a <think> the model writes first anyway,
                               as R1-0528 does, is dropped).
  qwen3                        Reasoning only where the output opens with <think> (Qwen3's template
                               leaves that to the model); chat_template_kwargs {"enable_thinking": false}
                               (the template then writes an empty block itself) turns it off.
  deepseek-v3                  DeepSeek-V3.1: chat_template_kwargs {"thinking": true} opens <think> in
                               the prompt; without it the output is all answer.
  gpt-oss                      Harmony messages: `<|channel|>analysis<|message|>...<|end|>` is reasoning,
                               the final channel (and commentary to the user) is answer, and a commentary
                               message to a function (a tool call) passes through whole, markers and
                               all, for the tool-call parser. Its markers are special tokens, so its
                               requests are detokenized with them.
"""

from __future__ import annotations

from typing import Optional

from engine.text import hold_back_stop_prefix

THINK, END_THINK = "<think>", "</think>"
# Harmony's markers (openai/harmony): a message is <|start|>{role}<|channel|>{channel}[ to={recipient}]
# [<|constrain|>{type}]<|message|>{text}, then <|end|>, or <|return|> / <|call|> where the turn ends.
START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>")


class ThinkParser:
    """<think>reasoning</think>answer. `in_reasoning`: whether the text so far ends inside the reasoning;
    `reasoned`: whether it entered one."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = self.reasoned = in_reasoning
        self.pos = 0                  # text consumed
        self.opened = False           # the output's first characters were checked for a <think>

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        if not self.opened:
            if text.startswith(THINK):
                self.pos, self.in_reasoning, self.reasoned = len(THINK), True, True
            elif THINK.startswith(text) and not final:
                return "", ""
            self.opened = True
        reasoning = ""
        if self.in_reasoning:
            end = text.find(END_THINK, self.pos)
            if end < 0:
                shown = text if final else hold_back_stop_prefix(text, [END_THINK])
                reasoning, self.pos = shown[self.pos:], max(self.pos, len(shown))
                return reasoning, ""
            reasoning, self.pos, self.in_reasoning = text[self.pos:end], end + len(END_THINK), False
        answer, self.pos = text[self.pos:], len(text)
        return reasoning, answer


class HarmonyParser:
    """GPT-OSS's Harmony messages: analysis is reasoning, a call to a function passes through whole, the
    rest (final, commentary to the user, text outside any message) is answer."""

    def __init__(self):
        self.pos = 0
        self.kind: Optional[str] = None   # the open message's: "reasoning", "answer" or "call"; None between
        self.reasoned = False             # an analysis message opened

    @property
    def in_reasoning(self) -> bool:
        return self.kind == "reasoning"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        parts = {"reasoning": [], "answer": []}
        while self.pos < len(text):
            if self.kind is None:
                if not text.startswith((START, CHANNEL), self.pos):
                    if not self._outside(text, final, parts["answer"]):
                        break
                    continue
                body = text.find(MESSAGE, self.pos)
                if body < 0:                  # an unfinished header is text, as written
                    if final:
                        parts["answer"].append(text[self.pos:])
                        self.pos = len(text)
                    break
                header = text[self.pos:body]
                self.kind = "call" if " to=" in header else "reasoning" if f"{CHANNEL}analysis" in header else "answer"
                self.reasoned = self.reasoned or self.kind == "reasoning"
                if self.kind == "call":
                    parts["answer"].append(text[self.pos:body + len(MESSAGE)])
                self.pos = body + len(MESSAGE)
                continue
            ends = [(i, m) for i, m in ((text.find(m, self.pos), m) for m in MESSAGE_ENDS) if i >= 0]
            to = "answer" if self.kind == "call" else self.kind
            if not ends:
                shown = text if final else hold_back_stop_prefix(text, MESSAGE_ENDS)
                parts[to].append(shown[self.pos:])
                self.pos = max(self.pos, len(shown))
                break
            end, marker = min(ends)
            parts[to].append(text[self.pos:end] + (marker if self.kind == "call" else ""))
            self.pos, self.kind = end + len(marker), None
        return "".join(parts["reasoning"]), "".join(parts["answer"])

    def _outside(self, text: str, final: bool, answer: list) -> bool:
        """Text between messages is answer, as written, but for the markers that end a message or the
        turn (after a grammar's bare answer, say), which are dropped. False where nothing follows it yet."""
        markers = (START, CHANNEL, *MESSAGE_ENDS)
        found = [(i, m) for i, m in ((text.find(m, self.pos), m) for m in markers) if i >= 0]
        if found:
            end, marker = min(found)
        else:
            end, marker = len(text if final else hold_back_stop_prefix(text, markers)), None
        if end > self.pos:
            answer.append(text[self.pos:end])
        self.pos = end + (len(marker) if marker in MESSAGE_ENDS else 0)
        return marker is not None


class ReasoningFormat:
    """One --reasoning-parser: its parser for a request, and where its answer begins."""
    name: str
    end: str                              # the marker after which the answer begins: a grammar starts there
    special_markers = False               # the markers are special tokens, which detokenizing must keep
    switch: Optional[str] = None          # the chat_template_kwargs key that turns the thinking on or off
    default = True                        # the thinking without it

    def thinks(self, template_kwargs: dict) -> bool:
        """Whether a request with these chat_template_kwargs has reasoning in its output."""
        return self.switch is None or template_kwargs.get(self.switch, self.default)

    def parser(self, template_kwargs: dict):
        """The parser for one choice's output, or None where the request does not think."""
        raise NotImplementedError


class Think(ReasoningFormat):
    end = END_THINK

    def __init__(self, name: str, opened: bool, switch: Optional[str] = None, default: bool = True):
        # opened: the template opens <think> in the prompt (when the request thinks).
        self.name, self.opened, self.switch, self.default = name, opened, switch, default

    def parser(self, template_kwargs: dict) -> Optional[ThinkParser]:
        return ThinkParser(self.opened) if self.thinks(template_kwargs) else None


class Harmony(ReasoningFormat):
    name = "gpt-oss"
    end = "<|end|>"                       # the analysis message comes first
    special_markers = True

    def parser(self, template_kwargs: dict) -> HarmonyParser:
        return HarmonyParser()


FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (
    Think("deepseek-r1", opened=True), Think("qwen3-thinking", opened=True),
    Think("qwen3", opened=False, switch="enable_thinking", default=True),
    Think("deepseek-v3", opened=True, switch="thinking", default=False), Harmony())}


def reasoning_format(name: Optional[str]) -> Optional[ReasoningFormat]:
    """The format --reasoning-parser names (None: the output is all answer)."""
    return FORMATS[name] if name is not None else None


# The chat_template_kwargs that turn thinking on or off (booleans: engine/server/protocol.py checks them).
THINKING_SWITCHES = tuple(sorted({f.switch for f in FORMATS.values() if f.switch}))
