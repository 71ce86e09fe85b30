"""Building FR-Spec token maps (and EAGLE-3 draft vocabularies) from token frequencies.

A map lists `size` token ids by descending frequency in a corpus (ties by id), as FR-Spec publishes
them and `--speculative-token-map` loads them (engine/speculative/token_map.py). The tokens a chat
always produces (EOS, the chat template's special tokens) are in every map, however rare in the
corpus; a corpus with fewer distinct tokens than `size` leaves the rest filled by id order.
An EAGLE-3 draft vocabulary is the same kind of list, stored as d2t (draft id -> target id offset,
draft ids in ascending target id order) and t2d (a bool mask over the target vocabulary).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import torch

# Characters per tokenizer call for plain text: long enough to keep tokens whole across most of it.
_CHUNK_CHARS = 8192


def count_ids(token_lists: Iterable[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """How often each id occurs: an int64 tensor [vocab_size]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in token_lists:
        if len(ids):
            counts += torch.bincount(torch.as_tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts


def tokenize_texts(tokenizer, texts: Iterable[str], batch: int = 256) -> Iterable[list[int]]:
    """Token ids of each text, long texts in newline-bounded chunks, without BOS/EOS."""
    pending: list[str] = []
    for text in texts:
        pending.extend(_chunks(text))
        while len(pending) >= batch:
            yield from tokenizer(pending[:batch], add_special_tokens=False)["input_ids"]
            pending = pending[batch:]
    if pending:
        yield from tokenizer(pending, add_special_tokens=False)["input_ids"]


def _chunks(text: str) -> list[str]:
    out, start = [], 0
    while start < len(text):
        end = len(text) if len(text) - start <= _CHUNK_CHARS else text.rfind("\n", start + 1, start + _CHUNK_CHARS) + 1
        end = end if end > start else start + _CHUNK_CHARS
        out.append(text[start:end])
        start = end
    return out


def chat_special_ids(tokenizer, eos_ids: Sequence[int]) -> list[int]:
    """EOS ids plus the special tokens the chat template writes around a user and an assistant turn."""
    ids = list(eos_ids)
    if getattr(tokenizer, "chat_template", None):
        turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        rendered = tokenizer.apply_chat_template(turns, tokenize=False)
        special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        ids += [t for t in tokenizer.encode(rendered, add_special_tokens=False) if t in special]
    return list(dict.fromkeys(ids))


def build_token_map(counts: torch.Tensor, size: int, always: Sequence[int] = ()) -> list[int]:
    """The `size` most frequent ids (ties: lower id first), always including `always`, in frequency order."""
    vocab = counts.numel()
    size = min(size, vocab)
    # Sorting by (-count, id): a stable sort by count of the ids in order keeps ties by id.
    order = torch.sort(counts, descending=True, stable=True).indices.tolist()
    forced = [i for i in dict.fromkeys(always) if 0 <= i < vocab][:size]
    kept = set(forced)
    for i in order:
        if len(kept) >= size:
            break
        kept.add(i)
    # Frequency order among all kept ids; a forced id absent from the corpus comes after every counted one.
    return sorted(kept, key=lambda i: (-int(counts[i]), i))


def coverage(counts: torch.Tensor, ids: Sequence[int]) -> float:
    """Share of the counted tokens whose id is in `ids`."""
    total = int(counts.sum())
    return float(counts[torch.as_tensor(list(ids), dtype=torch.long)].sum()) / total if total else 0.0


def save_token_map(ids: Sequence[int], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([int(i) for i in ids], path)
    return path


def eagle3_vocab(ids: Iterable[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target ids in draft order (ascending), d2t int64, t2d bool [vocab_size]) for a draft vocabulary."""
    target_ids = torch.tensor(sorted(set(int(i) for i in ids)), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return target_ids, target_ids - torch.arange(len(target_ids)), t2d


# ------------------------------------------------------------------------------------------------ corpora
def corpus_counts(tokenizer, sources: Sequence[str], vocab_size: int) -> torch.Tensor:
    """Token frequencies over every text of the sources (spec_tools/convert/corpus.py)."""
    from spec_tools.convert.corpus import corpus_texts

    return count_ids(tokenize_texts(tokenizer, (t for s in sources for t in corpus_texts(s))), vocab_size)


def generation_counts(engine, prompts: Sequence[str], gen, batch: int, on_tokens=None) -> torch.Tensor:
    """Token frequencies over the target's own answers to the prompts (what a draft will be asked for)."""
    from spec_tools.convert.generate import chat_prompt_ids, generate_groups

    counts = torch.zeros(engine.model_config.vocab_size, dtype=torch.long)
    ids = chat_prompt_ids(engine.tokenizer, prompts)
    on_step = (lambda tokens, _finished: on_tokens(tokens)) if on_tokens else None
    for reqs in generate_groups(engine, ids, gen, 4 * batch, on_step=on_step):
        counts += count_ids((r.output_ids for r in reqs), counts.numel())
    return counts
