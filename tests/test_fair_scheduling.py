"""Fair shares of the engine (engine/core/scheduler.py), observed step by step, never by time: running
streams decode between any two prefill steps, a short prompt is not held behind a long one prefilled
in pieces (nor can short prompts stall the long one, which takes an equal part of a step while
others wait), and one client request's choices cannot hold
every running place while another waits. Outputs stay those of each request run alone."""

from __future__ import annotations

import pytest

from engine import Engine
from engine.core.sampling_params import SamplingParams
from tests.planning import untimed
from tests.tiny import make_model, random_prompts

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("target"), "llama", seed=5)


def engine(target, **kw) -> Engine:
    return Engine(planner=untimed, model_path=str(target), dtype="float32", max_total_tokens=4096, **kw)


def params(n_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams.from_dict({**GREEDY, "max_new_tokens": n_tokens, "n": n})


def alone(target, prompt: list[int], n_tokens: int) -> list[int]:
    return engine(target).generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": n_tokens})["output_ids"]


def run_until(eng: Engine, done, limit: int = 400) -> int:
    """Steps taken until done() holds."""
    for steps in range(1, limit + 1):
        eng.step()
        if done():
            return steps
    raise AssertionError(f"not done after {limit} steps")


def test_streams_decode_between_prefill_steps(target):
    eng = engine(target, chunked_prefill_size=8)
    stream = eng.make_request(random_prompts(1, seed=1)[0], params(200))
    eng.add_request(stream)
    run_until(eng, lambda: stream.num_output > 0)
    long = eng.make_request(random_prompts(1, seed=2, lo=96, hi=97)[0], params(4))
    eng.add_request(long)
    prefilled, outputs, gaps = long.kv_len, stream.num_output, []
    while long.num_output == 0:
        eng.step()
        if long.kv_len > prefilled:                 # a prefill step (or one piece of it) ran
            gaps.append(stream.num_output - outputs)
            prefilled, outputs = long.kv_len, stream.num_output
    assert len(gaps) >= 12, "the long prompt went in pieces"
    assert all(g > 0 for g in gaps[1:]), f"the stream got no token between two prefill steps: {gaps}"
    eng.abort_all()


@pytest.mark.parametrize("longer_len, shorter_len", [(120, 5), (160, 30)], ids=["fits-a-step", "in-pieces-too"])
def test_a_shorter_prompt_does_not_wait_for_a_longer_one(target, longer_len, shorter_len):
    """The longer prompt goes in pieces; the shorter one, whole in a step or in pieces too, goes first."""
    eng = engine(target, chunked_prefill_size=8)
    longer_prompt, shorter_prompt = (random_prompts(1, seed=seed, lo=n, hi=n + 1)[0]
                                     for seed, n in ((longer_len, longer_len), (shorter_len, shorter_len)))
    longer = eng.make_request(longer_prompt, params(6))
    eng.add_request(longer)
    eng.step()
    shorter = eng.make_request(shorter_prompt, params(6))
    eng.add_request(shorter)
    run_until(eng, lambda: shorter.num_output > 0)
    assert longer.num_output == 0, "the shorter prompt waited for the whole longer one"
    run_until(eng, lambda: not eng.has_work)
    assert longer.output_ids == alone(target, longer_prompt, 6) and shorter.output_ids == alone(target, shorter_prompt, 6)


def test_short_prompts_cannot_stall_a_long_one(target):
    """A new short prompt every step: the long prompt still gets a quarter of every prefill step."""
    eng = engine(target, chunked_prefill_size=8, max_running_requests=64)
    long = eng.make_request(random_prompts(1, seed=5, lo=64, hi=65)[0], params(2))
    eng.add_request(long)
    newcomers = iter(random_prompts(200, seed=6, lo=6, hi=7))
    steps = 0
    while long.num_output == 0:
        eng.add_request(eng.make_request(next(newcomers), params(1)))
        eng.step()
        steps += 1
    # 64 tokens at >= 2 a prefill step, with a decode step between prefill steps.
    assert steps <= 2 * 64 // 2 + 2, steps
    eng.abort_all()


def test_a_long_prompt_takes_an_equal_part_while_others_wait(target):
    """With seven other client requests waiting, the long prompt's floor is an eighth of the step, not
    the quarter it keeps against fewer."""
    eng = engine(target, chunked_prefill_size=16, max_running_requests=64)
    long = eng.make_request(random_prompts(1, seed=9, lo=64, hi=65)[0], params(2))
    eng.add_request(long)
    eng.step()
    before = long.kv_len
    for prompt in random_prompts(7, seed=10, lo=12, hi=13):
        eng.add_request(eng.make_request(prompt, params(1)))
    eng.step()
    assert long.kv_len - before == 16 // 8
    run_until(eng, lambda: not eng.has_work)
    assert long.output_ids == alone(target, long.prompt_ids, 2)


def test_one_client_request_cannot_hold_every_running_place(target):
    eng = engine(target, max_running_requests=4)
    prompt, other = random_prompts(2, seed=7)
    choices = eng.make_choices(prompt, params(120, n=4))
    for r in choices:
        eng.add_request(r)
    run_until(eng, lambda: all(r.num_output > 0 for r in choices))
    late = eng.make_request(other, params(8))
    eng.add_request(late)
    steps = run_until(eng, lambda: late.num_output > 0)
    assert steps <= 4 and not any(r.finished for r in choices), "the newcomer waited for the choices to end"
    run_until(eng, lambda: not eng.has_work)
    expected = alone(target, prompt, 120)
    assert all(r.output_ids == expected for r in choices) and late.output_ids == alone(target, other, 8)
    assert eng.stats()["retractions"] >= 1 and eng.stats()["kv_tokens_used"] == 0


def test_client_requests_arriving_together_share_the_places(target):
    eng = engine(target, max_running_requests=4)
    a, b = random_prompts(2, seed=8)
    first, second = eng.make_choices(a, params(16, n=4)), eng.make_choices(b, params(16, n=4))
    for r in first + second:
        eng.add_request(r)
    run_until(eng, lambda: any(r.num_output > 0 for r in first + second))
    assert sum(r.num_output > 0 for r in first) == sum(r.num_output > 0 for r in second) == 2
    run_until(eng, lambda: not eng.has_work)
    assert all(len(r.output_ids) == 16 for r in first + second)
