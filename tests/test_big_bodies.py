"""Large request bodies are parsed and validated in child processes (engine/server/bodies.py): the
event loop answers /health and other requests while they are, and a large body gets the answer its
small twin (the same JSON, without the padding) gets. Timings: benchmarks/bench_big_bodies.py."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine.server import bodies, protocol, responses_protocol
from tests.gates import held
from tests.serving import serve, server_args
from tests.tiny import make_model

CONTEXT = 64
LIMIT_MB = 1
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model = make_model(tmp_path_factory.mktemp("bodies_model"), "llama")
    with serve(server_args(model, context_length=CONTEXT, max_queued_requests=8, max_request_body_mb=LIMIT_MB)) as s:
        yield s


def maximal_body() -> tuple[bytes, int]:
    """One prompt of token ids as /generate's input_ids, as large as the body limit lets through; and
    its length in tokens."""
    head, tail = b'{"input_ids": [', b'], "sampling_params": {"max_new_tokens": 1}}'
    ids = (LIMIT_MB * 2 ** 20 - len(head) - len(tail) + 2) // 5         # "123, " per id
    body = head + b", ".join([b"123"] * ids) + tail
    assert LIMIT_MB * 2 ** 20 - 5 < len(body) <= LIMIT_MB * 2 ** 20
    return body, ids


def test_health_and_other_requests_are_served_while_big_bodies_are_parsed(live, monkeypatch):
    """Three maximal bodies at once, held in the parser's children at a gate: meanwhile /health answers
    and an innocent request gets its token; then each big body gets its answer (a prompt past the
    context, refused before its ids came back)."""
    parser = live.server.config.app.state.bodies
    with multiprocessing.get_context("spawn").Manager() as manager:
        gate, arrived = manager.Event(), manager.Queue()
        monkeypatch.setattr(parser, "work", functools.partial(held, gate, arrived, parser.work))
        body, tokens = maximal_body()
        with live.http() as c, concurrent.futures.ThreadPoolExecutor(3) as pool:
            big = [pool.submit(c.post, "/generate", content=body, headers=JSON) for _ in range(3)]
            children = {arrived.get(timeout=120) for _ in range(min(3, bodies.WORKERS))}
            assert os.getpid() not in children            # the parsing is another process's
            assert c.get("/health").status_code == 200
            r = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 1
            assert not any(f.done() for f in big)         # the big bodies are still at the gate
            gate.set()
            for f in big:
                r = f.result()
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
                assert f"has {tokens} tokens" in r.json()["error"]["message"]


IDS = [[5, 6, 7], [8, 9, 10, 11]]
GREEDY = {"max_new_tokens": 4, "temperature": 0}
CASES = {
    "a batch of token-id prompts": ("/v1/completions", json.dumps({"prompt": IDS, "max_tokens": 4, "temperature": 0})),
    "one token-id prompt": ("/generate", json.dumps({"input_ids": IDS[0], "sampling_params": GREEDY})),
    "token-id prompts in a batch": ("/generate", json.dumps({"input_ids": IDS, "sampling_params": GREEDY})),
    "text prompts": ("/generate", json.dumps({"text": ["one two", "three"], "sampling_params": GREEDY})),
    "a chat": ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                   "temperature": 0})),
    "a prompt past the context": ("/v1/completions", json.dumps({"prompt": list(range(CONTEXT)), "max_tokens": 1})),
    "a prompt in a batch past the context": ("/generate", json.dumps({"input_ids": [[5], list(range(CONTEXT + 3))]})),
    "an unknown field": ("/v1/completions", json.dumps({"prompt": "hi", "colour": "red"})),
    "a wrong type": ("/generate", json.dumps({"input_ids": [5, "6"]})),
    "a missing field": ("/v1/chat/completions", json.dumps({"max_tokens": 1})),
    "malformed JSON": ("/v1/completions", '{"prompt": "hi", "max_tokens": 1'),
    "not an object": ("/v1/completions", "[1, 2]"),
    "nested past the parser": ("/generate", "[" * 5000 + "]" * 5000),
    "an integer past Python's digit limit": ("/generate", '{"input_ids": [' + "7" * 5000 + "]}"),
}


def answer(r: httpx.Response) -> tuple:
    """What a client reads: the status, and the body without what differs between two calls."""
    body = r.json()
    for out in body if isinstance(body, list) else [body]:
        out.pop("id", None), out.pop("created", None), out.get("meta_info", {}).clear()
    return r.status_code, body


@pytest.mark.parametrize("case", CASES)
def test_a_large_body_is_answered_as_its_small_twin(live, monkeypatch, case):
    """The same JSON after 64 KiB of leading whitespace goes to the parser's children, and gets the
    small body's answer: outputs, or the same error."""
    parser, sent = live.server.config.app.state.bodies, []
    parse = parser.parse
    monkeypatch.setattr(parser, "parse", lambda *a: sent.append(a) or parse(*a))
    route, text = CASES[case]
    with live.http() as c:
        small = c.post(route, content=text, headers=JSON)
        assert not sent and small.status_code in (200, 400)
        large = c.post(route, content=" " * bodies.SMALL_BYTES + text, headers=JSON)
        assert len(sent) == 1
    assert answer(large) == answer(small)


def test_a_body_not_in_utf8_is_refused_alike(live):
    with live.http() as c:
        small, large = (c.post("/generate", content=pad + b'{"text": "\xff"}', headers=JSON)
                        for pad in (b"", b" " * bodies.SMALL_BYTES))
    for r in (small, large):
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("The request body could not be read as JSON: 'utf-8' codec")



def test_a_body_child_loads_neither_torch_nor_transformers():
    """A child imports bodies.py and the request models of the routes (those of the chat, completion and
    /generate routes, and the Responses API's), and nothing heavier: with torch or transformers each
    child would take seconds and hundreds of MB to start."""
    modules = ", ".join(m.__name__ for m in (bodies, protocol, responses_protocol))
    code = (f"import sys, {modules}\n"
            "print([m for m in ('torch', 'transformers', 'engine.engine') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
