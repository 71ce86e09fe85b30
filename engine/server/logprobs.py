"""The engine's logprobs (meta_info output_token_logprobs / output_top_logprobs, SGLang's shape) in
OpenAI's chat and text-completion shapes, and with token texts for /generate."""

from __future__ import annotations

from engine.server.tokenize import Tokenizer


async def texts_for(tokenizer: Tokenizer, meta: dict, start: int = 0) -> dict[int, tuple[str, bytes]]:
    """The texts and bytes of the tokens (and alternatives) from output position `start` on."""
    ids = [t for _, t, _ in meta["output_token_logprobs"][start:]]
    ids += [t for top in meta["output_top_logprobs"][start:] for _, t, _ in top]
    return await tokenizer.token_texts(ids)


def chat(meta: dict, start: int, end: int, texts: dict[int, tuple[str, bytes]]) -> dict:
    """Chat's `logprobs` for output tokens start..end: one entry per token, with its alternatives."""
    def entry(lp: float, tok: int) -> dict:
        text, raw = texts[tok]
        return {"token": text, "logprob": lp, "bytes": list(raw)}

    content = [{**entry(lp, tok), "top_logprobs": [entry(v, t) for v, t, _ in top]}
               for (lp, tok, _), top in zip(meta["output_token_logprobs"][start:end],
                                            meta["output_top_logprobs"][start:end])]
    return {"content": content, "refusal": None}


def completion(meta: dict, start: int, end: int, texts: dict[int, tuple[str, bytes]], offset: int) -> dict:
    """Text completion's `logprobs` for output tokens start..end; `offset`: where token `start`'s text
    begins in the choice's text. Alternatives are keyed by text: of two with the same text (parts of
    UTF-8 characters), the likelier one stays."""
    tokens, offsets = [], []
    for _, tok, _ in meta["output_token_logprobs"][start:end]:
        tokens.append(texts[tok][0])
        offsets.append(offset)
        offset += len(texts[tok][0])
    return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in meta["output_token_logprobs"][start:end]],
            "top_logprobs": [{texts[t][0]: v for v, t, _ in reversed(top)} for top in meta["output_top_logprobs"][start:end]],
            "text_offset": offsets}


def with_texts(meta: dict, texts: dict[int, tuple[str, bytes]]) -> dict:
    """/generate's meta_info with each (logprob, id, None) triple's text filled in (return_text_in_logprobs)."""
    return {**meta,
            "output_token_logprobs": [(lp, t, texts[t][0]) for lp, t, _ in meta["output_token_logprobs"]],
            "output_top_logprobs": [[(v, t, texts[t][0]) for v, t, _ in top] for top in meta["output_top_logprobs"]]}
