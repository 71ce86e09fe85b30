"""OpenAI's Responses API (POST /v1/responses) through the live server and the official openai client:
the same greedy text as /v1/chat/completions for the same conversation, function calls out and their
outputs back in, JSON text formats, incomplete answers, OpenAI's stream events in order, and what the
server does not do refused with a 400 that says why."""

from __future__ import annotations

import json

import openai
import pytest

from tests.scripted import MISTRAL_CALL, make_mistral_caller, make_scripted_model
from tests.serving import serve, server_args, sse
from tests.tiny import TOOLS_CHAT_TEMPLATE, make_model

SCHEMA = {"type": "object", "properties": {"animal": {"enum": ["fox", "dog"]}, "legs": {"type": "integer",
          "minimum": 0, "maximum": 8}}, "required": ["animal", "legs"], "additionalProperties": False}
ANIMAL = {"type": "json_schema", "name": "animal", "schema": SCHEMA, "strict": True}
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {
    "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": WEATHER_PARAMETERS}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                  "parameters": WEATHER_PARAMETERS}}
QUESTION = "The quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("responses_model"), "llama", seed=3, max_pos=2048,
                      chat_template=TOOLS_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def live(model_dir):
    with serve(server_args(model_dir, constrained_json_disable_any_whitespace=True)) as s:
        yield s


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


def chat_text(client, messages, **kw):
    r = client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)
    return r.choices[0], r.usage


# ---------------------------------------------------------------------------------------- whole responses
def test_text_input_answers_as_chat_does(client):
    r = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=40, temperature=0)
    choice, usage = chat_text(client, [{"role": "user", "content": QUESTION}], max_tokens=40)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.output_text == message.content[0].text == choice.message.content
    assert r.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == usage.total_tokens and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.store is False and r.temperature == 0 and r.text.format.type == "text"


def test_items_and_instructions_make_the_chat_conversation(client):
    items = [{"role": "user", "content": "The quick"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "brown",
                                                                   "annotations": []}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fox"},
                                                             {"type": "input_text", "text": " jumps"}]}]
    r = client.responses.create(model="tiny", input=items, instructions="Be brief.", max_output_tokens=24,
                                temperature=0)
    choice, usage = chat_text(client, [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "The quick"}, {"role": "assistant", "content": "brown"},
                                       {"role": "user", "content": "fox jumps"}], max_tokens=24)
    assert r.output_text == choice.message.content and r.usage.input_tokens == usage.prompt_tokens
    assert r.instructions == "Be brief."


def test_max_output_tokens_leaves_the_response_incomplete(client):
    r = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=3, temperature=0)
    choice, _ = chat_text(client, [{"role": "user", "content": QUESTION}], max_tokens=3)
    assert choice.finish_reason == "length"           # the tiny model does not stop within 3 tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3 and r.max_output_tokens == 3


def test_json_schema_format_gives_valid_json(client):
    r = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=60, temperature=0,
                                text={"format": ANIMAL})
    value = json.loads(r.output_text)
    assert r.status == "completed" and value["animal"] in ("fox", "dog") and 0 <= value["legs"] <= 8
    assert set(value) == {"animal", "legs"} and r.text.format.name == "animal"
    # json_object: any object, under the grammar chat's response_format uses (the tiny model's strings
    # may run past the budget, so the text is compared, not parsed).
    anything = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=30, temperature=0,
                                       text={"format": {"type": "json_object"}})
    choice, _ = chat_text(client, [{"role": "user", "content": QUESTION}], max_tokens=30,
                          response_format={"type": "json_object"})
    assert anything.output_text == choice.message.content and anything.output_text.startswith("{")


def test_forced_function_call_and_its_output_round_trip(client):
    r = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=200, temperature=0, tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    arguments = json.loads(call.arguments)
    assert arguments["city"] in ("Paris", "Rome") and 1 <= arguments["days"] <= 7
    # The client sends the response's output back with the function's output: the chat template sees
    # an assistant turn with the call and a tool turn, as on /v1/chat/completions.
    history = [{"role": "user", "content": QUESTION}, *r.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}]
    again = client.responses.create(model="tiny", input=history, tools=[WEATHER], max_output_tokens=30, temperature=0)
    choice, usage = chat_text(client, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"celsius": 21}'}], tools=[CHAT_WEATHER],
        max_tokens=30)
    assert again.usage.input_tokens == usage.prompt_tokens
    assert [o.type for o in again.output][0] in ("message", "function_call")
    text = again.output_text
    assert text == (choice.message.content or "")


def test_required_tool_choice_calls_a_tool(client):
    r = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=200, temperature=0,
                                tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert [o.type for o in r.output] == ["function_call"] and r.tool_choice == "required"
    assert r.tools[0].name == "get_weather" and r.parallel_tool_calls is False


def test_speculation_is_lossless_and_reports_its_figures(model_dir, client):
    args = server_args(model_dir, speculative_algorithm="NGRAM", speculative_num_steps=4, speculative_eagle_topk=1,
                       speculative_num_draft_tokens=5)
    question = "one two three four five six seven eight nine ten " * 3
    with serve(args) as s:
        fast = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        r = fast.responses.create(model="tiny", input=question, max_output_tokens=32, temperature=0)
        choice, usage = chat_text(fast, [{"role": "user", "content": question}], max_tokens=32)
    plain = client.responses.create(model="tiny", input=question, max_output_tokens=32, temperature=0)
    assert r.output_text == plain.output_text == choice.message.content
    figures = r.usage.spec                                  # usage.py's extension, as on chat
    assert set(figures) == set(usage.spec) and figures["spec_verify_ct"] > 0
    assert figures["spec_accept_length"] == r.usage.output_tokens / figures["spec_verify_ct"]
    assert getattr(plain.usage, "spec", None) is None         # no speculation, no figures


# ---------------------------------------------------------------------------------------- streams
def test_stream_events_in_order_and_the_final_response(client):
    # A JSON schema makes the tiny model finish (its free text runs to any budget).
    kw = dict(model="tiny", input=QUESTION, max_output_tokens=60, temperature=0, text={"format": ANIMAL})
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and len(deltas) > 1
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == final.output_text == whole.output_text and whole.status == final.status == "completed"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id == events[0].response.id
    assert events[-2].item.status == "completed" and events[-2].item.id == events[2].item.id


def test_stream_ends_incomplete_when_cut(client):
    events = list(client.responses.create(model="tiny", input=QUESTION, max_output_tokens=3, temperature=0,
                                          stream=True))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    done = next(e for e in events if e.type == "response.output_item.done")
    assert done.item.status == "incomplete" and last.response.output[0].content[0].text == done.item.content[0].text


def test_stream_of_a_function_call(client):
    with client.responses.stream(model="tiny", input=QUESTION, max_output_tokens=200, temperature=0, tools=[WEATHER],
                                 tool_choice="required", parallel_tool_calls=False) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    (call,) = final.output
    assert "".join(arguments) == events[-3].arguments == call.arguments and call.type == "function_call"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")


# ---------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("body, param, words", [
    ({"store": True}, "store", "not stored"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    ({"conversation": "conv_1"}, "conversation", "not stored"),
    ({"background": True}, "background", "background"),
    ({"include": ["message.output_text.logprobs"]}, "include", "leave include out"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"truncation": "auto"}, "truncation", "drop input items"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "effort"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation", "obfuscated"),
    ({"tools": [{"type": "web_search"}]}, "tools.0", "no built-in tools"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input.0", "no built-in tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.content.0", "text only"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input.0.encrypted_content",
     "encrypted"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not among"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, "text.format", "rules out tool calls"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "json_schema"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens", "context length"),
    ({"input": ""}, "input", "at least 1"),
    ({"max_tool_calls": 3}, "max_tool_calls", "Unsupported parameter"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "set by the server"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs", "true or false"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "only reasoning items"),
])
def test_refusals_say_why(live, body, param, words):
    with live.http() as h:
        r = h.post("/v1/responses", json={"model": "tiny", "input": QUESTION} | body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and error["code"], error


@pytest.mark.parametrize("body, served", [
    ({"input": [{"type": "reasoning", "summary": []}]}, False),
    ({"input": [{"type": "reasoning", "summary": []}], "instructions": "Be brief."}, True),
    ({"input": [{"type": None, "role": "user", "content": "hi"}]}, True),      # a message's type may be null
])
def test_the_schema_and_the_server_agree(live, body, served):
    """Bodies schemathesis found answered 400 though the schema allowed them."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")        # schemathesis's
    with live.http() as h:
        spec = h.get("/openapi.json").json()
        r = h.post("/v1/responses", json=body | {"max_output_tokens": 2})
    assert r.status_code == (200 if served else 400), r.text
    assert jsonschema_rs.Draft202012Validator({"$ref": "#/components/schemas/ResponsesRequest", **spec}).is_valid(
        body) is served


def test_a_large_body_is_answered_as_a_small_one(live):
    """Bodies over 64 KiB are validated in a child process (engine/server/bodies.py) by the same model."""
    long = "The quick brown fox " * 5000
    with live.http() as h:
        refused = h.post("/v1/responses", json={"input": [{"role": "user", "content": long}], "store": True})
        too_long = h.post("/v1/responses", json={"input": [{"role": "user", "content": long}]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "store"
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


def test_store_false_and_absent_are_served(client, live):
    with live.http() as h:
        r = h.post("/v1/responses", json={"input": QUESTION, "store": False, "max_output_tokens": 2,
                                          "truncation": "disabled", "include": [], "metadata": {"k": "v"}})
    assert r.status_code == 200 and r.json()["store"] is False and r.json()["metadata"] == {"k": "v"}
    with live.http() as h:
        lines = list(sse(h.post("/v1/responses", json={"input": QUESTION, "stream": True, "max_output_tokens": 2})))
    assert [json.loads(lines[i])["type"] for i in (0, -1)] == ["response.created", "response.incomplete"]


def test_the_raw_stream_names_each_event_by_its_type(live):
    """As OpenAI's: `event: <type>` before each event's data, and no `data: [DONE]` after the last."""
    with live.http() as h:
        r = h.post("/v1/responses", json={"input": QUESTION, "stream": True, "max_output_tokens": 3})
    *frames, rest = r.text.split("\n\n")
    named = [frame.split("\n") for frame in frames]
    assert rest == "" and all(len(lines) == 2 for lines in named), r.text
    events = [(name.removeprefix("event: "), json.loads(data.removeprefix("data: "))) for name, data in named]
    assert all(name == event["type"] for name, event in events) and "[DONE]" not in r.text
    assert [events[i][0] for i in (0, -1)] == ["response.created", "response.incomplete"]


# ---------------------------------------------------------------------------------------- reasoning
# A scripted model (tests/scripted.py) that thinks, then calls a tool, in Qwen3's format.
THINKING_TEMPLATE = ("{% if tools %}<|system|>{% for t in tools %}{{ t | tojson }}{% endfor %}</s>{% endif %}"
                     "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and "
                     "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
THINK_THEN_CALL = ["<think>", "Weather", " first", "</think>", "<tool_call>",
                   '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>"]
CITY = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    model = make_scripted_model(tmp_path_factory.mktemp("thinker"), THINK_THEN_CALL, chat_template=THINKING_TEMPLATE)
    with serve(server_args(model, reasoning_parser="qwen3", tool_call_parser="qwen25",
                           constrained_json_disable_any_whitespace=True)) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


def test_reasoning_item_then_a_function_call(thinker):
    r = thinker.responses.create(model="tiny", input="Weather in Paris?", tools=[CITY], max_output_tokens=40)
    reasoning, call = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Weather first" and reasoning.summary == []
    assert call.type == "function_call" and (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    # <think> Weather first </think>: four tokens of reasoning, then three of the call and the end token.
    assert r.usage.output_tokens_details.reasoning_tokens == 4 and r.usage.output_tokens == 8
    with thinker.responses.stream(model="tiny", input="Weather in Paris?", tools=[CITY], max_output_tokens=40) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    thoughts = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.reasoning_text.delta"] * len(thoughts),
                     "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "".join(thoughts) == "Weather first" and [o.type for o in final.output] == ["reasoning", "function_call"]
    assert final.usage.output_tokens_details.reasoning_tokens == 4


def test_reasoning_that_runs_out_is_an_incomplete_reasoning_item(thinker):
    r = thinker.responses.create(model="tiny", input="Weather in Paris?", max_output_tokens=2)
    (reasoning,) = r.output
    assert r.status == "incomplete" and reasoning.status == "incomplete" and reasoning.content[0].text == "Weather"
    assert r.usage.output_tokens_details.reasoning_tokens == 2


def test_a_json_format_constrains_the_answer_after_the_reasoning(thinker):
    fmt = {"type": "json_schema", "name": "verdict", "schema": {
        "type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}}, "required": ["verdict"],
        "additionalProperties": False}}
    r = thinker.responses.create(model="tiny", input="Weather in Paris?", text={"format": fmt}, max_output_tokens=40)
    reasoning, message = r.output
    assert reasoning.content[0].text == "Weather first" and r.status == "completed"
    assert json.loads(message.content[0].text) in ({"verdict": "yes"}, {"verdict": "no"})


def test_reasoning_items_sent_back_add_nothing_to_the_prompt(thinker):
    first = thinker.responses.create(model="tiny", input="Weather in Paris?", tools=[CITY], max_output_tokens=40)
    reasoning, call = first.output
    turn = [{"role": "user", "content": "Weather in Paris?"}]
    done = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}
    with_reasoning = thinker.responses.create(model="tiny", input=[*turn, reasoning, call, done], tools=[CITY],
                                              max_output_tokens=1)
    without = thinker.responses.create(model="tiny", input=[*turn, call, done], tools=[CITY], max_output_tokens=1)
    assert with_reasoning.usage.input_tokens == without.usage.input_tokens



def test_enable_thinking_false_reaches_the_template_and_turns_the_reasoning_off(thinker):
    """chat_template_kwargs as on chat completions: Qwen3's template closes an empty thinking block, and
    the parser takes what the model writes as the answer."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    on = thinker.responses.create(model="tiny", input="Weather in Paris?", max_output_tokens=4)
    r = thinker.responses.create(model="tiny", input="Weather in Paris?", max_output_tokens=4, extra_body=off)
    chat = thinker.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           max_tokens=4, extra_body=off)
    assert [o.type for o in on.output] == ["reasoning"]
    (message,) = r.output
    assert message.type == "message" and r.output_text == "<think>Weather first</think>"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens > on.usage.input_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0


# ---------------------------------------------------------------------------------------- special-token markers
@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    with serve(server_args(make_mistral_caller(tmp_path_factory.mktemp("mistral")), tool_call_parser="mistral")) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


def test_a_call_whose_marker_is_a_special_token_is_found(mistral):
    """With tools offered the output keeps its special tokens, as on chat: the parser sees Mistral's
    [TOOL_CALLS], whole and streamed. tool_choice none offers no tools, and the call is text without it."""
    kw = dict(model="tiny", input="Weather in Paris?", tools=[CITY], max_output_tokens=20)
    (call,) = mistral.responses.create(**kw).output
    assert call.type == "function_call" and (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    with mistral.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.type for e in events if "text" in e.type] == []
    (streamed,) = final.output
    assert (streamed.type, streamed.name, streamed.arguments) == ("function_call", call.name, call.arguments)
    plain = mistral.responses.create(**kw, tool_choice="none")
    assert [o.type for o in plain.output] == ["message"] and plain.output_text == MISTRAL_CALL
