"""Request: one generation's state, from arrival to finish. The scheduler and workers update it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class FinishReason:
    type: str                      # "stop" (EOS, stop string or stop token), "length", "abort"
    matched: Optional[object] = None   # the stop string or token id that fired
    message: Optional[str] = None      # why an abort happened

    def to_dict(self) -> dict:
        out: dict = {"type": self.type}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        return out


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int                                  # the sampling seed in effect (request's or engine's)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: Optional[FinishReason] = None

    # KV state, owned by the scheduler.
    row: Optional[int] = None                  # req-to-token table row while running
    kv_len: int = 0                            # tokens whose KV is cached for this request
    prefix_len: int = 0                        # leading tokens shared from the radix cache
    radix_node: object = None                  # locked radix node holding that prefix
    cached_tokens: int = 0                     # prompt tokens served from the radix cache at admission

    # Text state: output text decoded so far (stop strings are checked on it).
    text: str = ""
    detok: object = field(default=None, repr=False)
    checked_text_len: int = 0                  # text already searched for stop strings
    stop_text_cut: Optional[int] = None        # where a matched stop string starts in `text`

    # Speculative counters.
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0              # draft tokens accepted (bonus tokens excluded)

    # Timings (time.perf_counter()).
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    retractions: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def remaining_tokens(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    def uniform(self, position: int, stream: int = 0) -> float:
        """A uniform number in [0, 1) fixed by (seed, output position, stream): sampling is reproducible
        whatever the batching, preemption or speculation, and never depends on other requests."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + position * 8_191 + stream) % (2 ** 63))
        return float(torch.rand((), generator=gen, dtype=torch.float64))
