"""Incremental detokenization: text grows as tokens arrive, never ending in half a UTF-8 character.

Each step decodes a short window that starts a few tokens back, so tokenizers that change a token's
text by its neighbours (leading spaces in SentencePiece, byte-level merges) render the same text as a
full decode would.
"""

from __future__ import annotations

from typing import Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 start: int = 0):
        self.tokenizer = tokenizer
        self.kwargs = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            self.kwargs["spaces_between_special_tokens"] = False
        self.prefix_offset = start          # ids before `start` (a prompt) are never decoded
        self.read_offset = start
        self.seen = start                   # len(ids) at the last call

    def catch_up(self, ids: Sequence[int]) -> str:
        """The text of the ids added since the last call, stepped one id at a time: the same text as a
        call after each id (the overlap scheduler decodes a step's tokens after the fact)."""
        end = len(ids)
        return "".join(self.step(ids if n == end else ids[:n]) for n in range(self.seen + 1, end + 1))

    def step(self, ids: Sequence[int], final: bool = False) -> str:
        """The text that `ids` (all ids so far) adds since the last call; "" while a character is still
        incomplete, unless `final` (the request ended: flush what there is)."""
        self.seen = len(ids)
        prefix_text = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset], **self.kwargs)
        full_text = self.tokenizer.decode(ids[self.prefix_offset:], **self.kwargs)
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
            return full_text[len(prefix_text):]
        return ""
