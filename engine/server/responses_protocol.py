"""The request body of OpenAI's Responses API (POST /v1/responses), as pydantic models, and its
conversation as chat messages: the route runs it through the chat template like a chat completion.

As in protocol.py, unknown fields are refused and types are strict. What this server cannot do is
refused by name with its reason: stored responses (`store: true`, `previous_response_id`,
`conversation`), `background`, built-in tools, input that is not text, `include`, `reasoning` settings.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BeforeValidator, Discriminator, Field, Tag, model_validator

from engine.server.protocol import (MAX_ITEMS, APIBody, ChatMessage, FunctionCall, FunctionDefinition, Items,
                                    JSONObject, MaxTokens, NamedToolChoice, PromptText, TemplateKwargs, Text, Tool,
                                    ToolCall, ranged, together)

Status = Literal["in_progress", "completed", "incomplete"]
ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")


def refused(reason: str, neutral: Any = None, kind: Any = None) -> Any:
    """A field this server takes at its neutral value (and null) only, of type `kind` (default: that
    value's literal); any other value is refused with `reason`. The type must match too: JSON's 0 is no
    false (but 0.0 is the integer 0, as JSON Schema counts it)."""
    def check(value: Any) -> Any:
        if type(neutral) is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if value is not None and (type(value) is not type(neutral) or value != neutral):
            raise ValueError(reason)
        return value
    if kind is None:
        kind = Literal[neutral] if neutral is not None else None
    return Annotated[Optional[kind], BeforeValidator(check)]


NOT_STORED = "responses are not stored on this server"


class ContentPart(APIBody):
    """A text part of a message (input_text, or output_text as a response's message holds it); images,
    files, audio and refusals are refused by name. Annotations and logprobs, which a client sends back
    with a response's output, change nothing about the prompt."""
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: Optional[Annotated[list[JSONObject], Items]] = None
    logprobs: Optional[Annotated[list[JSONObject], Items]] = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind not in ("input_text", "output_text"):
            raise ValueError(f"content of type {kind!r}; this server takes text only (input_text, output_text)")
        return data


Content = Union[Text, Annotated[list[ContentPart], Items]]


def _text(content: Content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(APIBody):
    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: Optional[str] = None
    status: Optional[Status] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None


class FunctionCallItem(APIBody):
    """A call the model made (a response's function_call item, sent back with the conversation)."""
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text                                  # JSON text, as the model wrote it
    id: Optional[str] = None
    status: Optional[Status] = None


class FunctionCallOutputItem(APIBody):
    """What the client's function returned for a call: the chat template's tool turn."""
    type: Literal["function_call_output"]
    call_id: Text
    output: Content
    id: Optional[str] = None
    status: Optional[Status] = None


class ReasoningText(APIBody):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(APIBody):
    """A response's reasoning item, sent back with the conversation. Chat templates drop the thinking
    of earlier turns, so it adds nothing to the prompt."""
    type: Literal["reasoning"]
    summary: Annotated[list[ReasoningText], Items]
    content: Optional[Annotated[list[ReasoningText], Items]] = None
    encrypted_content: refused("encrypted reasoning comes from OpenAI's servers and cannot be read here") = None
    id: Optional[str] = None
    status: Optional[Status] = None


# Tags that are no parameter names, so that error locations read input.0.content. A message's type
# may be left out or null.
def _item_tag(value: Any) -> Optional[str]:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    kind = "message" if kind is None else kind
    return f"type={kind}" if kind in ITEM_KINDS else None


InputItem = Annotated[Union[Annotated[MessageItem, Tag("type=message")],
                            Annotated[FunctionCallItem, Tag("type=function_call")],
                            Annotated[FunctionCallOutputItem, Tag("type=function_call_output")],
                            Annotated[ReasoningItem, Tag("type=reasoning")]],
                      Discriminator(_item_tag, custom_error_type="unsupported_item", custom_error_message=(
                          "its type must be 'message', 'function_call', 'function_call_output' or 'reasoning': "
                          "this server runs no built-in tools and takes text only"))]


class FunctionTool(FunctionDefinition):
    """A function the model may call, in the Responses API's flat shape (chat nests it under "function")."""
    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"a tool of type {kind!r}; this server runs no built-in tools, only functions "
                             "your code runs (type 'function')")
        return data


class FunctionChoice(APIBody):
    type: Literal["function"]
    name: Text


class TextFormat(APIBody):
    type: Literal["text"]


class JSONObjectFormat(APIBody):
    type: Literal["json_object"]


class JSONSchemaFormat(APIBody):
    type: Literal["json_schema"]
    name: Text
    schema_: JSONObject = Field(alias="schema")
    description: Optional[Text] = None
    strict: Optional[bool] = None


def _format_tag(value: Any) -> Optional[str]:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type={kind}" if kind in ("text", "json_object", "json_schema") else None


class TextConfig(APIBody):
    format: Optional[Annotated[Union[Annotated[TextFormat, Tag("type=text")],
                                     Annotated[JSONObjectFormat, Tag("type=json_object")],
                                     Annotated[JSONSchemaFormat, Tag("type=json_schema")]],
                               Discriminator(_format_tag, custom_error_type="invalid_format", custom_error_message=(
                                   "its type must be 'text', 'json_object' or 'json_schema'"))]] = None
    verbosity: refused("verbosity is a hint to OpenAI's models; this server has no such setting") = None


class Reasoning(APIBody):
    effort: refused("the reasoning effort is not adjustable on this server; leave it out") = None
    summary: refused("reasoning summaries are not generated on this server; leave it out") = None
    generate_summary: refused("reasoning summaries are not generated on this server; leave it out") = None


class StreamOptions(APIBody):
    include_obfuscation: refused("stream events are not obfuscated on this server", False) = None


_JSON_FORMAT = {"properties": {"format": {"properties": {"type": {"enum": ["json_object", "json_schema"]}},
                                          "required": ["type"]}}, "required": ["format"]}
_TOOLS = {"type": "array", "minItems": 1}


class ResponsesRequest(APIBody):
    REFUSED = [
        # A JSON text format rules out tool calls; tool_choice other than none needs tools.
        together(text=_JSON_FORMAT, tools=_TOOLS),
        {"not": {"required": ["tool_choice"], "properties": {
            "tool_choice": {"not": {"anyOf": [{"type": "null"}, {"const": "none"}]}},
            "tools": {"anyOf": [{"type": "null"}, {"maxItems": 0}]}}}},
        # Reasoning items add nothing to the prompt: without instructions, input of them alone is empty.
        {"not": {"required": ["input"], "properties": {
            "input": {"type": "array", "items": {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}},
            "instructions": {"type": "null"}}}},
    ]
    model: Optional[str] = None
    input: Union[PromptText, Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS)]]
    instructions: Optional[Text] = None
    max_output_tokens: Optional[MaxTokens] = None
    temperature: Optional[float] = ranged("temperature")
    top_p: Optional[float] = ranged("top_p")
    tools: Optional[Annotated[list[FunctionTool], Items]] = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    parallel_tool_calls: Optional[bool] = None       # default: true, as OpenAI's
    text: Optional[TextConfig] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # OpenAI stores responses unless store is false; nothing is stored here, so an explicit true (a
    # promise that later calls can name this response) is refused, and absent means false.
    store: refused(f"{NOT_STORED}; leave store out or set it to false", False) = None
    previous_response_id: refused(f"{NOT_STORED}, so none can be continued; send the whole conversation "
                                  "in input") = None
    conversation: refused(f"{NOT_STORED}, nor are conversations; send the whole conversation in input") = None
    background: refused("background responses need stored responses, which this server does not keep; "
                        "leave background out or set it to false", False) = None
    include: refused("this server adds nothing to a response on request (no logprobs, encrypted reasoning or "
                     "tool results); leave include out", [], Annotated[list[str], Field(max_length=0)]) = None
    top_logprobs: refused("logprobs are not returned by this server's Responses API; use /v1/chat/completions "
                          "with logprobs", 0) = None
    reasoning: Optional[Reasoning] = None
    truncation: refused("truncation 'auto' would drop input items to fit the context; this server refuses an "
                        "input too long instead: leave truncation out or set it to 'disabled'", "disabled") = None
    # SGLang's and vLLM's extension, as on chat completions: more variables for the chat template
    # (enable_thinking false turns Qwen3's thinking off).
    chat_template_kwargs: Optional[TemplateKwargs] = None
    # Accepted and ignored, as on chat completions (protocol.py).
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None

    def sampling_params(self) -> dict[str, Any]:
        """SGLang sampling_params for the engine (validated there), before any grammar."""
        values = {"max_new_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p}
        return {k: v for k, v in values.items() if v is not None}

    def messages(self) -> list[ChatMessage]:
        """The conversation as chat messages: the instructions as a system turn first, a response's
        function calls as its assistant turn's tool_calls (one turn with the message before them), their
        outputs as tool turns."""
        out = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                out.append(ChatMessage(role=item.role, content=_text(item.content)))
            elif isinstance(item, FunctionCallItem):
                call = ToolCall(id=item.call_id, type="function",
                                function=FunctionCall(name=item.name, arguments=item.arguments))
                last = out[-1] if out else None
                if last is not None and last.role == "assistant":
                    last.tool_calls = [*(last.tool_calls or []), call]
                else:
                    out.append(ChatMessage(role="assistant", tool_calls=[call]))
            elif isinstance(item, FunctionCallOutputItem):
                out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output)))
        return out

    def chat_tools(self) -> list[Tool]:
        """The tools in chat's shape, {"type": "function", "function": {...}}, as chat templates and tool
        formats take them."""
        return [Tool.model_validate({"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)})
                for t in self.tools or ()]

    def chat_tool_choice(self) -> Union[str, NamedToolChoice, None]:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            return NamedToolChoice.model_validate({"type": "function", "function": {"name": choice.name}})
        return choice

