"""One request's failure is that request's alone: a step that fails is run again request by request,
the failing one ends with an error (status 500) and the others finish exactly as in a clean run, for
plain decoding and every speculative algorithm; every KV slot comes back. And the lpm policy cannot
starve a request that shares no cached prefix."""

from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.core.sampling_params import SamplingParams
from tests.drafts import ALGOS, draft_setup
from tests.planning import untimed
from tests.tiny import make_model

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("target"), "llama", seed=3)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 290, (n,), generator=g).tolist() for n in (6, 14, 9, 21)]


def build(algo, target, tmp_path) -> Engine:
    spec = {} if algo is None else {"speculative_algorithm": algo, **dict(zip(
        ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"), (3, 2, 5))),
        **draft_setup(algo, target, tmp_path)}
    return Engine(planner=untimed, **{"model_path": str(target), "dtype": "float32", "max_total_tokens": 4096, **spec})


def target_model(eng: Engine):
    return eng.debug.target.model


@pytest.mark.parametrize("algo", [None] + ALGOS)
@pytest.mark.parametrize("phase", ["prefill", "decode", "detokenize"])
def test_a_failing_request_fails_alone(algo, phase, target, tmp_path, monkeypatch):
    eng = build(algo, target, tmp_path)
    clean = [o["output_ids"] for o in eng.generate(input_ids=prompts(), sampling_params=GREEDY)]
    reqs = [eng.make_request(p, SamplingParams.from_dict(GREEDY)) for p in prompts()]
    for r in reqs:
        eng.add_request(r)
    bad = reqs[2]
    worker = eng.debug.worker
    if phase == "detokenize":           # the request's detokenizer breaks after a few tokens
        step, calls = bad.detok.step, []

        def failing(ids, final=False):
            calls.append(1)
            if len(calls) > 3:
                raise ValueError("injected failure")
            return step(ids, final)

        bad.detok.step = failing
    else:                               # any step holding the request fails (in decode: from its 3rd token)
        run = getattr(worker, f"_{phase}")

        def failing(step):
            if any(r is bad for r in step.reqs) and (phase == "prefill" or bad.num_output >= 3):
                raise RuntimeError("injected failure")
            return run(step)

        monkeypatch.setattr(worker, f"_{phase}", failing)
    while eng.has_work:
        eng.step()
    reason = bad.finish_reason
    assert reason.type == "abort" and reason.status_code == 500 and "internal error" in reason.message
    assert [r.output_ids for r in reqs if r is not bad] == [o for r, o in zip(reqs, clean) if r is not bad]
    assert eng.stats()["kv_tokens_used"] == 0 and not eng.has_work
    # The engine goes on serving.
    assert eng.generate(input_ids=prompts()[0], sampling_params=GREEDY)["output_ids"] == clean[0]


def test_lpm_cannot_starve_a_request_without_a_cached_prefix(target):
    """One request runs at a time; a cached prefix P attracts a stream of later requests. The one
    sharing nothing is overtaken a bounded number of times, not until the stream dries up."""
    eng = Engine(planner=untimed,
                 model_path=str(target), dtype="float32", max_total_tokens=4096, max_running_requests=1,
                 schedule_policy="lpm")
    shared = list(range(10, 40))
    eng.generate(input_ids=shared + [5], sampling_params=GREEDY)          # P is cached now
    params = SamplingParams.from_dict({**GREEDY, "max_new_tokens": 2})
    lonely = eng.make_request([200, 201, 202, 203], params)
    eng.add_request(lonely)
    stream = [eng.make_request(shared + [6 + i], params) for i in range(40)]
    for r in stream:
        eng.add_request(r)
    order = []
    while eng.has_work:
        order += [r for r in eng.step() if r.finished]
    assert order.index(lonely) <= 17 < len(order) - 1
