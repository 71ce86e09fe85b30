"""The HTTP server, live: real uvicorn on 127.0.0.1 over a tiny random model, driven by the official
openai client, raw HTTP and schemathesis. Outputs must equal the offline engine's; disconnects must
free KV; bad input must get a 4xx with an OpenAI error body; SIGTERM must exit 0."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine import Engine, ServerArgs
from engine.core.sampling_params import MAX_REASONING_END
from engine.server.limits import ReadDeadlineProtocol
from tests.planning import untimed
from tests.serving import Live, free_port, serve, server_args, sse
from tests.tiny import deep_schema, make_model

KEY = "test-key"
IGNORE_EOS = {"ignore_eos": True}
REPO = Path(__file__).resolve().parents[1]


def wait_until(ok, what: str, timeout: float = 60.0) -> None:
    """Polls for a state (never sleeps for a fixed time); the limit only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Hold:
    """Holds the engine loop after its first step that produces output (once that output is delivered),
    until released, so a test acts while its requests are surely mid-generation, however fast the
    machine; `aborted` is set once the server has asked the loop to abort anything (a client disconnect)."""

    def __init__(self, live: Live, monkeypatch):
        self.started, self.released, self.aborted = threading.Event(), threading.Event(), threading.Event()
        step, abort = live.engine.step, live.serving.loop.abort

        def held_step():
            if self.started.is_set():
                self.released.wait(120)
            out = step()
            if out:
                self.started.set()
            return out

        def spied_abort(rids):
            abort(rids)
            if rids:
                self.aborted.set()

        monkeypatch.setattr(live.engine, "step", held_step)
        monkeypatch.setattr(live.serving.loop, "abort", spied_abort)

    def __enter__(self) -> "Hold":
        return self

    def __exit__(self, *exc) -> None:
        self.released.set()


def wait_for(event: threading.Event, what: str) -> None:
    assert event.wait(120), f"timed out waiting for {what}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("server_model"), "llama")


@pytest.fixture(scope="module")
def live(model_dir):
    """The main server; its API key comes from SPEC_API_KEY, as `spec serve` users may set it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPEC_API_KEY", KEY)
        args = server_args(model_dir, max_queued_requests=64)
        with serve(args, {"Authorization": f"Bearer {KEY}"}) as s:
            mp.delenv("SPEC_API_KEY")
            yield s


@pytest.fixture(scope="module")
def small(model_dir):
    """A short context, a short queue and a small body limit keep every fuzzed request cheap."""
    with serve(server_args(model_dir, max_queued_requests=4, context_length=64, max_request_body_mb=1)) as s:
        yield s


@pytest.fixture(scope="module")
def offline(model_dir):
    return Engine(planner=untimed, server_args=server_args(model_dir))


def sync_client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0)


def async_client(live: Live) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0)


# ---------------------------------------------------------------------------------------- OpenAI API
def test_chat_sync_matches_offline_engine(live, offline):
    client = sync_client(live)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
    prompt = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    expected = offline.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0, **IGNORE_EOS})

    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                       extra_body=IGNORE_EOS)
    assert r.object == "chat.completion" and r.model == "tiny"
    # Any model name is served by this model, which the response names (as SGLang does).
    other = client.chat.completions.create(model="meta-llama/Llama-2-7b-chat-hf", messages=messages, max_tokens=12,
                                           temperature=0, extra_body=IGNORE_EOS)
    assert other.model == "tiny" and other.choices[0].message.content == expected["text"]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected["text"]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 12)

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=IGNORE_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_harmless_openai_parameters_pass_through_the_openai_client(live):
    """What stock clients send and this server has no use for is accepted and changes nothing."""
    client = sync_client(live)
    messages = [{"role": "user", "content": "The quick brown fox"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                           extra_body=IGNORE_EOS)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, store=False,
                                       metadata={"team": "a"}, service_tier="auto", user="u1",
                                       prompt_cache_key="k", safety_identifier="s", extra_body=IGNORE_EOS)
    assert r.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="store"):           # nothing is stored to fetch later
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, store=True)


def test_chat_prediction_through_the_openai_client(live, offline):
    """OpenAI's `prediction=` argument, streamed and not, as text or text parts: the answer is the one
    without a prediction, and usage says how many prediction tokens were verified and kept (how many
    depends on chain lengths, which the measured step times choose; tests/test_prediction.py pins the
    counts down)."""
    client = sync_client(live)
    messages = [{"role": "user", "content": "The quick brown fox"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                           extra_body=IGNORE_EOS)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None
    for content in (text, "unrelated words", [{"type": "text", "text": text[:10]}, {"type": "text", "text": text[10:]}]):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                           prediction={"type": "content", "content": content}, extra_body=IGNORE_EOS)
        assert r.choices[0].message.content == text
        details = r.usage.completion_tokens_details
        assert 0 <= details.accepted_prediction_tokens < r.usage.completion_tokens
        assert details.rejected_prediction_tokens >= 0
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                     prediction={"type": "content", "content": content}, stream=True,
                                                     stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens_details.rejected_prediction_tokens is not None


def test_completions_async_stop_seed_and_n(live, offline):
    async def run():
        client = async_client(live)
        prompt = "one two three"
        full = await client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                               extra_body=IGNORE_EOS)
        text = full.choices[0].text
        assert text == offline.generate(prompt, {"max_new_tokens": 20, "temperature": 0, **IGNORE_EOS})["text"]
        assert full.object == "text_completion" and full.usage.completion_tokens == 20

        stop = text[len(text) // 2:len(text) // 2 + 2]
        cut = await client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=[stop],
                                              extra_body=IGNORE_EOS)
        assert cut.choices[0].text == text[:text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"

        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                                 stream=True, extra_body=IGNORE_EOS)
        assert "".join([c.choices[0].text async for c in stream]) == text

        sampled = [await client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=1.0,
                                                   top_p=0.9, n=2, seed=7) for _ in range(2)]
        assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
        assert [c.index for c in sampled[0].choices] == [0, 1]

    asyncio.run(run())


def test_concurrent_streams_match_offline_engine(live, offline):
    prompts = [f"{w} {i}" for i, w in enumerate(["The quick", "def add", "one two", "Caf\u00e9", "seven"] * 7)][:32]
    expected = [o["text"] for o in offline.generate(prompts, {"max_new_tokens": 24, "temperature": 0, **IGNORE_EOS})]

    async def one(client, prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                 stream=True, extra_body=IGNORE_EOS)
        return "".join([c.choices[0].text async for c in stream])

    async def run():
        client = async_client(live)
        return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(run()) == expected


# ---------------------------------------------------------------------------------------- SGLang API and info
def test_generate_native_shapes(live, offline):
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with live.http() as c:
        one = c.post("/generate", json={"text": "The quick", "sampling_params": params}).json()
        ref = offline.generate("The quick", params)
        assert one["text"] == ref["text"] and one["output_ids"] == ref["output_ids"]
        meta = one["meta_info"]
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["spec_verify_ct"]) == (len(offline.tokenizer.encode("The quick")), 8, 0)
        assert meta["finish_reason"] == {"type": "length"}

        batch = c.post("/generate", json={"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": params}).json()
        assert [b["index"] for b in batch] == [0, 1] and all(len(b["output_ids"]) == 8 for b in batch)

        with c.stream("POST", "/generate", json={"text": "The quick", "sampling_params": params, "stream": True}) as r:
            events = list(sse(r))
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["text"] == one["text"] and last["output_ids"] == one["output_ids"]
        assert all(json.loads(a)["text"] == json.loads(b)["text"][:len(json.loads(a)["text"])]   # cumulative
                   for a, b in zip(events[:-2], events[1:-1]))


def test_models_health_and_server_info(live, model_dir):
    with live.http() as c:
        models = c.get("/v1/models")
        assert [m["id"] for m in models.json()["data"]] == ["tiny"]
        assert c.get("/v1/models/tiny").json()["max_model_len"] == 512
        assert c.get("/health").status_code == 200
        assert c.get("/health_generate").status_code == 200
        info = c.get("/get_server_info")
    assert info.json()["served_model_name"] == "tiny" and info.json()["context_length"] == 512
    assert info.json()["max_total_num_tokens"] == 8192 and info.json()["model_path"] == "tiny"
    assert "avg_spec_accept_length" in info.json()
    for r in (models, info):        # where the files are is nobody's business but the server's
        assert str(model_dir) not in r.text and "/tmp" not in r.text


def test_metrics_parse_and_count(live):
    with live.http() as c:
        c.post("/v1/completions", json={"prompt": "one", "max_tokens": 5, "temperature": 0, **IGNORE_EOS})
    m = live.metrics()
    assert m['spec_requests_total{finish_reason="length"}'] >= 1
    assert m["spec_generation_tokens_total"] >= 5 and m["spec_prompt_tokens_total"] >= 1
    assert m["spec_time_to_first_token_seconds_count"] >= 1 and m["spec_inter_token_latency_seconds_count"] >= 4
    assert m["spec_kv_cache_total_tokens"] == 8192 and m["spec_num_queue_reqs"] == 0
    assert m["spec_decode_rows_total"] >= m["spec_decode_steps_total"] >= 4       # a row per request a step


# ---------------------------------------------------------------------------------------- disconnects
def _idle(m) -> bool:
    return m["spec_num_running_reqs"] == 0 and m["spec_kv_cache_used_tokens"] == 0


def test_stream_disconnect_aborts_and_frees_kv(live, monkeypatch):
    aborted = live.metrics().get('spec_requests_total{finish_reason="abort"}', 0)
    body = {"prompt": "one two", "max_tokens": 480, "temperature": 0, "stream": True, **IGNORE_EOS}
    with Hold(live, monkeypatch) as hold:
        with live.http() as c, c.stream("POST", "/v1/completions", json=body) as r:
            next(sse(r))
            assert live.metrics()["spec_kv_cache_used_tokens"] > 0          # the request holds KV now
        wait_for(hold.aborted, "the server to abort the disconnected stream")
    m = live.wait_metrics(lambda m: _idle(m) and m.get('spec_requests_total{finish_reason="abort"}', 0) > aborted)
    assert m['spec_requests_total{finish_reason="abort"}'] == aborted + 1 and _idle(m)


def test_non_stream_disconnect_aborts(live, monkeypatch):
    aborted = live.metrics().get('spec_requests_total{finish_reason="abort"}', 0)
    body = json.dumps({"prompt": "one two", "max_tokens": 500, "n": 8, "temperature": 0, **IGNORE_EOS}).encode()
    with Hold(live, monkeypatch) as hold:
        with socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1]))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body))
            wait_for(hold.started, "the requests to start generating")
        wait_for(hold.aborted, "the server to abort the disconnected requests")
    m = live.wait_metrics(lambda m: _idle(m) and m.get('spec_requests_total{finish_reason="abort"}', 0) > aborted)
    assert m['spec_requests_total{finish_reason="abort"}'] == aborted + 8 and _idle(m)


# ---------------------------------------------------------------------------------------- client mistakes
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
DEEP = deep_schema(100)


def TOOL_TURNS(id="c1", name="f", arguments="{}", tool_call_id="c1"):        # noqa: N802  (a constant's maker)
    """A user turn, an assistant's tool call and the tool's answer, with one field replaced."""
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": tool_call_id, "content": "42"}]

BAD = [
    ("/v1/chat/completions", b'{"messages": [', 400, None),
    ("/v1/chat/completions", b'[1, 2]', 400, None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10 ** 12}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "word " * 600}]}, 400, None),
    ("/v1/chat/completions", {**CHAT, "temperature": -0.5}, 400, None),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, None),
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, 400, None),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 3}, 400, None),
    # 0 in float32: the repeated tokens' logits (and logprobs) would be infinite.
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 5e-324, "logprobs": True}, 400, None),
    ("/v1/chat/completions", {**CHAT, "n": 0}, 400, None),
    ("/v1/chat/completions", {**CHAT, "n": 1000}, 400, "n"),
    ("/v1/chat/completions", {**CHAT, "stop": [""]}, 400, None),
    # Issue 19's cases: logprobs, grammars, logit_bias and tools the server cannot honour.
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "tools.0.function.name"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "regex": "a"}, 400,
     "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "ignore_eos": True}, 400,
     "ignore_eos"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "min_tokens": 2}, 400,
     "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"a": 1}}, 400, "logit_bias.a"),
    # Refused once the vocabulary is known (Engine.make_request), in the route's names.
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"99999": 1}}}, 400, "sampling_params.logit_bias"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a", "reasoning_end": [99999]}}, 400,
     "sampling_params.reasoning_end"),
    ("/generate", {"text": "hi", "sampling_params": {"prediction": [1, 99999]}}, 400, "sampling_params.prediction"),
    ("/generate", {"text": "hi", "prediction": {"type": "content", "content": "x " * 3000}}, 400, "prediction"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2, "echo": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "regex": "("}, 400, "regex"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{"}}, 400, "sampling_params.json_schema"),
    ("/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= "}}, 400, "sampling_params.ebnf"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, 400, "sampling_params.ebnf"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 21}, 400, "top_logprobs_num"),
    ("/v1/chat/completions", {**CHAT, "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages.0.content.0"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": 0}, 400, "continue_final_message"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "best_of": True}, 400, "best_of"),
    ("/generate", {"input_ids": []}, 400, "input_ids"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, None),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("/generate", {"text": "hi", "input_ids": [1, 2]}, 400, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -3}}, 400, None),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 600}}, 400, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"nucleus": 0.5}}, 400, None),
    ("/generate", {"input_ids": [-1]}, 400, None),
    ("/v1/nothing-here", {}, 404, None),
    # Issue 18's cases: strict types, bounded numbers, text that no tokenizer takes.
    ("/v1/chat/completions", {**CHAT, "top_k": 1e30}, 400, "top_k"),
    ("/v1/chat/completions", {**CHAT, "top_k": 2 ** 63}, 400, "top_k"),
    ("/v1/chat/completions", {**CHAT, "top_k": 2 ** 31}, 400, "top_k"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]}, 400,
     "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     400, "messages.0.content.0.text"),
    ("/v1/chat/completions", {**CHAT, "stop": "\ud800"}, 400, "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": ["ok", "x\udc00"]}, 400, "stop.1"),
    ("/v1/chat/completions", {**CHAT, "stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 5.5}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "n": "2"}, 400, "n"),
    ("/v1/chat/completions", {**CHAT, "n": True}, 400, "n"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {**CHAT, "temperature": "0.5"}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": float("nan")}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "seed": 2 ** 64}, 400, "seed"),
    ("/v1/completions", {"prompt": "a\x00b"}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\ud800"]}, 400, "prompt.1"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "max_tokens": 2, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage"),
    ("/generate", {"text": "hi", "sampling_params": {"skip_special_tokens": "yes"}}, 400, "sampling_params.skip_special_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"ignore_eos": 1}}, 400, "sampling_params.ignore_eos"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 2 ** 63}}, 400, "sampling_params.top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 1e30}}, 400, "sampling_params.top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "5"}}, 400, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"n": "2"}}, 400, "sampling_params.n"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": "\ud800"}}, 400, "sampling_params.stop"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [2 ** 63]}}, 400, "sampling_params.stop_token_ids.0"),
    ("/generate", {"text": "\ud800"}, 400, "text"),
    ("/generate", {"text": "hi", "stream": "yes"}, 400, "stream"),
    ("/generate", {"input_ids": [1.5, 2]}, 400, "input_ids.0"),
    ("/v1/chat/completions", {**CHAT, "prediction": "text"}, 400, "prediction"),
    ("/v1/chat/completions", {**CHAT, "prediction": {"type": "text", "content": "x"}}, 400, "prediction.type"),
    ("/v1/chat/completions", {**CHAT, "prediction": {"type": "content", "content": [{"type": "image_url"}]}}, 400,
     "prediction.content.0"),
    ("/v1/chat/completions", {**CHAT, "prediction": {"type": "content", "content": "\ud800"}}, 400,
     "prediction.content"),
    ("/v1/completions", {"prompt": "hi", "prediction": {"type": "content", "content": "x " * 70000}}, 400, "prediction"),
    ("/v1/completions", b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", 400, None),
    ("/v1/completions", b'{"prompt": "\xff"}', 400, None),
    # Issue 40's: every text a chat template reads is checked like message content; fields the server
    # supports at one value only take that value (the schema says so too).
    ("/v1/chat/completions", {**CHAT, "messages": TOOL_TURNS(tool_call_id="\ud800")}, 400, "messages.2.tool_call_id"),
    ("/v1/chat/completions", {**CHAT, "messages": TOOL_TURNS(id="c\udc00")}, 400, "messages.1.tool_calls.0.id"),
    ("/v1/chat/completions", {**CHAT, "messages": TOOL_TURNS(arguments='{"a": "\ud800"}')}, 400,
     "messages.1.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", {**CHAT, "messages": TOOL_TURNS(name="f\ud800")}, 400,
     "messages.1.tool_calls.0.function.name"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "description": "\ud800"}}}}}]}, 400,
     "tools.0.function.parameters"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]}, 400,
     "messages.0.content.0.cache_control"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 2049}, 400, "messages"),
    ("/v1/completions", {"prompt": ["hi"] * 2049}, 400, "prompt"),
    ("/v1/chat/completions", {**CHAT, "n": 17, "max_tokens": 1}, 400, "n"),      # --max-n (16), not the queue (64)
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": DEEP}}, 400, "sampling_params.json_schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": json.loads(DEEP)}}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "hi", "regex": "(" * 100 + ")" * 100}, 400, "regex"),
    ("/v1/chat/completions", ('{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
                              '"json_schema", "json_schema": {"name": "x", "schema": ' + deep_schema(600)
                              + '}}}').encode(), 400, None),     # nested past what a JSON parser recurses into
    ("/v1/chat/completions", ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
                              '"function": {"name": "f", "parameters": ' + deep_schema(300) + '}}]}').encode(),
     400, None),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/v1/chat/completions", {**CHAT, "store": True}, 400, "store"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("/generate", {"text": "hi", "return_entropy": True}, 400, "return_entropy"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}:{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_4xx_with_openai_error(live, path, body, status, param):
    # json.dumps escapes lone surrogates ("\\ud800") as JSON allows; httpx's own encoder would refuse them.
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with live.http() as c:
        r = c.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if param is not None:
            assert err["param"] == param
        assert c.get("/health").status_code == 200


def test_api_key_required(live):
    with httpx.Client(base_url=live.url) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        assert c.get("/health").status_code == 200            # liveness probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_requests_never_read_files(live, monkeypatch, tmp_path):
    """No request field makes the server open a file, whatever path a client puts where."""
    secret, opened = str(tmp_path / "secret.txt"), []
    real_open, real_os_open = open, os.open
    monkeypatch.setattr("builtins.open", lambda f, *a, **kw: (opened.append(str(f)), real_open(f, *a, **kw))[1])
    monkeypatch.setattr(os, "open", lambda f, *a, **kw: (opened.append(str(f)), real_os_open(f, *a, **kw))[1])
    message = {"role": "user", "content": secret, "name": "x"}
    with live.http() as c:
        c.get(f"/v1/models/{secret}")
        for body in ({"model": secret, "prompt": secret, "max_tokens": 2},
                     {"prompt": secret, "stop": [secret[:256]], "user": secret, "max_tokens": 2}):
            c.post("/v1/completions", json=body)
        c.post("/v1/chat/completions", json={"messages": [message], "max_tokens": 2, "model": secret})
        assert c.post("/generate", json={"text": secret, "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    assert not [f for f in opened if "secret" in f]


def test_full_queue_answers_503_with_retry_after(model_dir, monkeypatch):
    long = {"prompt": "one", "max_tokens": 480, "temperature": 0, "stream": True, **IGNORE_EOS}
    with serve(server_args(model_dir, max_running_requests=1, max_queued_requests=2)) as small, \
            Hold(small, monkeypatch), small.http() as c, contextlib.ExitStack() as streams:
        first = sse(streams.enter_context(c.stream("POST", "/v1/completions", json=long)))
        next(first)                                     # it runs (and is held there): no longer queued
        for _ in range(2):        # one runs at a time: these two wait behind it and fill the queue
            streams.enter_context(c.stream("POST", "/v1/completions", json=long))
        assert small.metrics()["spec_num_queue_reqs"] == 2
        r = c.post("/v1/completions", json={"prompt": "one", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"


def test_engine_failure_fails_requests_not_the_server(small, monkeypatch):
    step, failures = small.engine.step, iter([RuntimeError("injected bug")])

    def broken_once():
        exc = next(failures, None)
        if exc is not None:
            raise exc
        return step()

    monkeypatch.setattr(small.engine, "step", broken_once)
    with small.http() as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 500 and "internal error" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200
        assert c.get("/health").status_code == 200
        # /generate too answers a failure with its status, not 200 with finish_reason abort.
        failures = iter([RuntimeError("injected bug")] * 2)
        r = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        with c.stream("POST", "/generate", json={"text": "hi", "stream": True}) as r:
            events = list(sse(r))
        assert r.status_code == 200 and json.loads(events[-2])["error"]["code"] == "internal_error"
        assert events[-1] == "[DONE]"
    assert _idle(small.metrics())


def test_nul_is_refused_in_prompts_only(live):
    """A NUL in a prompt is a client bug; in a stop string it is what a model may generate."""
    with live.http() as c:
        assert c.post("/v1/completions", json={"prompt": "a\x00b", "max_tokens": 2}).status_code == 400
        assert c.post("/v1/completions", json={"prompt": "ab", "stop": ["\x00"], "max_tokens": 2}).status_code == 200
        r = c.post("/generate", json={"text": "ab", "sampling_params": {"stop": "x\x00", "max_new_tokens": 2}})
        assert r.status_code == 200


def test_bad_inputs_leave_a_running_stream_untouched(live, offline):
    """Issue 18: one bad request cost everyone's; the bad inputs now stop at the edge."""
    body = {"prompt": "one two", "max_tokens": 64, "temperature": 0, "stream": True, **IGNORE_EOS}
    expected = offline.generate("one two", {"max_new_tokens": 64, "temperature": 0, **IGNORE_EOS})["text"]
    with live.http() as c, c.stream("POST", "/v1/completions", json=body) as r:
        events = sse(r)
        text = json.loads(next(events))["choices"][0]["text"]
        for path, bad, status, _ in BAD:
            content = bad if isinstance(bad, bytes) else json.dumps(bad).encode()
            assert c.post(path, content=content, headers={"content-type": "application/json"}).status_code == status
        text += "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]")
    assert text == expected


def test_health_reports_a_stuck_or_dead_engine(model_dir, monkeypatch):
    with serve(server_args(model_dir)) as s, s.http() as c:
        step, gate = s.engine.step, threading.Event()
        monkeypatch.setattr(s.engine, "step", lambda: (gate.wait(120), step())[1])
        monkeypatch.setattr(s.serving.loop, "stall_s", 0.2)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(c.post, "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            wait_until(lambda: c.get("/health").status_code == 503, "/health to report the stuck engine")
            gate.set()
            assert pending.result().status_code == 200
        wait_until(lambda: c.get("/health").status_code == 200, "/health to recover")

        class Fatal(BaseException):
            pass

        def dies():
            raise Fatal("the engine thread dies")

        monkeypatch.setattr(s.engine, "step", dies)
        monkeypatch.setattr(threading, "excepthook", lambda args: None)     # expected: keep the output clean
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"     # answered, not hung
        wait_until(lambda: c.get("/health").status_code == 503, "/health to report the dead engine thread")
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503 and "engine has stopped" in r.json()["error"]["message"]


def test_tokenizing_leaves_the_event_loop_free(small, monkeypatch):
    tokenizer = small.serving.tokenizer.hf
    encode, entered, gate = tokenizer.encode, threading.Event(), threading.Event()

    def slow_encode(*a, **kw):
        entered.set()
        gate.wait(120)
        return encode(*a, **kw)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    with small.http() as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(c.post, "/v1/completions", json={"prompt": "one two", "max_tokens": 2})
        wait_for(entered, "the tokenizer to start")
        # While the tokenizer works, the server answers: health checks and requests that need no tokenizing.
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}).status_code == 200
        gate.set()
        assert pending.result().status_code == 200


def test_prompt_surely_past_the_context_is_refused_untokenized(small, monkeypatch):
    def never(*a, **kw):
        raise AssertionError("tokenized a prompt whose length alone rules it out")

    monkeypatch.setattr(small.serving.tokenizer.hf, "encode", never)
    bound = 64 * small.serving.tokenizer.max_token_bytes           # context 64 x the longest token
    with small.http() as c:
        r = c.post("/v1/completions", json={"prompt": "x" * (bound + 1)})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_length_bound_holds_for_the_longest_tokens(small):
    """No text tokenizes to fewer than len(text) / max_token_bytes tokens: the cheap check never refuses
    a prompt that fits. Worst cases repeat the longest tokens, alone and glued together."""
    tok = small.serving.tokenizer
    longest = sorted(tok.hf.get_vocab(), key=lambda t: -len(t.encode()))[:20]
    texts = [tok.hf.convert_tokens_to_string([t]) for t in longest]
    for text in texts + ["".join(texts), " ".join(texts), "\u65e5\u672c" * 50, " " * 300]:
        assert len(tok.hf.encode(text)) * tok.max_token_bytes >= len(text), text


def test_request_body_limit(small):
    too_big = json.dumps({"prompt": "x" * (2 ** 20)}).encode()
    with small.http() as c:
        r = c.post("/v1/completions", content=too_big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "--max-request-body-mb" in r.json()["error"]["message"]
        # Without Content-Length (chunked), the limit holds as the chunks arrive.
        r = c.post("/v1/completions", content=iter([too_big[i:i + 65536] for i in range(0, len(too_big), 65536)]),
                   headers={"content-type": "application/json"})
        assert r.status_code == 413
        r = c.post("/v1/completions", json={"prompt": "x" * (2 ** 19)})       # under the limit: read, judged
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_half_sent_requests_are_dropped(small, monkeypatch):
    monkeypatch.setattr(ReadDeadlineProtocol, "read_timeout_s", 0.5)
    port = int(small.url.rsplit(":", 1)[1])
    for partial in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty",       # half a head
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro"):  # half a body
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(partial)
            assert sock.recv(65536) == b"", "the server should close the connection"     # not a 60 s timeout
    with small.http() as c:
        assert c.get("/health").status_code == 200


def test_api_key_guards_every_route_but_health(live, monkeypatch):
    compared = []
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append((a, b)) or a == b)
    app = live.server.config.app
    routes = [(m.upper(), path.replace("{model}", "tiny")) for path, ops in app.openapi()["paths"].items() for m in ops]
    routes += [(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) if m != "HEAD"]   # docs, schema
    assert {"/generate", "/metrics", "/get_server_info", "/docs", "/openapi.json"} <= {p for _, p in routes}
    with httpx.Client(base_url=live.url) as c:
        for method, path in routes:
            r = c.request(method, path, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == (200 if path == "/health" else 401), (method, path)
    assert (b"wrong", KEY.encode()) in compared       # keys are compared in constant time


def test_a_grammar_stops_compiling_when_its_client_leaves(live, monkeypatch):
    """A schema that would compile for minutes (allowed here by raising the depth limit): once its
    client closes the connection, the compiler process is stopped (observed in the worker's count,
    not by timing), and the next grammar compiles in a fresh one."""
    import engine.core.grammar as grammar

    monkeypatch.setattr(grammar, "MAX_DEPTH", 10_000)
    backend = live.engine.grammars
    monkeypatch.setattr(backend, "compile_timeout", 3600.0)        # only the client's leaving stops it
    with live.http() as c:                                          # starts the compiler process
        assert c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1, "regex": "a"}}).is_success
    before = backend.worker.cut_short
    body = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2, "json_schema": deep_schema(1000)}})
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in live.headers.items())
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        wait_until(lambda: backend.worker._lock.locked(), "the compile to start")
    wait_until(lambda: backend.worker.cut_short == before + 1, "the compile to be stopped")
    with live.http() as c:
        r = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1, "regex": "b"}})
    assert r.status_code == 200, r.text


def test_openapi_lists_the_statuses_sent(small):
    with small.http() as c:
        paths = c.get("/openapi.json").json()["paths"]
    statuses = {(path, method): set(op["responses"]) for path, ops in paths.items() for method, op in ops.items()}
    assert not any("422" in codes for codes in statuses.values())      # invalid requests get 400 here
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate"):
        assert {"200", "400", "413", "500", "503"} <= statuses[(route, "post")]


def test_openapi_offers_only_the_values_served(small):
    """Fields the server supports at their neutral value alone say so in the schema."""
    with small.http() as c:
        schemas = c.get("/openapi.json").json()["components"]["schemas"]

    def values(prop):
        allowed = set()
        for option in prop.get("anyOf", [prop]):
            if option.get("type") == "null":
                allowed.add(None)
            elif "const" in option or "enum" in option:
                allowed.update(option.get("enum", [option.get("const")]))
            else:
                return "any"
        return allowed

    assert values(schemas["CompletionRequest"]["properties"]["best_of"]) == {1, None}
    assert values(schemas["CompletionRequest"]["properties"]["suffix"]) == {"", None}
    assert values(schemas["ChatCompletionRequest"]["properties"]["continue_final_message"]) == {False}
    assert values(schemas["ChatCompletionRequest"]["properties"]["store"]) == {False, None}
    assert values(schemas["GenerateRequest"]["properties"]["return_entropy"]) == {False}
    # The limits set at start-up: --max-n (within the queue), the context length, the vocabulary.
    chat, completion = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    assert chat["n"]["maximum"] == min(small.serving.args.max_n, small.serving.args.max_queued_requests)
    assert {o.get("maximum") for o in completion["max_tokens"]["anyOf"]} == {small.serving.context_len, None}
    ids = next(o for o in completion["prompt"]["anyOf"] if o.get("items", {}).get("type") == "integer")
    assert ids["items"]["maximum"] == small.serving.engine.model_config.vocab_size - 1
    (end,) = [o for o in schemas["SGLangSampling"]["properties"]["reasoning_end"]["anyOf"] if o.get("type") == "array"]
    assert (end["items"]["maximum"], end["maxItems"]) == (small.serving.engine.model_config.vocab_size - 1,
                                                          MAX_REASONING_END)
    batches = [o for o in completion["prompt"]["anyOf"] if o.get("items", {}).get("type") != "integer"
               and o.get("type") == "array"]
    assert [o["maxItems"] for o in batches] == [small.serving.args.max_queued_requests] * 2
    responses = schemas["ResponsesRequest"]["properties"]
    assert {o.get("maximum") for o in responses["max_output_tokens"]["anyOf"]} == {small.serving.context_len, None}
    # This model's chat template has no tool format: neither chat nor responses offer tools.
    for props in (chat, responses):
        assert values(props["tool_choice"]) == {None, "none"}
        assert [o.get("maxItems") for o in props["tools"]["anyOf"] if o.get("type") == "array"] == [0]


def test_max_tokens_past_what_the_prompt_leaves_ends_with_length(small):
    """Within the context length, max_tokens is an upper bound: the answer stops where the context ends."""
    context = small.serving.context_len
    prompt = list(range(3, context - 2))
    with small.http() as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": context, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == context - len(prompt)
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": context + 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = c.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 1, "max_tokens": context + 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("route, schema, body", [
    ("/v1/chat/completions", "ChatCompletionRequest", {**CHAT, "continue_final_message": 0}),
    ("/v1/chat/completions", "ChatCompletionRequest", {**CHAT, "top_logprobs": 5}),
    ("/v1/chat/completions", "ChatCompletionRequest", {**CHAT, "response_format": {"type": "json_schema"}}),
    ("/v1/chat/completions", "ChatCompletionRequest", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
    ("/v1/completions", "CompletionRequest", {"prompt": ""}),
    ("/v1/completions", "CompletionRequest", {"prompt": [[]]}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "best_of": True}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "echo": True, "logprobs": 0}),
    ("/generate", "GenerateRequest", {"input_ids": []}),
    ("/generate", "GenerateRequest", {"text": "hi", "input_ids": [1]}),
    ("/generate", "GenerateRequest", {"sampling_params": {}}),
    ("/generate", "GenerateRequest", {"text": "hi", "sampling_params": {"nucleus": 0.5}}),
    ("/generate", "GenerateRequest", {"text": "hi", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}),
    ("/generate", "GenerateRequest", {"text": "hi", "sampling_params": [{}, {}]}),
    ("/generate", "GenerateRequest", {"input_ids": [1, -1]}),
    ("/v1/completions", "CompletionRequest", {"prompt": [1, 2.5]}),
    ("/v1/completions", "CompletionRequest", {"prompt": [1], "logit_bias": {"": None}}),
    ("/v1/completions", "CompletionRequest", {"prompt": [1], "logit_bias": {"99999999": 1.0}}),
    ("/generate", "GenerateRequest", {"text": "hi", "sampling_params": {"regex": "a", "reasoning_end": [99999]}}),
    ("/v1/responses", "ResponsesRequest", {"input": "hi", "max_output_tokens": 65}),        # past the context
    ("/v1/responses", "ResponsesRequest", {"input": "hi", "tools": [{"type": "function", "name": "f"}]}),
])
def test_the_schema_refuses_what_the_server_refuses(small, route, schema, body):
    """openapi.json and the validators agree: a body the server answers 400 is one the schema rejects."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")        # schemathesis's
    with small.http() as c:
        spec = c.get("/openapi.json").json()
        assert c.post(route, json=body).status_code == 400
    validator = jsonschema_rs.Draft202012Validator({"$ref": f"#/components/schemas/{schema}", **spec})
    assert not validator.is_valid(body)


@pytest.mark.parametrize("route, schema, body", [
    ("/v1/completions", "CompletionRequest", {"prompt": [1, 2.0], "max_tokens": 2.0, "n": 1.0, "best_of": 1.0}),
    ("/v1/chat/completions", "ChatCompletionRequest", {**CHAT, "logprobs": True, "top_logprobs": 2.0}),
    ("/generate", "GenerateRequest", {"input_ids": [1, 2.0], "sampling_params": {"max_new_tokens": 2.0,
                                                                                  "temperature": None}}),
    ("/generate", "GenerateRequest", {"text": "hi", "sampling_params": [{"max_new_tokens": 2}]}),
    ("/v1/chat/completions", "ChatCompletionRequest", {**CHAT, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}]}]}),
    ("/v1/responses", "ResponsesRequest", {"input": "hi", "max_output_tokens": 2.0, "tools": [],
                                           "tool_choice": "none"}),
])
def test_the_server_serves_what_the_schema_allows(small, route, schema, body):
    """Bodies schemathesis found refused though the schema allows them: integers written 2.0 (JSON
    Schema's integers), null sampling_params (the default), a tool call's arguments that are not JSON."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    with small.http() as c:
        spec = c.get("/openapi.json").json()
        r = c.post(route, json=body | ({"max_tokens": 2} if "messages" in body else {}))
        assert r.status_code == 200, r.text
    assert jsonschema_rs.Draft202012Validator({"$ref": f"#/components/schemas/{schema}", **spec}).is_valid(body)


def test_schemathesis_finds_no_5xx(small):
    """Fuzzes every route of the schema, valid and invalid requests: no 5xx, and every status, content
    type and error body as openapi.json declares them."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings, strategies as st
    from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                     status_code_conformance)

    schema = schemathesis.openapi.from_url(f"{small.url}/openapi.json")
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    session = pytest.importorskip("requests").Session()
    deadline = time.monotonic() + 20

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(*(schema.as_strategy(generation_mode=m) for m in modes)))
    def check(case):
        if time.monotonic() > deadline:
            return
        case.call_and_validate(session=session, timeout=30, checks=checks)

    check()
    with small.http() as c:
        assert c.get("/health_generate").status_code == 200


# ---------------------------------------------------------------------------------------- speculative metrics
def test_ngram_metrics_report_accept_length(model_dir):
    pytest.importorskip("engine.speculative.ngram")
    args = server_args(model_dir, speculative_algorithm="NGRAM", speculative_num_steps=4, speculative_eagle_topk=1,
                 speculative_num_draft_tokens=5)
    with serve(args) as s, s.http() as c:
        prompt = "one two three four five six seven eight nine ten " * 4
        outs = [c.post("/generate", json={"text": prompt, "sampling_params": {
            "max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}).json() for _ in range(2)]
        info = c.get("/get_server_info").json()
        m = s.metrics()
    verify = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    assert verify > 0 and m["spec_verify_steps_total"] == info["spec_verify_ct"] >= verify
    assert m["spec_decode_rows_total"] > m["spec_verify_steps_total"]          # draft tokens were verified
    assert m["spec_accept_length_count"] > 0 and m["spec_accept_length_sum"] >= m["spec_accept_length_count"]
    assert m["spec_accept_length_avg"] == pytest.approx(info["avg_spec_accept_length"]) and m["spec_accept_length_avg"] >= 1.0
    assert [m[f'spec_accept_rate_by_position{{position="{d}"}}'] for d in range(1, 5)] == \
        pytest.approx(info["spec_accept_by_position"])


def test_ready_line_names_the_tree_chosen_for_the_model(model_dir, capsys):
    with serve(server_args(model_dir, speculative_algorithm="NGRAM")) as s:
        tree = s.engine.args.speculative_tree
    ready = [line for line in capsys.readouterr().out.splitlines() if "ready at" in line][0]
    assert "None" not in ready and f"steps {tree[0]}, topk {tree[1]}, draft tokens {tree[2]}" in ready


# ---------------------------------------------------------------------------------------- process lifecycle
@contextlib.contextmanager
def spawned(model_dir):
    """`run_server` in a child process; yields (process, its URL) once it prints its ready line."""
    port = free_port()
    code = ("from engine import ServerArgs; from engine.server import run_server; "
            f"run_server(ServerArgs(model_path={str(model_dir)!r}, dtype='float32', max_total_tokens=4096, "
            f"port={port}, num_threads=1, log_level='warning'))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith(f"spec serve: ready at http://127.0.0.1:{port}") and "speculative: off" in ready, \
            ready + proc.stderr.read()
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def _accepts(url: str) -> bool:
    try:
        socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10).close()
        return True
    except ConnectionRefusedError:
        return False


def test_sigterm_finishes_in_flight_and_exits_zero(model_dir):
    with spawned(model_dir) as (proc, url):
        body = {"prompt": "one two", "max_tokens": 200, "temperature": 0, "stream": True, **IGNORE_EOS}
        with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            events = sse(r)
            next(events)
            proc.send_signal(signal.SIGTERM)
            rest = list(events)
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"     # finished, not cut off
        assert proc.wait(60) == 0


def test_double_ctrl_c_answers_streams_and_exits_cleanly(model_dir):
    with spawned(model_dir) as (proc, url):
        body = {"prompt": "one two", "max_tokens": 500, "n": 16, "temperature": 0, "stream": True, **IGNORE_EOS}
        with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            events = sse(r)
            next(events)
            proc.send_signal(signal.SIGINT)     # the stream goes on; new connections are refused
            wait_until(lambda: not _accepts(url), "the server to stop accepting connections")
            proc.send_signal(signal.SIGINT)     # the second ends it now, with an error event
            rest = list(events)
        assert rest[-1] == "[DONE]" and "shutting down" in json.loads(rest[-2])["error"]["message"]
        assert proc.wait(60) == 0          # not SIGABRT from torch's threads outliving the interpreter
        assert "Traceback" not in proc.stderr.read()


def test_shutdown_answers_streams_past_the_grace_period(model_dir, monkeypatch):
    with serve(server_args(model_dir)) as s, Hold(s, monkeypatch) as hold, s.http() as c:
        stopping, request_stop = threading.Event(), s.serving.loop.request_stop
        monkeypatch.setattr(s.serving.loop, "request_stop", lambda: (request_stop(), stopping.set()))
        s.server.grace_s = 0.0
        body = {"prompt": "one two", "max_tokens": 480, "temperature": 0, "stream": True, **IGNORE_EOS}
        with c.stream("POST", "/v1/completions", json=body) as r:
            events = sse(r)
            next(events)                    # it runs, held mid-generation
            s.server.should_exit = True
            wait_for(stopping, "the grace period to end")
            hold.released.set()
            rest = list(events)
    assert rest[-1] == "[DONE]"
    err = json.loads(rest[-2])["error"]
    assert err["code"] == "aborted" and "shutting down" in err["message"]


def test_the_engine_loads_on_a_thread_that_ends(model_dir, monkeypatch):
    """spec serve builds its engine on a thread that ends before serving starts: a thread that ran
    OpenMP work and lives on keeps OpenMP workers that slow every step of the engine thread (launch.py)."""
    from engine.errors import ConfigError
    from engine.server import launch

    seen = []
    assert launch.on_own_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.main_thread() and not seen[0].is_alive()

    def refuse():
        raise ConfigError("no such model")
    with pytest.raises(ConfigError, match="no such model"):
        launch.on_own_thread(refuse)

    class Built(Exception):
        pass

    def built(build):
        raise Built(build().args.model_path)
    monkeypatch.setattr(launch, "on_own_thread", built)
    with pytest.raises(Built, match=str(model_dir)):
        launch.run_server(ServerArgs(model_path=str(model_dir)))
