"""Request bodies of the HTTP API (OpenAI's and SGLang's shapes), as pydantic models.

Unknown fields are refused (400 "Unsupported parameter") rather than silently ignored, so a client
never believes a setting took effect when it did not. Fields OpenAI (or SGLang) defines that this
server does not implement are declared with their neutral values alone (`suffix: ""`, `best_of: 1`), so
the schema says exactly what passes. Fields that change nothing about the answer on this server
(`store: false`, `metadata`, `service_tier`, `user`, `prompt_cache_key`, `safety_identifier`) are
accepted and ignored, as stock clients send them.
Types are strict, as OpenAI's are: `"5"` is not an integer, `1` is not a boolean, `5.0` is not a
token count. Ranges are checked once, by SamplingParams; text is checked here for what no tokenizer
can take.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

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


def _json_problem(value: Any) -> Optional[str]:
    """Why a JSON value (a schema, tool parameters) holds text no tokenizer takes, or None. Walked with
    a stack of its own: a value nested hundreds of levels deep must not exhaust Python's."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            problem = text_problem(node, allow_nul=True)
            if problem:
                return problem
        elif isinstance(node, dict):
            stack += [*node.keys(), *node.values()]
        elif isinstance(node, list):
            stack += node
    return None


def _check_json(value: Any) -> Any:
    problem = _json_problem(value)
    if problem:
        raise ValueError(f"a text in it {problem}")
    return value


# Most items in a list of messages, prompts, content parts or tools: checked while the list is validated,
# so that a body of 200k messages is refused after MAX_ITEMS of them, not after all (each message runs
# the text checks above, on the event loop).
MAX_ITEMS = 2048
Items = Field(max_length=MAX_ITEMS)

# A JSON object whose texts reach the tokenizer (tool parameters) or the grammar compiler (schemas).
JSONObject = Annotated[dict[str, Any], AfterValidator(_check_json)]


class APIBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(APIBody):
    include_usage: bool = False


class FunctionDefinition(APIBody):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[Text] = None
    parameters: Optional[JSONObject] = None          # a JSON schema; none: any arguments
    strict: Optional[bool] = None                    # arguments are always held to the schema when constrained


class Tool(APIBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(APIBody):
    name: Text


class NamedToolChoice(APIBody):
    type: Literal["function"]
    function: FunctionName


class JSONSchemaFormat(APIBody):
    name: Text
    description: Optional[Text] = None
    schema_: Optional[JSONObject] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(APIBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class TextPart(APIBody):
    type: Literal["text"]
    text: Text


class Prediction(APIBody):
    """OpenAI's Predicted Outputs: text the answer is expected to mostly repeat."""
    type: Literal["content"]
    content: Union[Text, Annotated[list[TextPart], Items]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


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
    # OpenAI's, accepted and ignored: nothing is stored (so store: true, which promises that, is
    # refused), requests are not tracked per user, every request is served at the one tier there is,
    # and the radix cache finds shared prefixes without a key.
    user: Optional[str] = None
    store: Optional[Literal[False]] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    # SGLang extensions.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: Optional[str] = None                      # SGLang's grammar constraints
    ebnf: Optional[str] = None
    json_schema: Optional[str] = None
    return_hidden_states: Literal[False] = False     # SGLang's; sglang-router sends its default
    prediction: Optional[Prediction] = None          # OpenAI's on chat; the same shape on completions

    def sampling_params(self, max_new_tokens: Optional[int]) -> dict[str, Any]:
        """SGLang sampling_params for the engine (validated there)."""
        values = {"max_new_tokens": max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "n": self.n, "seed": self.seed, "stop": self.stop, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty, "top_k": self.top_k, "min_p": self.min_p,
                  "repetition_penalty": self.repetition_penalty, "min_new_tokens": self.min_tokens,
                  "ignore_eos": self.ignore_eos, "stop_token_ids": self.stop_token_ids,
                  "skip_special_tokens": self.skip_special_tokens, "no_stop_trim": self.no_stop_trim,
                  "logit_bias": self.logit_bias, "regex": self.regex, "ebnf": self.ebnf,
                  "json_schema": self.json_schema, "prediction": self.prediction and self.prediction.text()}
        return {k: v for k, v in values.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)   # image/audio parts carry their own keys; refused by type
    type: str
    text: Optional[Text] = None

    @model_validator(mode="after")
    def _text_keys(self) -> "ContentPart":
        """A text part holds `type` and `text` alone, as OpenAI's does."""
        if self.type == "text":
            extra = sorted(self.model_extra or {})
            if extra:
                raise ValueError(f"a text part takes only 'type' and 'text'; {extra[0]!r} is not supported")
            if self.text is None:
                raise ValueError("a text part needs its 'text'")
        return self


class FunctionCall(APIBody):
    name: Text
    arguments: Text                                  # JSON text, as OpenAI sends it


class ToolCall(APIBody):
    id: Text
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(APIBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, Annotated[list[ContentPart], Items], None] = None
    name: Optional[Text] = None
    tool_calls: Optional[list[ToolCall]] = None      # an assistant turn's calls
    tool_call_id: Optional[Text] = None              # a tool turn's answer to that call


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_ITEMS)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[Annotated[list[Tool], Items]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None       # default: true, as OpenAI's
    response_format: Optional[ResponseFormat] = None
    # SGLang's; sglang-router sends them. Without a reasoning parser (SGLang's --reasoning-parser, which
    # this server lacks) there is no reasoning to separate or stream apart, so either value is honoured.
    continue_final_message: Literal[False] = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class CompletionRequest(_OpenAISampling):
    prompt: Union[Text, Annotated[list[Text], Items], list[int], Annotated[list[list[int]], Items]]
    echo: bool = False
    suffix: Optional[Literal[""]] = None
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)     # alternatives per token (OpenAI: at most 5)
    best_of: Optional[Literal[1]] = None


class GenerateRequest(APIBody):
    """SGLang's /generate: one prompt or a batch, as text or token ids."""
    text: Union[Text, Annotated[list[Text], Items], None] = None
    input_ids: Union[list[int], Annotated[list[list[int]], Items], None] = None
    sampling_params: Union[dict[str, Any], list[dict[str, Any]], None] = None   # a list: one per prompt
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    # SGLang's, which sglang-router sends at their defaults: any model name is served by this one, and
    # request metrics are not logged per request here whatever log_metrics says.
    model: Optional[str] = None
    log_metrics: bool = True
    return_hidden_states: Literal[False] = False
    background: Literal[False] = False
    no_logs: bool = False
    return_bytes: Literal[False] = False
    return_entropy: Literal[False] = False
    prediction: Optional[Prediction] = None          # Predicted Outputs, as on /v1/chat/completions
