"""Reasoning parsers (--reasoning-parser) on scripted tiny models (tests/scripted.py): the answer split into
reasoning_content and content exactly, whole and streamed, the parts joining back into the raw text, under
plain decoding and every algorithm; separate_reasoning, stream_reasoning, chat_template_kwargs, output
that ends inside the reasoning, tool calls after it, --chat-template, and the openai client."""

from __future__ import annotations

import json

import openai
import pytest

from engine import ServerArgs
from engine.errors import ConfigError
from engine.server.choice_output import ChoiceParser
from engine.server.protocol import TEMPLATE_ARGUMENTS
from engine.server.reasoning import FORMATS
from engine.server.tool_calls import tool_format
from tests.drafts import ALGOS, draft_setup
from tests.scripted import make_scripted_model
from tests.serving import serve, server_args, sse

TURNS = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
# DeepSeek-R1's and Qwen3-Thinking's templates open the thinking in the prompt; Qwen3's leaves it to the
# model unless enable_thinking is false; DeepSeek-V3.1's opens it with thinking, else closes it.
OPENED = TURNS + "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
QWEN3 = TURNS + ("{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and enable_thinking "
                 "is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
V3 = TURNS + "{% if add_generation_prompt %}<|assistant|>{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}"
HARMONY = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
           "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]

# Scripts, one token a piece. </think> in three tokens (split across tokens, and across chunks where a
# step brings one token); a bigram model says each token once, so Harmony's second header spells its
# markers in two plain tokens each (the same text).
SPLIT_THINK = ["Let", " me", " see", "</", "think", ">", "The", " answer", " is", " 4", "."]
WHOLE_THINK = ["<think>", "Hmm", "</think>", "Yes", "."]
HARMONY_SCRIPT = ["<|channel|>", "analysis", "<|message|>", "We", " add", "<|end|>", "<|start|>", "<|chan", "nel|>",
                  "final", "<|mess", "age|>", "Four"]
# Per parser: the model (script, template), the request's chat_template_kwargs, and how reasoning and
# content join back into the raw text.
CASES = {
    "deepseek-r1": ("split", OPENED, {}, "{r}</think>{c}"),
    "qwen3-thinking": ("split", OPENED, {}, "{r}</think>{c}"),
    "qwen3": ("whole", QWEN3, {}, "<think>{r}</think>{c}"),
    # The prompt ends in the script's <think>, so the model goes on from there, as V3.1 does.
    "deepseek-v3": ("whole", V3, {"thinking": True}, "{r}</think>{c}"),
    # <|return|>, the EOS, is trimmed from the text as every matched stop token is.
    "gpt-oss": ("harmony", HARMONY, {},
                "<|channel|>analysis<|message|>{r}<|end|><|start|><|channel|>final<|message|>{c}"),
}
SPLITS = {"split": ("Let me see", "The answer is 4."), "whole": ("Hmm", "Yes."), "harmony": ("We add", "Four")}
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
VERDICT = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}}, "required": ["verdict"],
           "additionalProperties": False}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    return {"split": make_scripted_model(root / "split", SPLIT_THINK, chat_template=OPENED),
            "whole": make_scripted_model(root / "whole", WHOLE_THINK, chat_template=QWEN3),
            "harmony": make_scripted_model(root / "harmony", HARMONY_SCRIPT, special=HARMONY_MARKERS, end="<|return|>",
                                           chat_template=HARMONY)}


def template_file(tmp_path_factory, text: str):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(text)
    return str(path)


def start(models, tmp_path_factory, parser: str, algo=None, **flags):
    """A server on the parser's scripted model, with its template given by --chat-template."""
    model, template, _, _ = CASES[parser]
    kw = draft_setup(algo, models[model], tmp_path_factory.mktemp(algo), vocab=vocab(models[model])) if algo else {}
    if algo:
        kw |= dict(speculative_algorithm=algo, speculative_num_steps=3, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=6)
    path = kw.pop("model_path", str(models[model]))
    return serve(server_args(path, reasoning_parser=parser, chat_template=template_file(tmp_path_factory, template),
                             **kw, **flags))


def vocab(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def chat(live, stream: bool = False, **body) -> dict:
    """A chat completion as one message: streamed deltas joined (with the number of chunks that carried
    reasoning), or the whole response's."""
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 40, "stream": stream, **body}
    with live.http() as h:
        if not stream:
            r = h.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return {**choice["message"], "finish_reason": choice["finish_reason"]}
        message = {"reasoning_content": "", "content": "", "reasoning_chunks": 0}
        with h.stream("POST", "/v1/chat/completions", json=body) as r:
            for data in sse(r):
                if data == "[DONE]":
                    break
                choice = json.loads(data)["choices"][0]
                delta = choice["delta"]
                message["reasoning_content"] += delta.get("reasoning_content") or ""
                message["content"] += delta.get("content") or ""
                message["reasoning_chunks"] += bool(delta.get("reasoning_content"))
                message["finish_reason"] = choice["finish_reason"]
        return message


# ---------------------------------------------------------------------------------------- the parsers alone
PARSED = [
    ("deepseek-r1", {}, "a</think>b", "a", "b"),
    ("deepseek-r1", {}, "<think>a</think>b", "a", "b"),             # R1-0528 writes the opening tag too
    ("deepseek-r1", {}, "a</thi", "a</thi", ""),                     # cut inside: reasoning, as written
    ("deepseek-r1", {}, "a</think>b</think>", "a", "b</think>"),
    ("qwen3-thinking", {}, "a</think>b", "a", "b"),
    ("qwen3", {}, "<think>a</think>b", "a", "b"),
    ("qwen3", {}, "b <think>a</think>", "", "b <think>a</think>"),   # only an opening tag opens
    ("qwen3", {}, "<thi", "", "<thi"),
    ("qwen3", {"enable_thinking": False}, "<think>a</think>b", "", "<think>a</think>b"),
    ("deepseek-v3", {}, "a</think>b", "", "a</think>b"),
    ("deepseek-v3", {"thinking": True}, "a</think>b", "a", "b"),
    ("gpt-oss", {}, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b<|return|>",
     "a", "b"),
    ("gpt-oss", {}, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
                    "<|start|>assistant<|channel|>commentary<|message|>c<|end|>", "ab", "c"),
    ("gpt-oss", {}, "<|channel|>analysis<|message|>a", "a", ""),
    ("gpt-oss", {}, "plain <|chan", "", "plain <|chan"),
    ("gpt-oss", {}, '<|channel|>analysis<|message|>a<|end|>{"b": 1}<|return|>', "a", '{"b": 1}'),   # a grammar's
]


@pytest.mark.parametrize("name,kwargs,text,reasoning,content", PARSED)
def test_parsers_split_whole_and_one_character_at_a_time(name, kwargs, text, reasoning, content):
    whole = ChoiceParser(FORMATS[name], None, kwargs).feed(text, final=True)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    parser, got = ChoiceParser(FORMATS[name], None, kwargs), ["", ""]
    for end in range(len(text) + 1):            # the worst split: one character at a time
        delta = parser.feed(text[:end], final=end == len(text))
        got[0] += delta.reasoning
        got[1] += delta.content
    assert got == [reasoning, content]


def test_harmony_calls_pass_whole_to_the_tool_parser():
    call = '<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>'
    text = "<|channel|>analysis<|message|>need f<|end|>" + call
    assert ChoiceParser(FORMATS["gpt-oss"], None).feed(text, final=True).content == call
    parsed = ChoiceParser(FORMATS["gpt-oss"], tool_format("gpt-oss", None)).feed(text, final=True)
    assert parsed.reasoning == "need f" and parsed.content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.calls] == [("f", {"a": 1})]


def test_stream_reasoning_false_holds_each_stretch_whole():
    parser = ChoiceParser(FORMATS["deepseek-r1"], None, stream_reasoning=False)
    deltas = [parser.feed(t) for t in ("ab", "abc</th", "abc</think>d")] + [parser.feed("abc</think>de", final=True)]
    assert [(d.reasoning, d.content) for d in deltas] == [("", ""), ("", ""), ("abc", "d"), ("", "e")]
    cut = ChoiceParser(FORMATS["deepseek-r1"], None, stream_reasoning=False)
    assert (cut.feed("ab").reasoning, cut.feed("abc", final=True).reasoning) == ("", "abc")


def test_the_flag_takes_exactly_the_parsers_names():
    for name in FORMATS:
        ServerArgs(model_path="x", reasoning_parser=name)
    with pytest.raises(ConfigError, match="--reasoning-parser must be one of") as refused:
        ServerArgs(model_path="x", reasoning_parser="kimi")
    assert set(str(refused.value).split("one of ")[1].split(";")[0].split(", ")) == set(FORMATS)


# ---------------------------------------------------------------------------------------- every algorithm
@pytest.fixture(scope="module", params=[(p, a) for p in CASES for a in [None, *ALGOS]],
                ids=lambda pa: f"{pa[0]}-{pa[1] or 'plain'}")
def scripted(request, models, tmp_path_factory):
    parser, algo = request.param
    with start(models, tmp_path_factory, parser, algo, constrained_json_disable_any_whitespace=True) as live:
        yield parser, live


def test_reasoning_and_content_split_exactly_whole_and_streamed(scripted):
    """The parts equal the script's, join back into the raw text (separate_reasoning false), and a
    stream's deltas add up to them: one token a chunk, and many (the raw text as a Predicted Output)."""
    parser, live = scripted
    model, _, kwargs, joined = CASES[parser]
    reasoning, content = SPLITS[model]
    raw = chat(live, separate_reasoning=False, chat_template_kwargs=kwargs)
    assert raw["content"] == joined.format(r=reasoning, c=content) and raw.get("reasoning_content") is None
    prediction = {"type": "content", "content": raw["content"]}
    for stream in (False, True):
        for extra in ({}, {"prediction": prediction}):
            got = chat(live, stream, chat_template_kwargs=kwargs, **extra)
            assert (got["reasoning_content"], got["content"], got["finish_reason"]) == (reasoning, content, "stop")


def test_a_json_schema_constrains_the_answer_not_the_reasoning(scripted):
    """The reasoning is the script's own; the answer, which the script would not write, is the schema's."""
    parser, live = scripted
    model, _, kwargs, _ = CASES[parser]
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    for stream in (False, True):
        got = chat(live, stream, chat_template_kwargs=kwargs, response_format=fmt)
        assert got["reasoning_content"] == SPLITS[model][0] and got["finish_reason"] == "stop"
        assert json.loads(got["content"]) in ({"verdict": "yes"}, {"verdict": "no"})


# ---------------------------------------------------------------------------------------- request options
@pytest.fixture(scope="module")
def r1(models, tmp_path_factory):
    with start(models, tmp_path_factory, "deepseek-r1") as live:
        yield live


@pytest.fixture(scope="module")
def qwen3(models, tmp_path_factory):
    with start(models, tmp_path_factory, "qwen3") as live:
        yield live


def test_stream_reasoning_false_sends_the_reasoning_in_one_chunk(r1):
    got = chat(r1, stream=True, stream_reasoning=False)
    assert (got["reasoning_content"], got["content"], got["reasoning_chunks"]) == ("Let me see", "The answer is 4.", 1)


@pytest.mark.parametrize("max_tokens,reasoning", [(2, "Let me"), (4, "Let me see</")])
def test_output_that_ends_inside_the_reasoning_is_reasoning(r1, max_tokens, reasoning):
    for stream in (False, True):
        got = chat(r1, stream, max_tokens=max_tokens)
        assert (got["reasoning_content"], got["content"], got["finish_reason"]) == (reasoning, "", "length")
    held = chat(r1, True, max_tokens=max_tokens, stream_reasoning=False)
    assert (held["reasoning_content"], held["reasoning_chunks"]) == (reasoning, 1)


def test_enable_thinking_false_reaches_the_template_and_turns_the_parser_off(qwen3):
    with qwen3.http() as h:
        on, off = (h.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 40,
                                                         "chat_template_kwargs": kwargs}).json()
                   for kwargs in ({}, {"enable_thinking": False}))
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]      # the template's empty block
    assert on["choices"][0]["message"]["reasoning_content"] == "Hmm"
    assert off["choices"][0]["message"] == {"role": "assistant", "content": "<think>Hmm</think>Yes.",
                                            "reasoning_content": None}


def test_chat_template_kwargs_are_checked_as_the_schema_says(qwen3):
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    with qwen3.http() as h:
        schema = {"$ref": "#/components/schemas/ChatCompletionRequest", **h.get("/openapi.json").json()}
        for kwargs in ({"enable_thinking": "no"}, {"add_generation_prompt": False}, {"tools": []}, [1]):
            body = {"messages": MESSAGES, "chat_template_kwargs": kwargs}
            r = h.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
            assert not jsonschema_rs.Draft202012Validator(schema).is_valid(body)
        body = {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": True, "x": [1]}}
        assert h.post("/v1/chat/completions", json=body).status_code == 200
        assert jsonschema_rs.Draft202012Validator(schema).is_valid(body)


def test_the_template_arguments_refused_are_those_of_the_installed_transformers():
    """chat_template_kwargs may not name apply_chat_template's own arguments (they would never reach the
    template); the list is written out, so that the request models load without transformers."""
    from inspect import signature

    from transformers import PreTrainedTokenizerBase

    own = set(signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
    assert own <= set(TEMPLATE_ARGUMENTS) and "messages" in TEMPLATE_ARGUMENTS

def test_the_openai_client_reads_reasoning_content(r1):
    client = openai.OpenAI(base_url=f"{r1.url}/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=40)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("Let me see", "The answer is 4.")
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=40,
                                                 stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("Let me see", "The answer is 4.")



def test_generate_starts_a_grammar_at_reasoning_end(qwen3):
    """/generate's reasoning_end (token ids): the output is free up to and with their first appearance,
    the grammar's after; refused without a grammar and outside the vocabulary, as the schema says."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    with qwen3.http() as h:
        def generate(**sampling):
            return h.post("/generate", json={"text": "What is 2+2?", "sampling_params": {
                "temperature": 0, "max_new_tokens": 20, **sampling}})

        free = generate().json()
        assert free["text"] == "<think>Hmm</think>Yes."
        end = free["output_ids"][2:3]                                   # </think>
        assert generate(regex="(yes|no)", reasoning_end=end).json()["text"] in ("<think>Hmm</think>yes",
                                                                                 "<think>Hmm</think>no")
        assert generate(regex="(yes|no)").json()["text"] in ("yes", "no")
        schema = {"$ref": "#/components/schemas/GenerateRequest", **h.get("/openapi.json").json()}
        r = generate(reasoning_end=end)
        assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.reasoning_end"
        assert "reasoning_end says where a grammar starts; pass it with one of" in r.json()["error"]["message"]
        r = generate(regex="(yes|no)", reasoning_end=[10 ** 6])
        assert r.status_code == 400 and "reasoning_end names token 1000000, outside the vocabulary" in r.text
        assert not jsonschema_rs.Draft202012Validator(schema).is_valid(
            {"text": "hi", "sampling_params": {"reasoning_end": end}})
        assert jsonschema_rs.Draft202012Validator(schema).is_valid(
            {"text": "hi", "sampling_params": {"regex": "(yes|no)", "reasoning_end": end}})

# ---------------------------------------------------------------------------------------- tool calls after it
TOOLS_TEMPLATE = "{% if tools %}<|system|>{% for t in tools %}{{ t | tojson }}{% endfor %}</s>{% endif %}" + QWEN3
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_SCRIPT = ["<think>", "Weather", " first", "</think>", "<tool_call>",
               '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>"]


@pytest.mark.parametrize("tool_choice", ["auto", "required"])        # required: a grammar after the reasoning
def test_a_tool_call_after_the_reasoning(tmp_path_factory, tool_choice):
    model = make_scripted_model(tmp_path_factory.mktemp("caller"), CALL_SCRIPT, chat_template=TOOLS_TEMPLATE)
    with serve(server_args(model, reasoning_parser="qwen3", tool_call_parser="qwen25")) as live:
        body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 40, "tools": [WEATHER], "tool_choice": tool_choice}
        with live.http() as h:
            choice = h.post("/v1/chat/completions", json=body).json()["choices"][0]
            with h.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
                chunks = [json.loads(d) for d in sse(r) if d != "[DONE]"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["reasoning_content"] == "Weather first"
    assert message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Weather first"
    assert not "".join(d.get("content") or "" for d in deltas)
    assert [t["function"]["name"] for d in deltas for t in d.get("tool_calls") or []] == ["get_weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------------------------------- --chat-template
def test_chat_template_file_is_used_and_checked_at_start(models, tmp_path_factory, tmp_path):
    with start(models, tmp_path_factory, "deepseek-v3") as live:     # V3's template, given as a file
        plain = chat(live)
        assert (plain["content"], plain["reasoning_content"]) == ("Yes.", None)
        bad = tmp_path / "raises.jinja"
        bad.write_text("{{ raise_exception('no system turns') }}")
    for path, problem in ((tmp_path / "missing.jinja", "cannot be read"), (tmp_path, "cannot be read")):
        with pytest.raises(ConfigError, match=problem):
            ServerArgs(model_path="x", chat_template=str(path))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="not a valid Jinja template"):
        ServerArgs(model_path="x", chat_template=str(broken))
    with serve(server_args(models["split"], chat_template=str(bad))) as live, live.http() as h:
        r = h.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert r.status_code == 400 and "no system turns" in r.json()["error"]["message"]
