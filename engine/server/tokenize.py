"""Tokenization for the HTTP side, on a thread of its own.

A long prompt costs the tokenizer seconds (a prompt of megabytes) and the Rust tokenizer releases the
GIL while it works, so on a thread it does not stall the event loop
(health checks, every other stream). One thread keeps calls on the tokenizer object from overlapping.
A prompt that cannot fit the context is refused before it is tokenized, where its length alone tells.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional, Sequence

from engine.server.errors import APIError


class Tokenizer:
    def __init__(self, tokenizer, context_len: int):
        # The engine thread decodes with its own tokenizer; a copy keeps the two threads off one Rust object.
        self.hf = copy.deepcopy(tokenizer)
        self.context_len = context_len
        self.max_token_bytes = _max_token_bytes(self.hf)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="spec-tokenizer")
        self._texts: dict[int, tuple[str, bytes]] = {}
        self._byte_level = _is_byte_level(self.hf)

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return await self._run(lambda: [self._encode(t, True) for t in texts])

    async def encode_chat(self, turns: list[dict], param: str, tools: Optional[list[dict]] = None,
                          template_kwargs: Optional[dict] = None) -> list[int]:
        """The chat template over the turns (and the tools offered, and more variables for it), with the
        assistant turn opened, tokenized."""
        def run() -> list[int]:
            try:
                text = self.hf.apply_chat_template(turns, tools=tools, tokenize=False, add_generation_prompt=True,
                                                   **(template_kwargs or {}))
            except Exception as exc:       # jinja's TemplateError and the template's own raise_exception
                raise APIError(400, f"The chat template rejected the messages: {exc}", param=param) from None
            return self._encode(text, False)
        return await self._run(run)

    async def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return await self._run(lambda: [self.hf.decode(x) for x in ids])

    async def token_texts(self, ids: Iterable[int]) -> dict[int, tuple[str, bytes]]:
        """Each token's own text and bytes, for logprobs (cached: at most one entry per vocabulary
        token). A token holding part of a UTF-8 character decodes to U+FFFD; its bytes are exact."""
        missing = list(set(ids) - self._texts.keys())
        if missing:
            def run() -> dict:
                pieces = self.hf.convert_ids_to_tokens(missing)
                return {i: (self.hf.decode([i]), _piece_bytes(p, self._byte_level)) for i, p in zip(missing, pieces)}
            self._texts.update(await self._run(run))
        return self._texts

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # Every token covers at most max_token_bytes bytes of text, and a character is at least a byte.
        if self.max_token_bytes and len(text) > self.context_len * self.max_token_bytes:
            raise APIError(400, f"The prompt has {len(text)} characters, so more than {self.context_len} tokens, "
                                f"the context length; shorten it.", code="context_length_exceeded")
        return self.hf.encode(text, add_special_tokens=add_special_tokens)


def _max_token_bytes(tokenizer) -> Optional[int]:
    """The most bytes of input text one token can stand for, or None where that is unknown: a normalizer
    may shrink the text before it is split (collapsing spaces, composing accents), so the bound holds
    only without one (byte-level BPE: GPT-2, Llama 3, Qwen, SmolLM). Token strings in UTF-8 are at
    least as long as the bytes they stand for (byte-level's "Ġ" is two bytes for one, a byte-fallback
    "<0x41>" six for one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    return max(len(t.encode("utf-8")) for t in tokenizer.get_vocab())


def _is_byte_level(tokenizer) -> bool:
    """GPT-2-style byte-level BPE (Llama 3, Qwen, SmolLM): token strings spell bytes as characters."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and json.loads(backend.to_str()).get("decoder", {}).get("type") == "ByteLevel"


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _piece_bytes(piece: str, byte_level: bool) -> bytes:
    """The bytes a token string stands for: byte-level characters mapped back, SentencePiece's
    <0xNN> byte tokens and its word-start mark, otherwise the string's UTF-8."""
    if byte_level:
        decoder = _byte_decoder()
        if all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")
