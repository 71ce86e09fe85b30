"""Request bodies of the HTTP API (OpenAI's and SGLang's shapes), as pydantic models.

Unknown fields are refused (400 "Unsupported parameter") rather than silently ignored, so a client
never believes a setting took effect when it did not. Fields OpenAI defines that this server does not
implement are declared, so their neutral values (`logprobs: false`, `tools: []`, ...) still pass.
Types are strict, as OpenAI's are: `"5"` is not an integer, `1` is not a boolean, `5.0` is not a
token count. Ranges are checked once, by SamplingParams; text is checked here for what no tokenizer
can take.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from engine.sampling_params import text_problem


def _checked(allow_nul: bool):
    def check(text: str) -> str:
        problem = text_problem(text, allow_nul)
        if problem:
            raise ValueError(f"the text {problem}")
        return text
    return AfterValidator(check)


# Text that reaches the tokenizer, and stop strings.
Text = Annotated[str, _checked(allow_nul=False)]
StopText = Annotated[str, _checked(allow_nul=True)]


class APIBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # field -> the values that mean "not used"; anything else is refused as unsupported.
    NEUTRAL: ClassVar[dict[str, tuple]] = {}

    def unsupported(self) -> Optional[str]:
        """The first field set to a value this server cannot honour, if any."""
        for name, neutral in self.NEUTRAL.items():
            if getattr(self, name) not in neutral:
                return name
        return None


class StreamOptions(APIBody):
    include_usage: bool = False


class _OpenAISampling(APIBody):
    """Sampling fields shared by chat and text completions (OpenAI's, plus SGLang's extensions)."""
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Union[StopText, list[StopText], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None                       # accepted and ignored, as OpenAI does for abuse tracking
    # SGLang extensions.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def sampling_params(self, max_new_tokens: Optional[int]) -> dict[str, Any]:
        """SGLang sampling_params for the engine (validated there)."""
        values = {"max_new_tokens": max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "n": self.n, "seed": self.seed, "stop": self.stop, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty, "top_k": self.top_k, "min_p": self.min_p,
                  "repetition_penalty": self.repetition_penalty, "min_new_tokens": self.min_tokens,
                  "ignore_eos": self.ignore_eos, "stop_token_ids": self.stop_token_ids,
                  "skip_special_tokens": self.skip_special_tokens, "no_stop_trim": self.no_stop_trim}
        return {k: v for k, v in values.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)   # image/audio parts carry their own keys; refused by type
    type: str
    text: Optional[Text] = None


class ChatMessage(APIBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[ContentPart], None] = None
    name: Optional[Text] = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None

    NEUTRAL = {"logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []),
               "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
               "logit_bias": (None, {})}


class CompletionRequest(_OpenAISampling):
    prompt: Union[Text, list[Text], list[int], list[list[int]]]
    echo: bool = False
    suffix: Optional[str] = None
    logprobs: Optional[int] = None
    best_of: Optional[int] = None

    NEUTRAL = {"suffix": (None, ""), "logprobs": (None,), "best_of": (None, 1), "logit_bias": (None, {})}


class GenerateRequest(APIBody):
    """SGLang's /generate: one prompt or a batch, as text or token ids."""
    text: Union[Text, list[Text], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[dict[str, Any], list[dict[str, Any]], None] = None   # a list: one per prompt
    stream: bool = False
    return_logprob: bool = False

    NEUTRAL = {"return_logprob": (False,)}
