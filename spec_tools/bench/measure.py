"""What a benchmark pass records, and how passes of two backends are interleaved.

A backend (offline.OfflineBackend, online.OnlineBackend) runs a list of conversations to the end and
returns a PassResult; `counters()` reads its cumulative acceptance counters, so the acceptance over any
span is a difference. `run_session` runs the conversations through every backend; with a baseline, in
up to INTERLEAVE_CHUNKS chunks and in alternating order (A B, B A, ...), so that a machine getting
busier or quieter meanwhile slows both alike and the ratio stays honest. `spec tune` interleaves its
candidates the same way.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from functools import reduce
from typing import Callable, Optional, Protocol, Sequence

from spec_tools.bench.datasets import Conversation


@dataclass
class TurnResult:
    """One request: a conversation's turn."""
    conversation: str
    category: str
    turn: int
    prompt_tokens: int
    completion_tokens: int
    ttft: Optional[float]                   # seconds from sending to the first token
    e2e: float                              # seconds from sending to the last token
    gaps: list[float]                       # seconds between consecutive arrivals of new tokens
    output: object                          # token ids (offline) or text (online), compared with the baseline
    verify_ct: Optional[int] = None         # speculative verifications (offline)
    accepted: Optional[int] = None          # draft tokens accepted (offline)
    predicted: Optional[tuple[int, int]] = None     # prediction tokens accepted and rejected


@dataclass
class SpecCounts:
    """Cumulative acceptance counters: verifications, tokens they produced (accepted drafts + bonus), and
    at_depth[d] = verifications that accepted at least d + 1 draft tokens."""
    verify_ct: float = 0
    tokens: float = 0
    at_depth: tuple[float, ...] = ()

    @classmethod
    def from_server_info(cls, info: dict) -> Optional["SpecCounts"]:
        """From Engine.stats() or /get_server_info (averages, turned back into counts)."""
        ct, avg = info.get("spec_verify_ct"), info.get("avg_spec_accept_length")
        if ct == 0:
            return cls()                    # nothing verified yet
        if ct is None or avg is None:
            return None if avg is None else cls(1, avg, ())      # a server without counts: its average
        return cls(ct, avg * ct, tuple(p * ct for p in info.get("spec_accept_by_position") or ()))

    def __sub__(self, before: "SpecCounts") -> "SpecCounts":
        depth = tuple(a - b for a, b in zip(self.at_depth, before.at_depth)) if before.at_depth else self.at_depth
        return SpecCounts(self.verify_ct - before.verify_ct, self.tokens - before.tokens, depth)

    def __add__(self, other: "SpecCounts") -> "SpecCounts":
        depth = tuple(a + b for a, b in zip(self.at_depth, other.at_depth)) if self.at_depth else other.at_depth
        return SpecCounts(self.verify_ct + other.verify_ct, self.tokens + other.tokens, depth)

    @property
    def accept_length(self) -> Optional[float]:
        return self.tokens / self.verify_ct if self.verify_ct > 0 else None

    @property
    def by_position(self) -> list[float]:
        """Share of verifications that accepted the draft token at each depth (1, 2, ...)."""
        return [c / self.verify_ct for c in self.at_depth] if self.verify_ct > 0 else []

    @property
    def histogram(self) -> dict[int, int]:
        """Verifications by accept length (accepted drafts + the bonus token): 1 .. steps + 1."""
        if self.verify_ct <= 0 or not self.at_depth:
            return {}
        at_least = [self.verify_ct, *self.at_depth, 0]
        return {k + 1: round(at_least[k] - at_least[k + 1]) for k in range(len(self.at_depth) + 1)}


@dataclass
class PassResult:
    turns: list[TurnResult]
    duration: float                          # wall seconds from the first request to the last answer
    decode_steps: int = 0                    # offline only: decode steps run, and the seconds they took
    decode_time: float = 0.0
    spec: Optional[SpecCounts] = None        # acceptance during this pass (None: no speculation or unknown)


def merge(passes: Sequence[PassResult]) -> PassResult:
    """Passes taken together, as one pass over all their conversations."""
    specs = [p.spec for p in passes if p.spec is not None]
    return PassResult([t for p in passes for t in p.turns], sum(p.duration for p in passes),
                      sum(p.decode_steps for p in passes), sum(p.decode_time for p in passes),
                      reduce(operator.add, specs) if specs else None)


OnTurn = Callable[[str, TurnResult], None]


class Backend(Protocol):
    name: str

    def run(self, conversations: Sequence[Conversation], on_turn: OnTurn) -> PassResult: ...


@dataclass
class Session:
    """Every pass of every backend, by backend name, in the order run."""
    passes: dict[str, list[PassResult]] = field(default_factory=dict)


WARMUP_TOKENS = 16
# Interleaved runs split the work into this many chunks at most: enough for A B B A A B B A to cancel a
# steady drift, few enough that each chunk keeps a full batch for most of its time.
INTERLEAVE_CHUNKS = 4


def interleave_chunks(items: Sequence, batch_size: int) -> list[list]:
    """Up to INTERLEAVE_CHUNKS consecutive chunks of at least one batch each."""
    size = max(batch_size, math.ceil(len(items) / INTERLEAVE_CHUNKS))
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def warm_up(backend: Backend, conversation: Conversation) -> None:
    """One short unrecorded request: first calls pay for allocations and kernel choices, not measured."""
    short = dataclasses.replace(conversation, turns=conversation.turns[:1], max_new_tokens=WARMUP_TOKENS)
    backend.run([short], lambda *_: None)


def run_session(backends: Sequence[Backend], conversations: Sequence[Conversation], batch_size: int,
                on_turn: OnTurn) -> Session:
    """Each backend runs every conversation (after a warm-up). One backend: one pass. Several: chunk by
    chunk, each chunk through every backend, the order reversed on every other chunk."""
    for backend in backends:
        warm_up(backend, conversations[0])
    session = Session({b.name: [] for b in backends})
    if len(backends) == 1:
        chunks = [list(conversations)]
    else:
        chunks = interleave_chunks(conversations, batch_size)
    for i, part in enumerate(chunks):
        for backend in (backends if i % 2 == 0 else list(reversed(backends))):
            session.passes[backend.name].append(backend.run(part, on_turn))
    return session
