"""Request: one generation's state, from arrival to finish. Only the scheduler changes it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from engine.core.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class FinishReason:
    type: str                      # "stop" (EOS, stop string or stop token), "length", "abort"
    matched: Optional[object] = None   # the stop string or token id that fired
    message: Optional[str] = None      # why an abort happened
    # For an abort, the HTTP status it stands for (SGLang's name): 400 the request cannot be served as
    # sent, 500 the engine failed on it, 503 the server could not serve it now; None: the client left.
    status_code: Optional[int] = None

    def to_dict(self) -> dict:
        out: dict = {"type": self.type}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out


@dataclass(eq=False)
class Request:
    rid: str
    token_ids: list[int]                       # the prompt, then every generated token: one list
    params: SamplingParams
    seed: int                                  # the sampling seed in effect (request's or engine's)
    prompt_len: int = -1                       # default: all of token_ids at construction
    status: Status = Status.WAITING
    finish_reason: Optional[FinishReason] = None

    # KV state, recorded by the scheduler from the KV manager.
    row: Optional[int] = None                  # request-to-token table row while it holds KV
    kv_len: int = 0                            # leading tokens whose KV is cached for this request
    prefix_len: int = 0                        # leading tokens shared from the radix cache
    radix_node: object = None                  # locked radix node holding that prefix
    cached_tokens: int = 0                     # prompt tokens served from the radix cache at admission
    overtaken: int = 0                         # times a later request was admitted while this one waited
    # The client request it answers (its choices and prompts share one): the unit of fair shares.
    group: str = ""

    # Text state: output text decoded so far (stop strings are checked on it).
    text: str = ""
    detok: object = field(default=None, repr=False)
    checked_text_len: int = 0                  # text already searched for stop strings
    stop_text_cut: Optional[int] = None        # where a matched stop string starts in `text`

    # Structured output: a RequestGrammar at the state of the committed tokens (engine/core/grammar.py).
    grammar: object = field(default=None, repr=False)
    # Logprobs of the output tokens, when asked: per token (logprob, [(token id, logprob)] best first).
    return_logprob: bool = False
    top_logprobs_num: int = 0
    output_logprobs: list = field(default_factory=list, repr=False)

    # Predicted Outputs (engine/speculative/prediction.py): where the output stands in the prediction.
    prediction: object = field(default=None, repr=False)

    # Speculative counters.
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0              # draft tokens accepted (bonus tokens excluded)

    # Hidden states kept per forward when the engine captures them (training-data generation):
    # (first position, {layer index or "final": [n, H]}, argmax [n] with -1 where no logits were computed).
    captured: list = field(default_factory=list, repr=False)

    # Timings (time.perf_counter()).
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    retractions: int = 0

    def __post_init__(self):
        if self.prompt_len < 0:
            self.prompt_len = len(self.token_ids)
        self.group = self.group or self.rid

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.prompt_len]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def seq_len(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def remaining_tokens(self) -> int:
        return self.params.max_new_tokens - self.num_output
