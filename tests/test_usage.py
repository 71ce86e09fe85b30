"""The usage object of chat and text completions: OpenAI's counts and details, and the `spec` extension
(engine/server/usage.py), whose verify steps and accepted draft tokens are the engine's own for that
request, whole and streamed, read by the official openai client; a server without speculation sends none.
With a reasoning parser, completion_tokens_details.reasoning_tokens counts the output's reasoning."""

from __future__ import annotations

import json

import openai
import pytest

from engine.server.choice_output import ChoiceParser
from engine.server.reasoning import FORMATS
from tests.scripted import make_scripted_model
from tests.serving import serve, server_args, sse
from tests.tiny import make_model

# The tiny model does not continue a pattern, so NGRAM's drafts come from its own earlier output of this
# prompt (the shared cache): a prompt sent twice gets drafts accepted the second time.
PROMPT = list(range(40, 48)) * 3
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("usage_model"), "llama")


@pytest.fixture(scope="module")
def speculative(model_dir):
    with serve(server_args(model_dir, speculative_algorithm="NGRAM", speculative_adaptive="off",
                           speculative_num_steps=4, speculative_eagle_topk=2, speculative_num_draft_tokens=8)) as s:
        with s.http() as c:         # the prompt's output, for NGRAM to draft from
            c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, **GREEDY}).raise_for_status()
        yield s


@pytest.fixture(scope="module")
def plain(model_dir):
    with serve(server_args(model_dir)) as s:
        yield s


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


class EngineFigures:
    """The engine-wide speculation counters (/get_server_info) around one request: what it added."""

    def __init__(self, live):
        self.live = live

    def read(self) -> tuple[int, int]:
        with self.live.http() as c:
            info = c.get("/get_server_info").json()
        steps = info["spec_verify_ct"]
        tokens = round((info["avg_spec_accept_length"] or 0) * steps)     # accepted drafts + a bonus per step
        return steps, tokens - steps

    def __enter__(self):
        self.before = self.read()
        return self

    def __exit__(self, *exc):
        after = self.read()
        self.steps, self.accepted = after[0] - self.before[0], after[1] - self.before[1]


def expected(figures: EngineFigures, completion_tokens: int) -> dict:
    return {"spec_verify_ct": figures.steps, "spec_accept_token_num": figures.accepted,
            "spec_accept_length": completion_tokens / figures.steps}


def test_whole_responses_carry_the_requests_own_figures(speculative):
    with EngineFigures(speculative) as figures:
        r = client(speculative).completions.create(model="tiny", prompt=PROMPT, max_tokens=24, extra_body=GREEDY)
    assert figures.accepted > 0                   # drafts were accepted: the figures can be told apart
    assert r.usage.completion_tokens == 24
    assert r.usage.spec == expected(figures, 24)  # the openai client keeps the extension as an attribute

    messages = [{"role": "user", "content": "one two three"}]
    with EngineFigures(speculative) as figures:
        r = client(speculative).chat.completions.create(model="tiny", messages=messages, max_tokens=16, n=2,
                                                        extra_body=GREEDY)
    assert r.usage.completion_tokens == 32 and r.usage.spec == expected(figures, 32)      # both choices
    assert r.usage.completion_tokens_details is None                                       # no prediction


def test_streamed_usage_carries_them_too(speculative):
    with EngineFigures(speculative) as figures:
        chunks = list(client(speculative).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=24, stream=True, stream_options={"include_usage": True},
            extra_body=GREEDY))
    assert chunks[-1].usage.spec == expected(figures, 24) and figures.accepted > 0

    body = {"messages": [{"role": "user", "content": "one two"}], "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}, **GREEDY}
    with EngineFigures(speculative) as figures, speculative.http() as c, c.stream(
            "POST", "/v1/chat/completions", json=body) as r:
        events = [json.loads(e) for e in sse(r) if e != "[DONE]"]
    assert events[-1]["usage"]["spec"] == expected(figures, 8)
    assert all("usage" not in e for e in events[:-1])


def test_predicted_outputs_keep_openais_details_beside_it(speculative):
    with speculative.http() as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "prediction": {
            "type": "content", "content": "one two three"}, **GREEDY}).json()
    details = r["usage"]["completion_tokens_details"]
    assert set(details) == {"accepted_prediction_tokens", "rejected_prediction_tokens"}
    assert r["usage"]["spec"]["spec_verify_ct"] > 0


def test_generate_names_the_accepted_draft_tokens(speculative):
    with EngineFigures(speculative) as figures, speculative.http() as c:
        meta = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 24, **GREEDY}}
                      ).json()["meta_info"]
    assert (meta["spec_verify_ct"], meta["spec_accept_token_num"]) == (figures.steps, figures.accepted)


def test_a_request_no_step_verified_has_zeros(speculative):
    r = client(speculative).completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body=GREEDY)
    assert r.usage.spec == {"spec_verify_ct": 0, "spec_accept_token_num": 0, "spec_accept_length": None}


def test_no_extension_without_speculation(plain):
    r = client(plain).completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body=GREEDY)
    assert r.usage.completion_tokens == 4 and r.usage.model_extra == {}
    chunks = list(client(plain).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body=GREEDY))
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.model_extra == {}


# ---------------------------------------------------------------------------------------- reasoning tokens
THINKING = ["<think>", "Hmm", " well", "</think>", "Yes", "."]     # four tokens of reasoning, its end's included


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    model = make_scripted_model(tmp_path_factory.mktemp("thinking"), THINKING)
    with serve(server_args(model, reasoning_parser="qwen3")) as s:
        yield s


def reasoning_usage(live, **body) -> tuple[int, int]:
    """A chat completion's (reasoning tokens, completion tokens), which its stream's usage (include_usage)
    repeats."""
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, **body}
    with live.http() as c:
        whole = c.post("/v1/chat/completions", json=body).json()["usage"]
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as r:
            streamed = [json.loads(d) for d in sse(r) if d != "[DONE]"][-1]["usage"]
    assert streamed == whole
    return whole["completion_tokens_details"]["reasoning_tokens"], whole["completion_tokens"]


def test_reasoning_tokens_count_the_output_up_to_the_end_of_its_reasoning(thinking):
    assert reasoning_usage(thinking) == (4, 7)                              # the EOS ends the answer
    assert reasoning_usage(thinking, separate_reasoning=False) == (4, 7)    # shown or not, the same tokens
    assert reasoning_usage(thinking, n=2) == (8, 14)
    assert reasoning_usage(thinking, max_tokens=2) == (2, 2)                # cut inside the reasoning
    assert reasoning_usage(thinking, chat_template_kwargs={"enable_thinking": False}) == (0, 7)
    r = client(thinking).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 temperature=0)
    assert r.usage.completion_tokens_details.reasoning_tokens == 4


@pytest.fixture(scope="module")
def closing(tmp_path_factory):
    """deepseek-r1's template opens the thinking in the prompt: this model's output closes it at once."""
    model = make_scripted_model(tmp_path_factory.mktemp("closing"), ["</think>", "Yes", "."])
    with serve(server_args(model, reasoning_parser="deepseek-r1")) as s:
        yield s


def test_chat_and_responses_count_the_same_reasoning_tokens(thinking, closing):
    """The Responses API counts as chat does: an output that opens with </think> was in a reasoning, its
    end marker the one reasoning token."""
    assert reasoning_usage(closing) == (1, 4)
    for live in (thinking, closing):
        chat = reasoning_usage(live)
        whole = client(live).responses.create(model="tiny", input="hi", temperature=0)
        with client(live).responses.stream(model="tiny", input="hi", temperature=0) as s:
            list(s)
            streamed = s.get_final_response()
        for r in (whole, streamed):
            assert (r.usage.output_tokens_details.reasoning_tokens, r.usage.output_tokens) == chat


def test_no_reasoning_tokens_without_a_reasoning_parser(plain):
    r = client(plain).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, extra_body=GREEDY)
    assert r.usage.completion_tokens_details is None


@pytest.mark.parametrize("name,text,reasoned", [
    ("qwen3", "<think>a</think>b", True), ("qwen3", "b", False), ("deepseek-r1", "</think>b", True),
    ("gpt-oss", "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b", True),
    ("gpt-oss", "<|channel|>final<|message|>b", False)])
def test_an_output_reasoned_where_its_parser_entered_a_reasoning(name, text, reasoned):
    for separate in (True, False):
        parser = ChoiceParser(FORMATS[name], None, separate=separate)
        parser.feed(text, final=True)
        assert parser.reasoned == reasoned
