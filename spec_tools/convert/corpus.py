"""Texts and prompts for `spec convert`.

A source is a named set or a file:
- named: `mt-bench`, `gsm8k`, `humaneval`, `sharegpt` (found as `spec bench` finds them, see
  spec_tools/bench/datasets.py) or `instructions` (the built-in MT-Bench-like set, instructions.py);
- a question.jsonl (`turns`, or `prompt` / `question`), a ShareGPT `.json`, or a plain text file.

Token maps count every text of a source (questions, reference answers, both sides of ShareGPT
conversations, a text file whole); generation takes each conversation's first user turn (a text file:
one prompt per line).
"""

from __future__ import annotations

import json
from itertools import chain, zip_longest
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

from spec_tools.convert import ConvertError

INSTRUCTIONS = "instructions"
# Fields of question.jsonl rows and ShareGPT items that hold text (anything nested under them counts).
_TEXT_KEYS = ("turns", "reference", "prompt", "question", "answer", "text", "conversations", "value",
              "content", "messages", "canonical_solution")


def named_sets() -> tuple[str, ...]:
    from spec_tools.bench.datasets import KNOWN

    return (*KNOWN, INSTRUCTIONS)


def corpus_texts(source: str) -> Iterator[str]:
    """Every text of a source, for counting token frequencies."""
    if source == INSTRUCTIONS:
        from spec_tools.convert.instructions import instructions

        yield from instructions()
        return
    path = _file(source)
    if path.suffix in (".jsonl", ".json"):
        for row in _rows(path):
            yield from _strings(row)
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def load_prompts(sources: list[str], num_prompts: Optional[int] = None,
                 written: Optional[Mapping[str, Sequence[str]]] = None) -> list[str]:
    """First user turns, taken from the sources in turn (a mix even when num_prompts is small).
    `written` holds the prompts of sources made at run time (magpie.py), by source name."""
    written = written or {}
    per_source = [list(written[s]) if s in written else _prompts(s) for s in sources]
    mixed = [p for group in zip_longest(*per_source) for p in group if p is not None]
    if not mixed:
        raise ConvertError(f"The prompt sources {', '.join(sources)} hold no prompts.")
    return mixed[:num_prompts] if num_prompts else mixed


def written_share(sources: Sequence[str], num_prompts: Optional[int], written: Sequence[str]) -> int:
    """How many prompts each source in `written` (made at run time: magpie.py) must hold for the first
    `num_prompts` of the mix (1,024 by default): its turn among the sources, plus the turns of the other
    sources once they run out (2,000 `instructions` beside magpie at -n 8000: magpie writes 6,000)."""
    if not written:
        return 0
    want = num_prompts or 1024
    held = [len(_prompts(s)) for s in sources if s not in written]
    # The first `rounds` turns of every source give sum(min(len, rounds)) + len(written) * rounds prompts.
    low, high = 0, want
    while low < high:
        rounds = (low + high) // 2
        if sum(min(n, rounds) for n in held) + len(written) * rounds >= want:
            high = rounds
        else:
            low = rounds + 1
    return low


def _prompts(source: str) -> list[str]:
    if source == INSTRUCTIONS:
        from spec_tools.convert.instructions import instructions

        return instructions()
    path = _file(source)
    if path.suffix not in (".jsonl", ".json"):
        return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    from spec_tools.bench.datasets import load_conversations

    return [c.turns[0] for c in load_conversations(path=str(path))]


def _file(source: str) -> Path:
    if source in named_sets():
        from spec_tools.bench.datasets import find_dataset

        return find_dataset(source)        # a missing set is an error that says how to fetch it
    path = Path(source).expanduser()
    if not path.is_file():
        raise ConvertError(f"{source!r} is neither a file nor a named set ({', '.join(named_sets())}); pass a "
                           "question.jsonl, a ShareGPT .json or a text file.")
    return path


def _rows(path: Path) -> Iterator:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConvertError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}).") from None
        yield from (data if isinstance(data, list) else [data])
        return
    for line_no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConvertError(f"{path} line {line_no} is not valid JSON ({exc.msg}); a question.jsonl holds "
                                   "one object a line.") from None


def _strings(value, under_text: bool = False) -> Iterator[str]:
    """Strings under text fields; other fields (ids, categories, roles) are skipped."""
    if isinstance(value, str):
        if under_text:
            yield value
    elif isinstance(value, list):
        yield from chain.from_iterable(_strings(v, under_text) for v in value)
    elif isinstance(value, dict):
        for key, v in value.items():
            if key in _TEXT_KEYS:
                yield from _strings(v, True)
