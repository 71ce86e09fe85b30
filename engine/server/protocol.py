"""Request bodies of the HTTP API (OpenAI's and SGLang's shapes), as pydantic models.

Unknown fields are refused (400 "Unsupported parameter") rather than silently ignored, so a client
never believes a setting took effect when it did not. Fields OpenAI (or SGLang) defines that this
server does not implement are declared with their neutral values alone (`suffix: ""`, `best_of: 1`), so
the schema says exactly what passes. Fields that change nothing about the answer on this server
(`store: false`, `metadata`, `service_tier`, `user`, `prompt_cache_key`, `safety_identifier`) are
accepted and ignored, as stock clients send them.
Types are strict, as OpenAI's are: `"5"` is not an integer, `1` is not a boolean; `5.0` is the
integer 5, as JSON Schema counts it (`5.5` is refused). Ranges are checked once, by SamplingParams;
text is checked here for what no tokenizer can take.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator

from engine.core.sampling_params import (CONSTRAINTS, INT_MAX, LOGIT_BIAS, MAX_LOGIT_BIAS, MAX_REASONING_END,
                                    MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, RANGES, text_problem)
from engine.server.reasoning import THINKING_SWITCHES


def _checked(allow_nul: bool):
    def check(text: str) -> str:
        problem = text_problem(text, allow_nul)
        if problem:
            raise ValueError(f"the text {problem}")
        return text
    return AfterValidator(check)


# Text that reaches the tokenizer, and stop strings. A JSON schema string is Unicode, so lone surrogates
# are outside it already; the pattern shows that a prompt holds no NUL.
Text = Annotated[str, _checked(allow_nul=False), Field(json_schema_extra={"pattern": r"^[^\x00]*$"})]
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


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Integers, written 5 or 5.0 (JSON Schema's integers; a client in JavaScript cannot tell them apart). The
# bounds go before the validator, or the schema would show pydantic's names for them ("ge"), not JSON's.
Int = Annotated[int, BeforeValidator(_integral)]
OptInt = Annotated[Optional[int], BeforeValidator(_integral)]


def integer(**bounds: int) -> Any:
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


TokenId = integer(ge=0, le=INT_MAX)
# A prompt: text or token ids, never empty (a list of prompts neither).
PromptText = Annotated[Text, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompts = Field(min_length=1, max_length=MAX_ITEMS)


def _only(expected: Any) -> Any:
    """A parameter of another server's API that this one accepts at one value only. JSON's 0 equals
    false in Python (and true equals 1), and pydantic's Literal takes either: the type must match too."""
    def check(value: Any) -> Any:
        value = _integral(value) if type(expected) is int else value
        if type(value) is not type(expected) or value != expected:
            raise ValueError(f"only {str(expected).lower()} is supported")
        return value
    return Annotated[Literal[expected], BeforeValidator(check)]


No = _only(False)

# A JSON object whose texts reach the tokenizer (tool parameters) or the grammar compiler (schemas).
JSONObject = Annotated[dict[str, Any], AfterValidator(_check_json)]


def _refused_in_schema(schema: dict, cls: type) -> None:
    schema.setdefault("allOf", []).extend(getattr(cls, "REFUSED", ()))
    if not schema["allOf"]:
        del schema["allOf"]


class APIBody(BaseModel):
    # REFUSED: JSON-schema clauses for combinations of fields the server refuses, so that the schema
    # offers no body the server answers 400 (schemathesis's "schema-valid request rejected").
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_refused_in_schema)
    REFUSED: ClassVar[list[dict]] = []


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
    schema_: JSONObject = Field(alias="schema")
    strict: Optional[bool] = None


class TextFormat(APIBody):
    type: Literal["text"]


class JSONObjectFormat(APIBody):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(APIBody):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


def _format_tag(value: Any) -> Optional[str]:
    # Tags that are no parameter names, so that error locations read response_format.json_schema.
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type={kind}" if kind in ("text", "json_object", "json_schema") else None


ResponseFormat = Annotated[Union[Annotated[TextFormat, Tag("type=text")],
                                 Annotated[JSONObjectFormat, Tag("type=json_object")],
                                 Annotated[JSONSchemaResponseFormat, Tag("type=json_schema")]],
                           Discriminator(_format_tag, custom_error_type="invalid_format_type", custom_error_message=(
                               "its type must be 'text', 'json_object' or 'json_schema'"))]


class TextPart(APIBody):
    """A text part of a message or a prediction, as OpenAI's; other kinds (images, audio) are refused
    by name."""
    type: Literal["text"]
    text: Text

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise ValueError(f"content of type {kind!r}; this server takes text only")
        return data


class Prediction(APIBody):
    """OpenAI's Predicted Outputs: text the answer is expected to mostly repeat."""
    type: Literal["content"]
    content: Union[Text, Annotated[list[TextPart], Items]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


def ranged(name: str, default: Any = None) -> Any:
    """A sampling number's field, with the range the engine checks (engine/core/sampling_params.py RANGES)."""
    return Field(default=default, **RANGES[name].bounds())


MaxTokens = integer(ge=1, le=INT_MAX)
Stop = Annotated[StopText, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def grammar(language: str) -> Any:
    """A grammar's text. Its format names the language, since a schema cannot say which texts compile
    (fuzzers learn them from benchmarks/schemathesis_formats.py). Regexes are xgrammar's dialect, not
    JSON Schema's `regex` format (ECMA 262)."""
    return Annotated[StopText, Field(min_length=1, json_schema_extra={"format": language})]


Regex, EBNF, JSONSchemaText, StructuralTag = (grammar(x) for x in ("xgrammar-regex", "ebnf", "json-schema",
                                                                     "structural-tag"))


# Pieces of REFUSED clauses.
GIVEN = {"not": {"type": "null"}}
ON = {"const": True}
SOME = {"type": "integer", "minimum": 1}


def together(**conditions: dict) -> dict:
    """Refuses a body in which every named field is present with a value its condition matches."""
    return {"not": {"required": list(conditions), "properties": conditions}}


def grammar_refused(grammars: tuple[str, ...], min_tokens: str) -> list[dict]:
    """One grammar at a time, and the grammar decides where the output ends (engine/core/sampling_params.py)."""
    return [together(**{a: GIVEN, b: GIVEN}) for i, a in enumerate(grammars) for b in grammars[i + 1:]] + [
        together(**{g: GIVEN, other: value})
        for g in grammars for other, value in (("ignore_eos", ON), (min_tokens, SOME))]


GRAMMARS = ("regex", "ebnf", "json_schema")
GRAMMAR_REFUSED = grammar_refused(GRAMMARS, "min_tokens")
# pydantic states the keys' pattern as patternProperties, which leave other keys free: they are not.
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")],
                           Annotated[float, Field(**LOGIT_BIAS.bounds())]],
                      Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False})]
Stops = Union[Stop, Annotated[list[Stop], Field(max_length=MAX_STOP_STRINGS)], None]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]


class _OpenAISampling(APIBody):
    """Sampling fields shared by chat and text completions (OpenAI's, plus SGLang's extensions)."""
    model: Optional[str] = None
    max_tokens: Optional[MaxTokens] = None
    temperature: Optional[float] = ranged("temperature")
    top_p: Optional[float] = ranged("top_p")
    n: Int = ranged("n", 1)
    seed: OptInt = ranged("seed")
    stop: Stops = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = ranged("presence_penalty")
    frequency_penalty: Optional[float] = ranged("frequency_penalty")
    logit_bias: Optional[LogitBias] = None
    # OpenAI's, accepted and ignored: nothing is stored (so store: true, which promises that, is
    # refused), requests are not tracked per user, every request is served at the one tier there is,
    # and the radix cache finds shared prefixes without a key.
    user: Optional[str] = None
    store: Optional[No] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    # SGLang extensions.
    top_k: OptInt = ranged("top_k")
    min_p: Optional[float] = ranged("min_p")
    repetition_penalty: Optional[float] = ranged("repetition_penalty")
    min_tokens: OptInt = ranged("min_new_tokens")
    ignore_eos: bool = False
    stop_token_ids: Optional[StopTokenIds] = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: Optional[Regex] = None                    # SGLang's grammar constraints (one at most: REFUSED)
    ebnf: Optional[EBNF] = None
    json_schema: Optional[JSONSchemaText] = None
    return_hidden_states: No = False     # SGLang's; sglang-router sends its default
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


class FunctionCall(APIBody):
    name: Text
    arguments: Text                                  # JSON text, as OpenAI sends it


class ToolCall(APIBody):
    id: Text
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(APIBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, Annotated[list[TextPart], Items], None] = None
    name: Optional[Text] = None
    tool_calls: Optional[list[ToolCall]] = None      # an assistant turn's calls
    tool_call_id: Optional[Text] = None              # a tool turn's answer to that call


# apply_chat_template's own arguments (transformers 4.51 to 5.x), which the server sets itself or which
# would not reach the template; the rest do. Written out, as importing transformers here would load it
# (and torch) into every child that parses a large body (bodies.py); tests/test_reasoning.py checks them
# against the installed transformers.
TEMPLATE_ARGUMENTS = ("messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
                      "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                      "tokenizer_kwargs")


def _template_kwargs(value: dict) -> dict:
    taken = [k for k in value if k in TEMPLATE_ARGUMENTS]
    if taken:
        raise ValueError(f"{taken[0]!r} is set by the server, not by the request")
    switch = next((k for k in THINKING_SWITCHES if k in value and not isinstance(value[k], bool)), None)
    if switch:
        raise ValueError(f"{switch} must be true or false, as the templates test it")
    return value


# chat_template_kwargs: more variables for the chat template (SGLang's and vLLM's field), the thinking
# switches of the reasoning parsers' templates among them.
TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_check_json), AfterValidator(_template_kwargs), Field(
    json_schema_extra={"propertyNames": {"not": {"enum": list(TEMPLATE_ARGUMENTS)}},
                       "properties": {k: {"type": "boolean"} for k in THINKING_SWITCHES}})]

_JSON_FORMAT = {"properties": {"type": {"enum": ["json_object", "json_schema"]}}, "required": ["type"]}
_TOOLS = {"type": "array", "minItems": 1}
_FORCED = {"anyOf": [{"const": "required"}, {"type": "object"}]}     # tool_choice that compiles a grammar


class ChatCompletionRequest(_OpenAISampling):
    REFUSED = GRAMMAR_REFUSED + [
        # A JSON response_format or a forced tool call is a grammar too.
        *(together(**cause, **{other: value}) for cause in ({"response_format": _JSON_FORMAT},
                                                             {"tools": _TOOLS, "tool_choice": _FORCED})
          for other, value in [(g, GIVEN) for g in GRAMMARS] + [("ignore_eos", ON), ("min_tokens", SOME)]),
        together(response_format=_JSON_FORMAT, tools=_TOOLS),
        # top_logprobs needs logprobs: true (as OpenAI's); tool_choice other than none needs tools.
        {"not": {"required": ["top_logprobs"], "properties": {"top_logprobs": SOME, "logprobs": {"not": ON}}}},
        {"not": {"required": ["tool_choice"], "properties": {
            "tool_choice": {"not": {"anyOf": [{"type": "null"}, {"const": "none"}]}},
            "tools": {"anyOf": [{"type": "null"}, {"maxItems": 0}]}}}},
    ]
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_ITEMS)
    max_completion_tokens: Optional[MaxTokens] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[integer(ge=0, le=20)] = None
    tools: Optional[Annotated[list[Tool], Items]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None       # default: true, as OpenAI's
    response_format: Optional[ResponseFormat] = None
    # SGLang's. With --reasoning-parser: separate_reasoning false leaves the reasoning in the content;
    # stream_reasoning false sends each stretch of reasoning whole once it closes. Without one there is
    # no reasoning to separate, and either value is honoured.
    continue_final_message: No = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    chat_template_kwargs: Optional[TemplateKwargs] = None


class CompletionRequest(_OpenAISampling):
    # echo with logprobs would need the prompt's logprobs, which are not computed.
    REFUSED = GRAMMAR_REFUSED + [together(echo=ON, logprobs={"type": "integer"})]
    prompt: Union[PromptText, Annotated[list[PromptText], Prompts], TokenIds, Annotated[list[TokenIds], Prompts]]
    echo: bool = False
    suffix: Optional[Literal[""]] = None
    logprobs: Optional[integer(ge=0, le=20)] = None     # alternatives per token (OpenAI: at most 5)
    best_of: Optional[_only(1)] = None


# reasoning_end says where a grammar starts: not without one.
REASONING_END_ALONE = {"not": {"required": ["reasoning_end"], "properties": {"reasoning_end": GIVEN}, "not": {
    "anyOf": [{"required": [g], "properties": {g: GIVEN}} for g in CONSTRAINTS]}}}


class SGLangSampling(APIBody):
    """/generate's sampling_params: SGLang's names (engine/core/sampling_params.py); null is the default."""
    REFUSED = grammar_refused(CONSTRAINTS, "min_new_tokens") + [REASONING_END_ALONE]
    max_new_tokens: OptInt = ranged("max_new_tokens")
    min_new_tokens: OptInt = ranged("min_new_tokens")
    temperature: Optional[float] = ranged("temperature")
    top_p: Optional[float] = ranged("top_p")
    top_k: OptInt = ranged("top_k")
    min_p: Optional[float] = ranged("min_p")
    frequency_penalty: Optional[float] = ranged("frequency_penalty")
    presence_penalty: Optional[float] = ranged("presence_penalty")
    repetition_penalty: Optional[float] = ranged("repetition_penalty")
    stop: Stops = None
    stop_token_ids: Optional[StopTokenIds] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    seed: OptInt = ranged("seed")
    sampling_seed: OptInt = ranged("seed")        # SGLang's newer spelling
    n: OptInt = ranged("n")
    logit_bias: Optional[LogitBias] = None
    json_schema: Optional[JSONSchemaText] = None
    regex: Optional[Regex] = None
    ebnf: Optional[EBNF] = None
    structural_tag: Optional[StructuralTag] = None
    # spec's own: the token ids that end a reasoning model's thinking; the grammar starts where they first
    # appear in the output, which is free up to there (chat does this itself with --reasoning-parser).
    reasoning_end: Optional[Annotated[list[TokenId], Field(min_length=1, max_length=MAX_REASONING_END)]] = None
    prediction: Union[Text, TokenIds, None] = None


# With one prompt, sampling_params is one object, or a list of one.
_ONE_PROMPT = [{"required": [key], "properties": {key: single}} for key, single in
               (("text", {"type": "string"}), ("input_ids", {"type": "array", "items": {"type": "integer"}}))]


class GenerateRequest(APIBody):
    """SGLang's /generate: one prompt or a batch, as text or token ids."""
    REFUSED = [{"oneOf": [{"required": [key], "properties": {key: GIVEN}} for key in ("text", "input_ids")]},
               {"not": {"anyOf": _ONE_PROMPT, "required": ["sampling_params"], "properties": {
                   "sampling_params": {"type": "array", "not": {"minItems": 1, "maxItems": 1}}}}}]
    text: Union[PromptText, Annotated[list[PromptText], Prompts], None] = None
    input_ids: Union[TokenIds, Annotated[list[TokenIds], Prompts], None] = None
    # A list: one per prompt.
    sampling_params: Union[SGLangSampling, Annotated[list[SGLangSampling], Prompts], None] = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: integer(ge=0, le=20) = 0
    return_text_in_logprobs: bool = False
    # SGLang's, which sglang-router sends at their defaults: any model name is served by this one, and
    # request metrics are not logged per request here whatever log_metrics says.
    model: Optional[str] = None
    log_metrics: bool = True
    return_hidden_states: No = False
    background: No = False
    no_logs: bool = False
    return_bytes: No = False
    return_entropy: No = False
    prediction: Optional[Prediction] = None          # Predicted Outputs, as on /v1/chat/completions

    def sampling(self) -> Union[dict[str, Any], list[dict[str, Any]]]:
        """sampling_params as the engine takes them, with the prediction given beside them."""
        given = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params]
        extra = {"prediction": self.prediction.text()} if self.prediction is not None else {}
        out = [(s.model_dump(exclude_none=True) if s else {}) | extra for s in given]
        return out if isinstance(self.sampling_params, list) else out[0]
