"""SamplingParams: a request's decoding settings, with SGLang's keys, defaults and validation."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from engine.errors import RequestError


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                       # -1 or 0: no top-k
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False            # keep the matched stop string in the text
    seed: Optional[int] = None
    n: int = 1

    @classmethod
    def from_dict(cls, values: Optional[dict[str, Any]]) -> "SamplingParams":
        values = dict(values or {})
        if "sampling_seed" in values:      # SGLang's newer spelling
            values.setdefault("seed", values.pop("sampling_seed"))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise RequestError(f"Unknown sampling parameter(s) {', '.join(unknown)}; supported: {', '.join(sorted(known))}.")
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        for key in ("stop", "stop_token_ids"):
            if values.get(key) is None:
                values.pop(key, None)
        params = cls(**values)
        params.validate()
        return params

    def validate(self) -> None:
        def number(name: str, kind=(int, float)) -> Any:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise RequestError(f"{name} must be a number, got {value!r}.")
            return value

        if number("max_new_tokens", int) < 0:
            raise RequestError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}.")
        if number("min_new_tokens", int) < 0:
            raise RequestError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}.")
        if not 0.0 <= number("temperature") <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature}.")
        if not 0.0 < number("top_p") <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}.")
        if number("top_k", int) < -1:
            raise RequestError(f"top_k must be -1 (off) or >= 1, got {self.top_k}.")
        if not 0.0 <= number("min_p") <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}.")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= number(name) <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        if not 0.0 < number("repetition_penalty") <= 10.0:
            raise RequestError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}.")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop must be a non-empty string or a list of non-empty strings.")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be a list of non-negative integers.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise RequestError(f"seed must be an integer, got {self.seed!r}.")
        if number("n", int) < 1:
            raise RequestError(f"n must be >= 1, got {self.n}.")

    @property
    def greedy(self) -> bool:
        # Below 1e-5 (SGLang's cut-off) dividing logits by the temperature overflows float32.
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)
