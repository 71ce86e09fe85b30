"""SamplingParams: a request's decoding settings, with SGLang's keys, defaults and validation."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

from engine.errors import RequestError

INT_MAX = 2 ** 31 - 1            # integer parameters fit in int32 wherever the sampler makes tensors of them
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024             # entries: OpenAI's own limit is 300
MAX_REASONING_END = 32            # tokens: matched against the output's tail at every token, in Python


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    integer: bool = False
    open_lo: bool = False             # lo itself excluded

    def bounds(self) -> dict:
        """pydantic Field arguments saying the same (the HTTP API's schema shows them)."""
        return {"gt" if self.open_lo else "ge": self.lo, "le": self.hi}


# Every number's range: one table for validate() and the HTTP API's schema (engine/server/protocol.py).
RANGES = {
    "max_new_tokens": Range(0, INT_MAX, True), "min_new_tokens": Range(0, INT_MAX, True),
    "temperature": Range(0.0, 100.0), "top_p": Range(0.0, 1.0, open_lo=True),
    "top_k": Range(-1, INT_MAX, True),            # -1 or 0: off; at or above the vocabulary size: off too
    "min_p": Range(0.0, 1.0), "frequency_penalty": Range(-2.0, 2.0), "presence_penalty": Range(-2.0, 2.0),
    # repetition_penalty divides a repeated token's positive logit: near 0 it rounds to 0 in float32 and sends
    # the logit to infinity (non-finite logprobs); at 0.01 or more logits stay finite.
    "repetition_penalty": Range(0.01, 10.0), "n": Range(1, INT_MAX, True),
    "seed": Range(-2 ** 63, 2 ** 63 - 1, True),
}
LOGIT_BIAS = Range(-100.0, 100.0)
# Grammar constraints (SGLang's names), at most one per request; compiled by engine/core/grammar.py.
CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")


def text_problem(text: str, allow_nul: bool = False) -> Optional[str]:
    """Why `text` cannot be a prompt (or, with allow_nul, a stop string), or None. A lone UTF-16
    surrogate (JSON allows "\\ud800") has no UTF-8 form: no tokenizer takes it, no output holds it. A
    NUL character in a prompt is almost always binary data or a C-string bug on the client's side, and
    is refused rather than guessed at; a model may well generate one, so a stop string may hold it."""
    if not allow_nul and "\x00" in text:
        return "contains a NUL character (\\u0000)"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"is not valid Unicode: a lone surrogate {text[exc.start]!r} at position {exc.start}"
    return None


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
    no_stop_trim: bool = False            # keep the matched stop string (or stop token) in the text
    seed: Optional[int] = None
    n: int = 1
    logit_bias: Optional[dict[str, float]] = None     # token id (as a string, OpenAI's form) -> added to its logit
    json_schema: Optional[str] = None                 # a JSON schema, as JSON text
    regex: Optional[str] = None
    ebnf: Optional[str] = None                        # xgrammar's EBNF (GBNF)
    structural_tag: Optional[str] = None              # an xgrammar structural tag, as JSON text
    # From the server's reasoning parser, or given on /generate: the grammar constrains only the output after
    # these tokens first appear in it (the end of the thinking); None: the whole output.
    reasoning_end: Optional[tuple[int, ...]] = None
    # Predicted Outputs: text (or token ids) the answer is expected to mostly repeat, verified as a draft.
    prediction: Union[str, list[int], None] = None

    @classmethod
    def from_dict(cls, values: Optional[dict[str, Any]]) -> "SamplingParams":
        values = dict(values or {})
        if "sampling_seed" in values:      # SGLang's newer spelling
            values.setdefault("seed", values.pop("sampling_seed"))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise RequestError(f"Unknown sampling parameter(s) {', '.join(unknown)}; "
                               f"supported: {', '.join(sorted(known))}.", unknown[0])
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        for key in ("stop", "stop_token_ids"):
            if values.get(key) is None:
                values.pop(key, None)
        if isinstance(values.get("reasoning_end"), list):      # JSON has no tuples
            values["reasoning_end"] = tuple(values["reasoning_end"])
        params = cls(**values)
        params.validate()
        return params

    def validate(self) -> None:
        """Types are checked strictly (a string is not a number, a bool is not an integer) and every
        number against its range, so nothing malformed reaches the engine loop."""
        for name, r in RANGES.items():
            value = getattr(self, name)
            if name == "seed" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int if r.integer else (int, float)):
                raise RequestError(f"{name} must be {'an integer' if r.integer else 'a number'}, got {value!r}.",
                                   name)
            if not (r.lo < value if r.open_lo else r.lo <= value) or not value <= r.hi:
                raise RequestError(f"{name} must be in {'(' if r.open_lo else '['}{r.lo}, {r.hi}], got {value!r}.",
                                   name)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}.", name)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop must be a non-empty string or a list of non-empty strings.", "stop")
        # Each step checks every stop string against the text's tail, in Python: keep that cheap.
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                               "characters each.", "stop")
        for s in self.stop:
            problem = text_problem(s, allow_nul=True)
            if problem:
                raise RequestError(f"stop {problem}.", "stop")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT_MAX for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be a list of token ids (integers >= 0).", "stop_token_ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids.", "stop_token_ids")
        self._validate_logit_bias()
        self._validate_constraint()
        self._validate_reasoning_end()
        self._validate_prediction()

    def _validate_prediction(self) -> None:
        pred = self.prediction
        if pred is None or isinstance(pred, str) and not text_problem(pred):
            return
        if isinstance(pred, str):
            raise RequestError(f"prediction {text_problem(pred)}.", "prediction")
        if not isinstance(pred, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT_MAX
                                                 for t in pred):
            raise RequestError("prediction must be text, or a list of token ids (integers >= 0).", "prediction")

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias must map token ids to numbers, at most {MAX_LOGIT_BIAS} of them.",
                               "logit_bias")
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isdigit() and key == str(int(key)) and int(key) <= INT_MAX):
                raise RequestError(f"logit_bias keys must be token ids written as strings, got {key!r}.", "logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not LOGIT_BIAS.lo <= value <= LOGIT_BIAS.hi:
                raise RequestError(f"logit_bias values must be numbers in [{LOGIT_BIAS.lo:g}, {LOGIT_BIAS.hi:g}], got "
                                   f"{value!r} for {key}.", "logit_bias")

    def _validate_constraint(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        for name in given:
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise RequestError(f"{name} must be a non-empty string.", name)
        if len(given) > 1:
            raise RequestError(f"Pass at most one of {', '.join(CONSTRAINTS)}; got {' and '.join(given)}.", given[1])
        # The grammar decides where the output ends: it allows EOS exactly where the text is complete.
        if given and self.ignore_eos:
            raise RequestError(f"ignore_eos cannot be combined with {given[0]}: the grammar ends the output.",
                               "ignore_eos")
        if given and self.min_new_tokens:
            raise RequestError(f"min_new_tokens cannot be combined with {given[0]}: the grammar decides the "
                               "length.", "min_new_tokens")

    def _validate_reasoning_end(self) -> None:
        end = self.reasoning_end
        if end is None:
            return
        if not isinstance(end, (list, tuple)) or not 0 < len(end) <= MAX_REASONING_END or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT_MAX for t in end):
            raise RequestError(f"reasoning_end must be a list of 1 to {MAX_REASONING_END} token ids (integers >= 0).",
                               "reasoning_end")
        if self.constraint is None:
            raise RequestError(f"reasoning_end says where a grammar starts; pass it with one of "
                               f"{', '.join(CONSTRAINTS)}.", "reasoning_end")

    @property
    def greedy(self) -> bool:
        # Below 1e-5 (SGLang's cut-off) dividing logits by the temperature overflows float32.
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def constraint(self) -> Optional[tuple[str, str]]:
        """(kind, text) of the grammar constraint, if any."""
        return next(((name, getattr(self, name)) for name in CONSTRAINTS if getattr(self, name) is not None), None)

    @property
    def has_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)
