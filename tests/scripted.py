"""A tiny model that says a fixed text, for tests of what the server makes of known outputs (reasoning and
tool-call parsing, markers split across tokens and chunks) under plain decoding and every algorithm:
speculation changes how the tokens arrive, never which.

It is a bigram model (tests/eagle_checkpoints.py make_bigram_target): each token alone decides the next.
The script's pieces are tokens of their own (added to the tiny tokenizer), each the successor of the one
before it; every token off the script leads to the first piece, the last piece to the end token. So
after any prompt that ends off the script, greedy decoding writes the pieces in order and stops.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file

from tests.eagle_checkpoints import make_bigram_target
from tests.tiny import CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE, make_model, make_tokenizer

MARGIN = 20.0        # the successor's logit; every other token's is at most about a third of it
# A Mistral tool call after its [TOOL_CALLS] marker (make_mistral_caller).
MISTRAL_CALL = ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def make_scripted_model(path: Path, pieces: Sequence[str], *, special: Sequence[str] = (), end: str = "</s>",
                        chat_template: str = CHAT_TEMPLATE, seed: int = 0) -> Path:
    """Save a model that answers any prompt (ending off the script) with `pieces`, then `end`, its EOS
    token. Pieces must be distinct; those in `special` are special tokens (as Harmony's markers are), and
    so is `end` (the tiny tokenizer's </s>, unless `special` holds another)."""
    path = Path(path)
    assert len(set(pieces)) == len(pieces), "a bigram model says each piece once: split a repeated one"
    tokenizer = make_tokenizer(path, chat_template)
    tokenizer.add_tokens([p for p in pieces if p not in special])
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    ids = []
    for piece in [*pieces, end]:
        (token,) = tokenizer.encode(piece, add_special_tokens=False)     # every piece is one token
        ids.append(token)
    make_model(path, "llama", vocab=len(tokenizer), seed=seed, chat_template=chat_template)
    tokenizer.save_pretrained(path)                   # over the tiny tokenizer make_model saved: with the pieces
    make_bigram_target(path)
    _write_script(path, ids, seed)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": ids[-1]}, indent=2))
    return path


def make_mistral_caller(path: Path) -> Path:
    """A model that answers any prompt with a Mistral call to get_weather, its [TOOL_CALLS] a special token
    as in Mistral's tokenizers (detokenizing skips it unless special tokens are kept), under a chat
    template that takes tools."""
    return make_scripted_model(path, ["[TOOL_CALLS]", MISTRAL_CALL], special=["[TOOL_CALLS]"],
                               chat_template=TOOLS_CHAT_TEMPLATE)


def _write_script(path: Path, ids: list[int], seed: int) -> None:
    """Embeddings and head for the chain ids[0] -> ids[1] -> ... (every other token -> ids[0]): each
    successor's head row is its predecessor's embedding as the final norm leaves it, scaled so that the
    successor's logit is MARGIN."""
    weights = load_file(path / "model.safetensors")
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    gen = torch.Generator().manual_seed(seed)
    off_script = torch.randn(embed.shape[1], generator=gen)
    embed[:] = off_script
    embed[ids] = torch.randn(len(ids), embed.shape[1], generator=gen)
    head.zero_()
    for successor, before in zip(ids, [off_script] + [embed[i] for i in ids[:-1]]):
        normed = before / before.pow(2).mean().sqrt()             # RMSNorm, its weight 1
        head[successor] = MARGIN * normed / normed.pow(2).sum()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
