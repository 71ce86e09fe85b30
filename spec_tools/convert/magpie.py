"""The prompt source `magpie`: the target writes its own user requests (Magpie, Xu et al. 2024).

Fed only its chat template's text up to where a user's message begins, an instruction-tuned model
samples a request like those it was tuned on: prompts from the target's own distribution, as many as
wanted, with no dataset. Requests cut off by the token limit, shorter than a few words or repeated are
dropped. The prompts are kept in a JSON file and reused by a later run with the same settings, so
that the answers' data (checked prompt by prompt) stays valid across resumes; a run that wants more
extends the list (sampling on from where it stopped), so a longer list begins with the shorter one.

`magpie-tasks` is the same with the request's first words given, one of `OPENINGS` in turn ("Write",
"Solve", "Pretend", "Extract", ...): left alone, a model writes the requests it was tuned on most,
which for Qwen2.5-Coder are questions about itself, in Chinese, or "Q: ... A: ..." pairs; an opening
spreads the requests over kinds of task while the model still picks the subject.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from spec_tools.convert import ConvertError
from spec_tools.convert.generate import Generation, generate_groups

MAGPIE = "magpie"
TASKS = "magpie-tasks"
# The kinds of request a general assistant gets: writing, role-play, reasoning, math, coding, extraction,
# science, humanities, advice.
OPENINGS = ("Write", "Explain", "Imagine", "Solve", "Compare", "What", "How", "Can you", "Pretend", "Extract",
            "Summarize", "Given", "Suppose", "Describe", "List", "Create", "Design", "Why", "Rewrite", "Help me",
            "Compose", "Act as", "Analyze", "Draft")
_MARK = "\x00user message\x00"
_MIN_WORDS = 4


@dataclass(frozen=True)
class MagpieSettings:
    model: str
    seed: int = 0
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 0.95
    openings: tuple[str, ...] = ()      # sample i's request begins with openings[i % len]

    def stored(self) -> dict:
        """As a prompts file records them: JSON's lists, and no `openings` for plain magpie (files
        written before they existed hold none)."""
        fields = {**asdict(self), "openings": list(self.openings)}
        if not self.openings:
            del fields["openings"]
        return fields


def sources(names: Sequence[str]) -> list[str]:
    """The magpie sources among prompt source names."""
    return [name for name in (MAGPIE, TASKS) if name in names]


def settings(source: str, model: str, seed: int = 0) -> MagpieSettings:
    return MagpieSettings(model, seed, openings=OPENINGS if source == TASKS else ())


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template's text before a (first) user message's content."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConvertError("The prompt source magpie needs a chat model: this tokenizer has no chat template. Pass "
                           "a prompt file or a named set with --prompts (e.g. --prompts gsm8k --prompts instructions).")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    return tokenizer(text[:text.index(_MARK)], add_special_tokens=False)["input_ids"]


def write_prompts(engine, count: int, settings: MagpieSettings, group: int,
                  on_kept: Optional[Callable[[int], None]] = None, kept: Sequence[str] = (),
                  tried: int = 0) -> tuple[list[str], int]:
    """(`count` distinct requests, samples tried): `kept` followed by requests sampled from the target
    with the seeds after the `tried` already used; fewer (the caller warns) only when four times as
    many samples did not yield enough, an error when none did."""
    prefix = user_turn_prefix(engine.tokenizer)
    openings = [engine.tokenizer(o, add_special_tokens=False)["input_ids"] for o in settings.openings] or [[]]
    gen = Generation(settings.max_new_tokens, settings.temperature, settings.seed, settings.top_p)
    kept = dict.fromkeys(kept)
    while len(kept) < count and tried < 4 * count:
        batch = min(group, 4 * count - tried)
        starts = [openings[i % len(openings)] for i in range(tried, tried + batch)]
        for reqs in generate_groups(engine, [prefix + o for o in starts], gen, batch, first_index=tried):
            before = len(kept)
            for start, req in zip(starts, reqs):
                text = engine.tokenizer.decode(start + req.output_ids, skip_special_tokens=True).strip()
                if req.finish_reason.type == "stop" and len(text.split()) >= _MIN_WORDS and len(kept) < count:
                    kept.setdefault(text, None)
            if on_kept:
                on_kept(len(kept) - before)
        tried += batch
    if not kept:
        raise ConvertError(f"The target wrote no usable requests in {tried} tries (each must end before "
                           f"{settings.max_new_tokens} tokens and have {_MIN_WORDS}+ words); use another prompt "
                           "source.")
    return list(kept), tried


def cached_prompts(path: Path, count: int, settings: MagpieSettings, make_engine: Callable[[], object], group: int,
                   on_kept: Optional[Callable[[int], None]] = None) -> list[str]:
    """The first `count` prompts stored at `path` by an earlier run with these settings, the stored
    list extended (and written back) when it holds fewer; new ones when there are none."""
    stored, tried = [], 0
    if path.is_file():
        data = json.loads(path.read_text())
        if data.get("settings") == settings.stored():
            # A list written before "tried" was kept used at most four tries a prompt: go on past them.
            stored, tried = data["prompts"], data.get("tried", 4 * len(data["prompts"]))
    if len(stored) >= count:
        return stored[:count]
    if on_kept and stored:
        on_kept(len(stored))         # progress counts the whole list, the stored part included
    prompts, tried = write_prompts(make_engine(), count, settings, group, on_kept, stored, tried)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings.stored(), "tried": tried, "prompts": prompts}, indent=1))
    return prompts
