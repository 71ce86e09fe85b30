"""The overlap scheduler (--enable-overlap-schedule, SGLang's spec v2) changes when work runs, never
what comes out: overlap on and off stream the same outputs, update by update, for plain decoding and
every speculative algorithm with chain drafts, greedy and seeded sampling, with stop tokens, stop
strings, max_new_tokens, logprobs, retraction and an abort while the request's step is in flight; every
KV slot comes back. Decode steps built ahead (before the previous step is applied) give the worker the
very batches it sees without overlap. SGLANG_ENABLE_SPEC_V2 (or SPEC_ENABLE_SPEC_V2) and the flag turn
it on, and trees (topk > 1) are refused as SGLang refuses them."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest
import torch

from engine import Engine
from engine.config import ServerArgs
from engine.errors import ConfigError
from engine.sampling_params import SamplingParams
from engine.step import DecodeStep
from tests.test_cli import assert_user_error, run
from tests.test_server import Hold, _args, _idle, serve, sse, wait_for
from tests.test_speculative_lossless import ALGOS, draft_setup
from tests.tiny import make_model

CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("target"), "llama", seed=3)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    out = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 19, 11, 33)]
    return out + [[10, 11, 12, 13, 14, 15] * 4]     # repetitive: drafts get accepted


def engines(algo, target, tmp_path, **kw) -> tuple[Engine, Engine]:
    """Engines without and with the overlap scheduler, each recording its forwards' threads."""
    spec = {} if algo is None else {"speculative_algorithm": algo, **CHAIN, **draft_setup(algo, target, tmp_path)}
    out = []
    for overlap in (False, True):
        eng = Engine(**{"model_path": str(target), "dtype": "float32", "max_total_tokens": 4096,
                        "enable_overlap_schedule": overlap, **spec, **kw})
        eng.forward_threads = record_forward_threads(eng)
        out.append(eng)
    return out[0], out[1]


def record_forward_threads(eng: Engine) -> set:
    """The names of the threads the engine's forwards run on, from now on."""
    names, worker = set(), eng._scheduler.worker
    forward = worker.forward

    def recording(step):
        names.add(threading.current_thread().name)
        return forward(step)

    worker.forward = recording
    return names


def sampling_params(reference: list[dict]) -> list[dict]:
    """Different lengths, greedy and seeded sampling, a stop token and a stop string taken from a first
    run's outputs (so that they fire)."""
    tok = reference[1]["output_ids"][6]
    text = reference[2]["text"]
    stop = next(text[i:i + 3] for i in range(6, len(text)) if "\ufffd" not in text[i:i + 3])
    return [{"temperature": 0, "max_new_tokens": 9, "ignore_eos": True},
            {"temperature": 0, "max_new_tokens": 30, "stop_token_ids": [tok], "ignore_eos": True},
            {"temperature": 0, "max_new_tokens": 30, "stop": [stop], "ignore_eos": True},
            {"temperature": 0.9, "seed": 3, "max_new_tokens": 21, "ignore_eos": True},
            {"temperature": 0.7, "top_p": 0.9, "seed": 11, "max_new_tokens": 26, "ignore_eos": True}]


def streamed(eng: Engine, params: list[dict], **options) -> list[tuple]:
    """Every streamed update: (index, output ids, text, finish reason, logprobs)."""
    return [(o["index"], o["output_ids"], o["text"], o["meta_info"]["finish_reason"],
             o["meta_info"].get("output_token_logprobs"))
            for o in eng.generate(input_ids=prompts(), sampling_params=params, stream=True, **options)]


def assert_all_kv_back(eng: Engine) -> None:
    stats = eng.stats()
    assert not eng.has_work and stats["kv_tokens_used"] == 0
    assert eng._kv.available() == eng.kv_capacity


@pytest.mark.parametrize("algo", [None] + ALGOS)
def test_overlap_on_and_off_stream_the_same(algo, target, tmp_path):
    off, on = engines(algo, target, tmp_path)
    greedy = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    reference = off.generate(input_ids=prompts(), sampling_params=greedy)
    assert [o["output_ids"] for o in on.generate(input_ids=prompts(), sampling_params=greedy)] == \
        [o["output_ids"] for o in reference]
    params = sampling_params(reference)
    want = streamed(off, params, return_logprob=True, top_logprobs_num=2)
    got = streamed(on, params, return_logprob=True, top_logprobs_num=2)
    assert got == want
    finals = {i: reason for i, _, _, reason, _ in want if reason}
    assert finals[1]["matched"] == params[1]["stop_token_ids"][0] and finals[2]["matched"] == params[2]["stop"][0]
    assert on.forward_threads == {"spec-forward_0"} and off.forward_threads == {threading.current_thread().name}
    if algo is not None:
        assert on.stats()["spec_verify_ct"] == off.stats()["spec_verify_ct"] > 0
    assert_all_kv_back(on)
    on.shutdown()


@pytest.mark.parametrize("algo", [None, "EAGLE"])
def test_overlap_retracts_as_without_it(algo, target, tmp_path):
    """A KV pool too small for every request at once: requests are retracted and resumed the same way."""
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    outs = []
    off, on = engines(algo, target, tmp_path, max_total_tokens=90)
    built = count_built_ahead(on)
    for eng in (off, on):
        outs.append([o["output_ids"] for o in eng.generate(input_ids=prompts(), sampling_params=params)])
        assert eng.stats()["retractions"] > 0
        assert_all_kv_back(eng)
    assert outs[0] == outs[1] and built           # steps built ahead between the retractions


def run_aborting(eng: Engine, at_tokens: int) -> tuple[list, int]:
    """Run the prompts; abort request 1 once it has `at_tokens` tokens, and then request 3 right after
    the step that prefills it. Returns every request's output ids, and how many of the aborts found the
    request's next step already running (overlap)."""
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 20, "ignore_eos": True})
    reqs = [eng.make_request(p, params) for p in prompts()]
    for r in reqs[:3] + reqs[4:]:
        eng.add_request(r)
    in_flight = 0

    def abort(req):
        nonlocal in_flight
        step = eng._scheduler._in_flight
        running = step is not None and req in step.step.reqs
        eng.abort(req.rid)
        assert req.finished and (req.row is not None) == running    # KV held while its forward runs
        in_flight += running

    while not all(r.finished for r in reqs[:3] + reqs[4:]):
        eng.step()
        if reqs[1].num_output >= at_tokens and not reqs[1].finished:
            abort(reqs[1])
            if reqs[3].status.value == "waiting":
                eng.add_request(reqs[3])
                eng.step()                          # its prefill: applied (off) or running (on)
                abort(reqs[3])
    assert reqs[1].finish_reason.type == reqs[3].finish_reason.type == "abort"
    return [r.output_ids for r in reqs], in_flight


@pytest.mark.parametrize("algo", [None, "NGRAM", "EAGLE3"])
def test_an_abort_while_its_step_runs_gets_nothing_from_it(algo, target, tmp_path):
    off, on = engines(algo, target, tmp_path)
    want, _ = run_aborting(off, at_tokens=5)
    got, in_flight = run_aborting(on, at_tokens=5)
    assert in_flight == 2                           # both aborts hit a step that was running
    assert got[:3] + got[4:] == want[:3] + want[4:] and len(got[1]) >= 5
    assert len(want[3]) == 1 and got[3] == []       # its prefill ran, but was not applied
    assert_all_kv_back(on)
    # The engine goes on serving, from the cache the aborted requests left.
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    assert on.generate(input_ids=prompts()[1], sampling_params=params)["output_ids"] == \
        off.generate(input_ids=prompts()[1], sampling_params=params)["output_ids"]


def test_a_failed_step_whose_culprit_was_aborted_meanwhile(target, tmp_path, monkeypatch):
    """A step of two requests fails because of one that the client aborts while the step runs: the
    other is run again alone and finishes as in a clean run."""
    off, on = engines(None, target, tmp_path)
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    clean = off.generate(input_ids=prompts()[0], sampling_params=params)["output_ids"]
    good, bad = (on.make_request(p, SamplingParams.from_dict(params)) for p in prompts()[:2])
    decode, failed = on._scheduler.worker._decode, []

    def failing(step):
        held = [r for r in step.reqs if r.rid == bad.rid]         # a copy in a step built ahead
        if held and held[0].num_output >= 3:
            failed.append(step)
            raise RuntimeError("injected failure")
        return decode(step)

    monkeypatch.setattr(on._scheduler.worker, "_decode", failing)
    on.add_request(good)
    on.add_request(bad)
    while bad.num_output < 3:
        on.step()
    on.abort(bad.rid)                               # its failing step is running
    while on.has_work:
        on.step()
    assert failed and bad.finish_reason.type == "abort" and bad.finish_reason.status_code is None
    assert good.finish_reason.type == "length" and good.output_ids == clean
    assert_all_kv_back(on)


def test_server_streams_and_aborts_with_overlap(tmp_path):
    """Through the HTTP server: concurrent streams as the offline engine without overlap; a client that
    disconnects mid-stream is aborted (with its next step running) and its KV comes back."""
    target = make_model(tmp_path, "llama")      # test_server's: its first token of "one two" shows text
    offline = Engine(server_args=_args(target))
    prompts = [f"{w} {i}" for i, w in enumerate(["The quick", "def add", "one two", "seven"] * 3)]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    expected = [o["text"] for o in offline.generate(prompts, params)]

    async def one(client, prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])

    async def all_streams(url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(one(client, p) for p in prompts))

    with serve(_args(target, enable_overlap_schedule=True)) as live, pytest.MonkeyPatch.context() as mp:
        assert asyncio.run(all_streams(live.url)) == expected
        body = {"prompt": "one two", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        with Hold(live, mp) as hold:
            with live.http() as c, c.stream("POST", "/v1/completions", json=body) as r:
                next(sse(r))
            wait_for(hold.aborted, "the server to abort the disconnected stream")
        m = live.wait_metrics(lambda m: _idle(m) and m.get('spec_requests_total{finish_reason="abort"}', 0) == 1)
        assert m['spec_requests_total{finish_reason="abort"}'] == 1 and _idle(m)


# ---------------------------------------------------------------------------------- decode steps built ahead
def record_decode_batches(eng: Engine) -> list:
    """Per decode forward, what the worker saw: (rid, tokens so far, cached length) per request."""
    batches, worker = [], eng._scheduler.worker
    forward = worker.forward

    def recording(step):
        if isinstance(step, DecodeStep):
            batches.append([(r.rid, len(r.token_ids), r.kv_len) for r in step.reqs])
        return forward(step)

    worker.forward = recording
    return batches


def count_built_ahead(eng: Engine) -> list:
    """The decode steps the scheduler builds ahead (before the previous step's result is applied)."""
    built, sched = [], eng._scheduler
    launch = sched._launch_ahead

    def recording(flight):
        ahead = launch(flight)
        if ahead is not None:
            built.append(ahead)
        return ahead

    sched._launch_ahead = recording
    return built


@pytest.mark.parametrize("algo", [None] + ALGOS)
@pytest.mark.parametrize("kv", [4096, 90])
def test_steps_built_ahead_run_what_runs_without_overlap(algo, kv, target, tmp_path):
    """Without stop strings or grammars, decode steps are built ahead, and the worker sees the same
    batches as without overlap, step for step: requests that a step finishes (stop token, EOS,
    max_new_tokens) are not in the next one, tokens and cached lengths are resolved from the previous
    step. So outputs are the same, under KV pressure too (90 slots), and every slot comes back."""
    off, on = engines(algo, target, tmp_path, max_total_tokens=kv)
    greedy = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    tok = [eng.generate(input_ids=prompts()[1], sampling_params=greedy)["output_ids"][6] for eng in (off, on)][0]
    params = [{"temperature": 0, "max_new_tokens": 9, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 30, "stop_token_ids": [tok], "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 17},
              {"temperature": 0.9, "seed": 3, "max_new_tokens": 21, "ignore_eos": True},
              {"temperature": 0.7, "top_p": 0.9, "seed": 11, "max_new_tokens": 26, "ignore_eos": True}]
    off.flush_cache()
    on.flush_cache()
    batches = {eng: record_decode_batches(eng) for eng in (off, on)}
    built = count_built_ahead(on)
    want = streamed(off, params, return_logprob=True, top_logprobs_num=2)
    got = streamed(on, params, return_logprob=True, top_logprobs_num=2)
    assert got == want
    # Most steps are built ahead; under KV pressure fewer (waiting requests, slots short).
    assert batches[on] == batches[off] and len(built) > len(batches[on]) // (2 if kv == 4096 else 4)
    assert on.stats()["retractions"] == off.stats()["retractions"]
    assert_all_kv_back(on)
    on.shutdown()


def test_the_next_step_is_built_while_the_previous_runs(target, tmp_path):
    """With step N's forward held on the forward thread, step() builds and queues step N+1 (its slots
    taken) before N's tokens are known; once N is let go, the run ends as without overlap."""
    off, on = engines(None, target, tmp_path)
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    want = off.generate(input_ids=prompts()[:2], sampling_params=greedy)
    params = SamplingParams.from_dict(greedy)
    sched, held, launched = on._scheduler, threading.Event(), threading.Event()
    decode, launch = sched.worker._decode, sched._launch_ahead

    def holding(step):
        assert held.wait(120), "the test never let the step go"
        return decode(step)

    def recording(flight):
        ahead = launch(flight)
        if ahead is not None:
            launched.set()
        return ahead

    sched.worker._decode, sched._launch_ahead = holding, recording
    reqs = [on.make_request(p, params) for p in prompts()[:2]]
    for req in reqs:
        on.add_request(req)
    on.step()                                       # launches the prefill
    on.step()                                       # applies it, launches decode step N (held)
    free = on._kv.unused()
    stepping = threading.Thread(target=on.step)     # builds N + 1, then waits for N
    stepping.start()
    wait_for(launched, "step N + 1 to be built")
    assert [r.num_output for r in reqs] == [1, 1]   # N's tokens are not known yet
    assert on._kv.unused() == free - 2 * sched.worker.slots_per_request
    held.set()
    stepping.join()
    while on.has_work:
        on.step()
    assert [r.output_ids for r in reqs] == [o["output_ids"] for o in want]
    assert_all_kv_back(on)
    on.shutdown()


def test_stop_strings_are_not_built_ahead(target, tmp_path):
    """A stop string is found in the text, which the forward thread does not have: while a request
    with one runs, each step waits for the previous one's result."""
    _, on = engines(None, target, tmp_path)
    built = count_built_ahead(on)
    on.generate(input_ids=prompts()[:2], sampling_params={"max_new_tokens": 12, "stop": ["zzzz"], "ignore_eos": True})
    assert built == []
    on.generate(input_ids=prompts()[:2], sampling_params={"max_new_tokens": 12, "ignore_eos": True})
    assert built
    assert_all_kv_back(on)
    on.shutdown()


# ---------------------------------------------------------------------------------- turning it on
@pytest.mark.parametrize("name", ["SGLANG_ENABLE_SPEC_V2", "SPEC_ENABLE_SPEC_V2"])
def test_environment_variable_turns_it_on(name, target, tmp_path, monkeypatch):
    monkeypatch.setenv(name, "True")
    assert ServerArgs().enable_overlap_schedule
    assert not ServerArgs(disable_overlap_schedule=True).enable_overlap_schedule
    eng = Engine(model_path=str(target), dtype="float32", max_total_tokens=1024)
    threads = record_forward_threads(eng)
    eng.generate(input_ids=prompts()[0], sampling_params={"max_new_tokens": 3})
    assert threads == {"spec-forward_0"}
    monkeypatch.setenv(name, "0")
    assert not ServerArgs().enable_overlap_schedule
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ConfigError, match=f"{name} must be 1/true or 0/false"):
        ServerArgs()


def test_flags(served, monkeypatch):
    monkeypatch.delenv("SGLANG_ENABLE_SPEC_V2", raising=False)
    monkeypatch.delenv("SPEC_ENABLE_SPEC_V2", raising=False)
    assert run("serve").exit_code == 0 and not served[-1].enable_overlap_schedule
    assert run("serve", "--enable-overlap-schedule").exit_code == 0 and served[-1].enable_overlap_schedule
    assert run("serve", env={"SGLANG_ENABLE_SPEC_V2": "1"}).exit_code == 0 and served[-1].enable_overlap_schedule
    result = run("serve", "--disable-overlap-schedule", env={"SGLANG_ENABLE_SPEC_V2": "1"})
    assert result.exit_code == 0 and not served[-1].enable_overlap_schedule
    assert_user_error(run("serve", "--enable-overlap-schedule", "--disable-overlap-schedule"), "contradict")
    help_text = run("serve", "--help").output
    assert "--enable-overlap-schedule" in help_text and "SGLANG_ENABLE_SPEC_V2" in help_text


def test_trees_are_refused_chains_chosen(served, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_SPEC_V2", "1")
    line = assert_user_error(run("serve", "--algo", "NGRAM", "--speculative-num-steps", "3",
                                 "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"),
                             "SGLANG_ENABLE_SPEC_V2", "--speculative-eagle-topk 1",
                             "--speculative-num-draft-tokens 4")
    assert "--disable-overlap-schedule" in line and not served
    with pytest.raises(ConfigError, match="--speculative-eagle-topk 1"):
        ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="d", speculative_num_steps=5,
                   speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    # Left out, the tree is a chain: NGRAM's topk, and the auto tree (a Llama's is 5 x 4 otherwise).
    assert ServerArgs(speculative_algorithm="NGRAM").speculative_eagle_topk == 1
    llama = type("Config", (), {"model_type": "llama", "max_position_embeddings": 512})()
    eagle = ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="d")
    assert eagle.resolved(llama, "cuda").speculative_tree == (5, 1, 6)
    assert eagle.resolved(llama, "cpu").speculative_tree == (1, 1, 2)


def test_not_with_tensor_parallelism(monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_SPEC_V2", "1")
    with pytest.raises(ConfigError, match="--tp-size 1 only"):
        ServerArgs(tp_size=2)
