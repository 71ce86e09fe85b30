"""Deterministic by default: with the default flags, a request's tokens are those it gets alone from an
empty cache, whatever else is batched with it, how its prompt is chunked, how much of it is cached,
whether it was preempted, and which speculative algorithm runs; greedy and seeded sampling alike.

bf16 on purpose: there a last-bit difference in a prompt's K/V (SDPA over a different batch or a
cached prefix) grows into a different token within a few dozen steps, which float32 would hide."""

from __future__ import annotations

import pytest

from engine import Engine
from tests.drafts import ALGOS, draft_setup, module_for
from tests.planning import untimed
from tests.tiny import make_model, random_prompts

NEW_TOKENS = 24
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def seeded(i: int) -> dict:
    return {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def request_set() -> list[list[int]]:
    """16 prompts, the second half sharing a 24-token prefix with the first (radix hits in one batch)."""
    first = random_prompts(8, seed=31, lo=20, hi=48)
    return first + [first[i][:24] + p for i, p in enumerate(random_prompts(8, seed=32, lo=3, hi=20))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("det"), "llama", seed=11, vocab=320)


def alone(model_path, prompts, params) -> list[list[int]]:
    """Each request alone, from an empty cache, plain decoding: the reference."""
    out = []
    for i, p in enumerate(prompts):
        eng = Engine(planner=untimed,
                     model_path=str(model_path), dtype="bfloat16", disable_radix_cache=True, max_total_tokens=4096)
        out.append(eng.generate(input_ids=p, sampling_params=params(i))["output_ids"])
        eng.shutdown()
    return out


def test_deterministic_inference_is_the_cpu_default(model):
    eng = Engine(planner=untimed, model_path=str(model), dtype="bfloat16", max_total_tokens=4096)
    assert eng.args.enable_deterministic_inference
    eng.shutdown()
    eng = Engine(planner=untimed,
                 model_path=str(model), dtype="bfloat16", max_total_tokens=4096, disable_deterministic_inference=True)
    assert not eng.args.enable_deterministic_inference
    eng.shutdown()


def test_contradicting_switches_are_refused():
    from engine.config import ServerArgs
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="contradict"):
        ServerArgs(enable_deterministic_inference=True, disable_deterministic_inference=True)


@pytest.mark.parametrize("algo", [None] + ALGOS)
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_same_tokens_as_alone_whatever_the_cache_batch_chunking_and_draft(algo, kind, model, tmp_path):
    """Default flags: 16 requests batched (prefill beside each other, decode in batches of 1-16), then
    the same requests again (radix hits), chunked prefill and preemption, under every algorithm: each
    request's tokens equal its tokens alone, from an empty cache, with plain decoding."""
    if algo:
        pytest.importorskip(module_for(algo))
    kw = draft_setup(algo, model, tmp_path) if algo else {}
    target = kw.pop("model_path", model)
    params = (lambda i: GREEDY) if kind == "greedy" else seeded
    prompts = request_set()
    expected = alone(target, prompts, params)
    spec = {"speculative_algorithm": algo, **kw} if algo else {}
    for variant in ({}, {"chunked_prefill_size": 8}, {"max_total_tokens": 160}):
        eng = Engine(planner=untimed,
                     model_path=str(target), dtype="bfloat16", **{"max_total_tokens": 4096, **spec, **variant})
        for repeat in range(2 if not variant else 1):        # the second time over cached prompts
            outs = eng.generate(input_ids=prompts, sampling_params=[params(i) for i in range(len(prompts))])
            assert [o["output_ids"] for o in outs] == expected, (variant, repeat)
        if not variant:
            assert eng.stats()["cached_tokens"] > 0
        if "max_total_tokens" in variant:
            assert eng.stats()["retractions"] > 0
        eng.shutdown()


def test_n_choices_have_keyed_streams_of_their_own(model):
    """n > 1 with a seed: choice k is reproducible, and distinct from choice 0 of seed + k."""
    eng = Engine(planner=untimed, model_path=str(model), dtype="bfloat16", max_total_tokens=4096)
    p = request_set()[0]
    params = {**seeded(0), "temperature": 1.5, "top_p": 1.0, "n": 3}
    first = [o["output_ids"] for o in eng.generate(input_ids=p, sampling_params=params)]
    again = [o["output_ids"] for o in eng.generate(input_ids=p, sampling_params=params)]
    assert first == again and len({tuple(o) for o in first}) == 3
    shifted = eng.generate(input_ids=p, sampling_params={**params, "seed": params["seed"] + 1, "n": 1})
    assert shifted["output_ids"] != first[1]
    eng.shutdown()
