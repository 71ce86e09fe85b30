"""--tool-call-parser's formats: each format's text split into content and calls exactly, whole and
streamed over every split; structural tags that compile and accept what the parser reads back; and a
constrained tiny model's call through the live server in more than one format."""

from __future__ import annotations

import dataclasses
import json

import openai
import pytest
import xgrammar as xgr

from engine.config import TOOL_CALL_PARSER_ALIASES, ServerArgs
from engine.server.protocol import NamedToolChoice, Tool
from engine.server.tool_calls import FORMATS, CannotConstrain, tool_format
from tests.scripted import MISTRAL_CALL, make_mistral_caller, make_scripted_model
from tests.serving import serve, server_args
from tests.tiny import TOOLS_CHAT_TEMPLATE, make_model, make_tokenizer

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def ds_call(name: str, arguments: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```<｜tool▁call▁end｜>"


HARMONY_CALL = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"


def coder_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# A template that shows Qwen3-Coder's calls, for the format read from it.
CODER_TEMPLATE = TOOLS_CHAT_TEMPLATE.replace('{"name": ..., "arguments": ...}',
                                             "<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>")
# The offered tools' parameter schemas every parser is given: qwen3_coder types its text values by them.
SCHEMAS = {"f": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "on": {"type": "boolean"}, "o": {"type": "object"},
    "s": {"type": "string"}, "l": {"type": ["array", "null"]}, "any": {"type": "custom"}, "t": {"description": "no type"}}}}

# (format, model text, content, calls as (name, arguments)).
CASES = [
    ("qwen25", "Hello", "Hello", []),
    ("qwen25", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "", [("f", {"a": 1})]),
    ("qwen25", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", '
     '"arguments": {"x": "<tool_call>"}}\n</tool_call>\nDone.', "Sure.\n\nDone.",
     [("f", {}), ("g", {"x": "<tool_call>"})]),
    ("qwen25", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ("qwen25", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ("qwen25", 'a <tool_call>{"name": "f"', 'a <tool_call>{"name": "f"', []),
    ("qwen25", "a <tool_c", "a <tool_c", []),
    ("llama3", '{"name": "f", "parameters": {"a": "}"}}', "", [("f", {"a": "}"})]),
    ("llama3", ' {"name": "f", "parameters": {}}; {"name": "g", "arguments": {"b": [1]}} Done.', "Done.",
     [("f", {}), ("g", {"b": [1]})]),
    ("llama3", 'Let me check.<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "Let me check.", [("f", {"a": 1})]),
    ("llama3", '{"answer": 42} is JSON, {"name": "f"} later is not a call', '{"answer": 42} is JSON, {"name": "f"} '
     "later is not a call", []),
    ("llama3", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("llama3", '<|python_tag|>{"name": "f", "para', '<|python_tag|>{"name": "f", "para', []),
    ("llama3", "x <|python", "x <|python", []),
    ("mistral", 'Ok. [TOOL_CALLS] [{"name": "f", "arguments": {"a": "]"}}, {"name": "g", "arguments": {}}] Bye.',
     "Ok.  Bye.", [("f", {"a": "]"}), ("g", {})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', "", [("f", {"a": 1}), ("g", {})]),
    ("mistral", "[TOOL_CALLS]f[ARGS]oops", "[TOOL_CALLS]f[ARGS]oops", []),
    ("mistral", '[TOOL_CALLS] [{"name": 1}]', '[TOOL_CALLS] [{"name": 1}]', []),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g"', ', {"name": "g"', [("f", {})]),
    ("mistral", "see [TOOL_CA", "see [TOOL_CA", []),
    ("deepseekv3", "Let me look.\n" + DS_BEGIN + ds_call("f", '{"a": 1}') + "\n" + ds_call("g", "{}") + DS_END,
     "Let me look.\n", [("f", {"a": 1}), ("g", {})]),
    ("deepseekv3", DS_BEGIN + ds_call("f", "{bad}") + DS_END, DS_BEGIN + ds_call("f", "{bad}") + DS_END, []),
    ("deepseekv3", DS_BEGIN + ds_call("f", "{bad}") + ds_call("g", '{"x": "```"}') + DS_END + " ok",
     DS_BEGIN + ds_call("f", "{bad}") + " ok", [("g", {"x": "```"})]),
    ("deepseekv3", DS_BEGIN + ds_call("f", "{}")[:-3], DS_BEGIN + ds_call("f", "{}")[:-3], []),
    ("pythonic", 'Sure: [get_weather(city="Paris", days=3), clock(zone=\'CET\', x=[1, {"a": None}], on=True)] ok',
     "Sure:  ok", [("get_weather", {"city": "Paris", "days": 3}), ("clock", {"zone": "CET", "x": [1, {"a": None}],
                                                                           "on": True})]),
    ("pythonic", 'see [1] and [f(x=open("y"))], [g(1)]', 'see [1] and [f(x=open("y"))], [g(1)]', []),
    ("pythonic", '<|python_start|>[f(a="])")]<|python_end|>', "", [("f", {"a": "])"})]),
    ("pythonic", "a list [f(a=1", "a list [f(a=1", []),
    ("gpt-oss", "<|channel|>analysis<|message|>Paris, then.<|end|><|start|>assistant" + HARMONY_CALL.format(
        "get_weather", '{"city": "Paris"}')[:-len("<|call|>")], "<|channel|>analysis<|message|>Paris, then.<|end|>",
     [("get_weather", {"city": "Paris"})]),
    ("gpt-oss", "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>"
     + "<|start|>assistant" + HARMONY_CALL.format("g", '{"a": 1}'), "", [("f", {}), ("g", {"a": 1})]),
    ("gpt-oss", "<|channel|>final<|message|>Hi", "<|channel|>final<|message|>Hi", []),
    ("gpt-oss", HARMONY_CALL.format("f", "{oops"), HARMONY_CALL.format("f", "{oops"), []),
    ("qwen3_coder", coder_call("f", n="3", x="2.5", on="true", o='{"a": [1]}', s="line 1\nline 2\n", more="42"),
     "", [("f", {"n": 3, "x": 2.5, "on": True, "o": {"a": [1]}, "s": "line 1\nline 2\n", "more": "42"})]),
    ("qwen3_coder", coder_call("f", n="x3", x="4", on="maybe", o="[1, 2", l="[1, 2]", any='{"k": 1}', t="7",
                                   s="null"), "",
     [("f", {"n": "x3", "x": 4, "on": "maybe", "o": "[1, 2", "l": [1, 2], "any": {"k": 1}, "t": "7", "s": None})]),
    ("qwen3_coder", "Sure.\n" + coder_call("f", x="1e3", any="a <b>") + "\n" + coder_call("g", n="5") + "\nDone.",
     "Sure.\n\nDone.", [("f", {"x": 1000.0, "any": "a <b>"}), ("g", {"n": "5"})]),
    ("qwen3_coder", "<tool_call><function=g></function></tool_call>", "", [("g", {})]),
    ("qwen3_coder", "a " + coder_call("f", n="1")[:-5], "a " + coder_call("f", n="1")[:-5], []),
    ("qwen3_coder", "<tool_call>\n<function=f>\nno parameters\n</function>\n</tool_call> ok",
     "<tool_call>\n<function=f>\nno parameters\n</function>\n</tool_call> ok", []),
    ("qwen3_coder", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', []),
]


def named(calls: list[dict]) -> list[tuple]:
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(fmt, chunks: list[str]) -> tuple[str, list[dict], int]:
    parser, content, calls, text = fmt.parser(SCHEMAS), "", [], ""
    for i, chunk in enumerate(chunks):
        text += chunk
        delta, new = parser.feed(text, final=i == len(chunks) - 1)
        content, calls = content + delta, calls + new
    return content, calls, parser.calls


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_and_streamed_over_every_split(name, text, content, calls):
    fmt = FORMATS[name]
    whole_content, whole_calls = fmt.parser(SCHEMAS).feed(text, final=True)
    assert (whole_content, named(whole_calls)) == (content, calls)
    splits = [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    for chunks in splits:
        got_content, got_calls, count = streamed(fmt, chunks)
        assert (got_content, named(got_calls), count) == (content, calls, len(calls)), chunks


def test_text_held_back_only_while_it_could_become_a_call():
    parser = FORMATS["qwen25"].parser()
    assert parser.feed("Hi <tool") == ("Hi ", [])
    assert parser.feed("Hi <tool!") == ("<tool!", [])
    parser = FORMATS["pythonic"].parser()
    assert parser.feed("a[0] b [c") == ("a[0] b ", [])
    assert parser.feed("a[0] b [c d") == ("[c d", [])


def test_formats_by_name_and_from_the_template():
    assert tool_format(None, TOOLS_CHAT_TEMPLATE).name == "qwen25"
    assert tool_format(None, "{{ messages }}") is None and tool_format(None, None) is None
    assert tool_format("llama3", TOOLS_CHAT_TEMPLATE).name == "llama3"
    assert tool_format("qwen", None) is tool_format("hermes", None) is FORMATS["qwen25"]
    assert tool_format(None, CODER_TEMPLATE).name == "qwen3_coder"
    # The flag's choices and the aliases it accepts are exactly the formats' names.
    flag = next(f for f in dataclasses.fields(ServerArgs) if f.name == "tool_call_parser")
    assert set(flag.metadata["choices"]) | set(TOOL_CALL_PARSER_ALIASES) == set(FORMATS)
    assert ServerArgs(tool_call_parser="hermes").tool_call_parser == "hermes"


WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}})
CLOCK = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})
NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
# What each format's tag lets a model write for get_weather(city="Paris"), once and twice.
ONE_CALL = {
    "qwen25": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "deepseekv3": DS_BEGIN + ds_call("get_weather", '{"city": "Paris"}') + DS_END,
    "gpt-oss": HARMONY_CALL.format("get_weather", '{"city": "Paris"}'),
}
TWO_CALLS = {
    "qwen25": ONE_CALL["qwen25"] + "\n" + ONE_CALL["qwen25"],
    "llama3": ONE_CALL["llama3"] + "; " + ONE_CALL["llama3"],
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
               '"arguments": {}}]',
    "deepseekv3": DS_BEGIN + ds_call("get_weather", '{"city": "Paris"}') + "\n" + ds_call("get_time", "{}") + DS_END,
    "gpt-oss": ONE_CALL["gpt-oss"] + "<|start|>assistant" + HARMONY_CALL.format("get_time", "{}"),
}


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    tokenizer = make_tokenizer(tmp_path_factory.mktemp("tok"))
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))


def accepts(compiler, tag: str, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(tag))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("name", sorted(ONE_CALL))
def test_structural_tags_compile_and_hold_what_the_parser_reads(name, compiler):
    fmt = FORMATS[name]
    one, two = ONE_CALL[name], TWO_CALLS[name]
    named_tag = fmt.structural_tag([WEATHER, CLOCK], NAMED, True)
    assert accepts(compiler, named_tag, one) and not accepts(compiler, named_tag, two)
    assert not accepts(compiler, named_tag, one.replace("Paris", "Oslo"))        # held to the schema
    assert accepts(compiler, fmt.structural_tag([WEATHER, CLOCK], "required", True), two)
    single = fmt.structural_tag([WEATHER, CLOCK], "required", False)
    assert accepts(compiler, single, one) and not accepts(compiler, single, two)
    assert not accepts(compiler, single, "Hello")
    compact = fmt.structural_tag([WEATHER, CLOCK], "required", True, compact=True)
    assert accepts(compiler, compact, two)
    # What the tag accepts, the parser reads back as calls, with no content.
    assert named(fmt.parser().feed(two, final=True)[1])[0] == ("get_weather", {"city": "Paris"})
    assert fmt.parser().feed(two, final=True)[0] == ""


@pytest.mark.parametrize("name", ["pythonic", "qwen3_coder"])
def test_formats_without_a_tag_cannot_be_constrained(name):
    with pytest.raises(CannotConstrain, match=name):
        FORMATS[name].structural_tag([WEATHER], "required", True)


# ---------------------------------------------------------------------------------------- live server
TOOL_CHOICE = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tools_model"), "llama", seed=3, max_pos=2048,
                      chat_template=TOOLS_CHAT_TEMPLATE)


@pytest.mark.parametrize("name", ["qwen25", "deepseekv3", "gpt-oss"])
def test_a_constrained_call_round_trips_in_each_format(name, model_dir):
    """The tiny model, held to the format's tag, writes a call the format's parser reads, whole and
    streamed as OpenAI streams calls."""
    tools = [WEATHER.model_dump(exclude_none=True), CLOCK.model_dump(exclude_none=True)]
    with serve(server_args(model_dir, tool_call_parser=name, constrained_json_disable_any_whitespace=True)) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], temperature=0, max_tokens=200,
                  tools=tools, tool_choice=TOOL_CHOICE)
        r = client.chat.completions.create(**kw)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        chunks = list(client.chat.completions.create(**kw, stream=True))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert [(d.index, d.type, d.function.name, d.function.arguments) for d in deltas] == [
            (0, "function", "get_weather", call.function.arguments)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_format_without_a_tag_refuses_required_and_named_choices(model_dir):
    with serve(server_args(model_dir, tool_call_parser="pythonic")) as live, live.http() as h:
        for choice in ("required", TOOL_CHOICE):
            r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "tools": [WEATHER.model_dump(exclude_none=True)],
                                                    "tool_choice": choice})
            assert r.status_code == 400 and "pythonic" in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == "tool_choice"
        ok = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "tools": [WEATHER.model_dump(exclude_none=True)]})
        assert ok.status_code == 200


# Mistral's marker is a special token, as in its tokenizers: detokenizing skips it unless tools are offered.
@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    model = make_mistral_caller(tmp_path_factory.mktemp("mistral"))
    with serve(server_args(model, tool_call_parser="mistral")) as live:
        yield live


def test_a_call_whose_marker_is_a_special_token_is_found(mistral):
    """With tools offered the output keeps its special tokens, so the parser sees [TOOL_CALLS]: a call,
    whole and streamed, and no EOS text after it (a matched stop token is not decoded into the text)."""
    client = openai.OpenAI(base_url=f"{mistral.url}/v1", api_key="none", max_retries=0)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], temperature=0, max_tokens=20,
              tools=[WEATHER.model_dump(exclude_none=True)])
    choice = client.chat.completions.create(**kw).choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert named([c.model_dump() for c in choice.message.tool_calls]) == [("get_weather", {"city": "Paris"})]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_weather", {"city": "Paris"})]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice "none" offers no tools: the request's own skip_special_tokens (true) holds, and the call
    # is text without its marker.
    plain = client.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert (plain.finish_reason, plain.message.content, plain.message.tool_calls) == ("stop", MISTRAL_CALL, None)


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_a_matched_stop_token_is_trimmed_from_the_text_unless_no_stop_trim(mistral, no_stop_trim):
    with mistral.http() as h:
        out = h.post("/generate", json={"text": "Weather?", "sampling_params": {
            "temperature": 0, "skip_special_tokens": False, "no_stop_trim": no_stop_trim}}).json()
    assert out["text"] == "[TOOL_CALLS]" + MISTRAL_CALL + ("</s>" if no_stop_trim else "")
    assert out["meta_info"]["finish_reason"]["type"] == "stop" and len(out["output_ids"]) == 3


# Qwen3-Coder's calls write values as text: the request's tool schemas type them, on both APIs.
FORECAST = {"name": "get_forecast", "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}}}


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    pieces = ["<tool_call>", "<function=get_forecast>", "<parameter=days>", "3", "</parameter>", "</function>",
              "</tool_call>"]
    model = make_scripted_model(tmp_path_factory.mktemp("coder"), pieces, chat_template=CODER_TEMPLATE)
    with serve(server_args(model)) as live:             # no --tool-call-parser: the template names the format
        yield live


def test_qwen3_coder_calls_take_their_types_from_the_tools(coder):
    client = openai.OpenAI(base_url=f"{coder.url}/v1", api_key="none", max_retries=0)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Forecast?"}], temperature=0, max_tokens=20,
              tools=[{"type": "function", "function": FORECAST}])
    choice = client.chat.completions.create(**kw).choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert named([c.model_dump() for c in choice.message.tool_calls]) == [("get_forecast", {"days": 3})]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_forecast", {"days": 3})]
    with coder.http() as h:
        out = h.post("/v1/responses", json={"input": "Forecast?", "temperature": 0, "max_output_tokens": 20,
                                            "tools": [{"type": "function", **FORECAST}]}).json()
        (item,) = out["output"]
        assert (item["type"], item["name"], json.loads(item["arguments"])) == ("function_call", "get_forecast",
                                                                              {"days": 3})
        # Its tags hold no JSON schema, so no call can be forced.
        r = h.post("/v1/chat/completions", json={**kw, "tool_choice": "required"})
        assert r.status_code == 400 and "qwen3_coder" in r.json()["error"]["message"]
