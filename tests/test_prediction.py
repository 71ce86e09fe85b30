"""Predicted Outputs: a request's `prediction` drafts a chain that verification checks like any draft,
so outputs are the model's own whatever the prediction (greedy token for token; seeded sampling too,
by the coupled rule), with every algorithm and beside requests without one; the place in the
prediction is found again after an edit; usage counts what was verified."""

from __future__ import annotations

import json

import pytest
import torch

from engine import Engine
from engine.errors import RequestError
from engine.speculative.prediction import Prediction, chain_length
from tests.drafts import ALGOS, draft_setup, module_for
from tests.planning import untimed
from tests.tiny import make_model, random_prompts

NEW = 48
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("pred"), "llama", seed=11, vocab=320)


def edits(out: list[int]) -> dict[str, list[int]]:
    """Predictions of an answer `out`: the answer itself, a part, edited ones, an unrelated one, none."""
    return {"exact": out, "partial": out[:NEW // 2], "changed": out[:16] + [5, 6, 7] + out[21:],
            "inserted": out[:16] + [5, 6, 7] + out[16:], "deleted": out[:16] + out[26:],
            "unrelated": random_prompts(1, seed=77, lo=NEW, hi=NEW + 1)[0], "empty": []}


# ---------------------------------------------------------------------------------------- following
def test_follow_and_reanchor_after_insertion_deletion_and_change():
    pred = Prediction(list(range(100, 140)))
    for t in range(100, 110):
        pred.follow(t)
    assert pred.place([108, 109]) == 10
    # Inserted text: the place is lost, then found where the output rejoins the prediction.
    for t in (7, 8, 9):
        pred.follow(t)
    assert pred.place([8, 9]) is None
    pred.follow(110)
    pred.follow(111)
    assert pred.place([9, 110, 111]) == 12
    # Deleted text (the output skips 112-119), then a changed line (120 becomes 5).
    for t in (120, 121):
        pred.follow(t)
    assert pred.place([111, 120, 121]) == 22
    for t in (5, 123, 124):
        pred.follow(t)
    assert pred.place([5, 123, 124]) == 25


def test_reanchor_takes_the_first_occurrence_after_the_confirmed_place():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3, 6]
    pred = Prediction(tokens)
    for t in tokens[:6]:
        pred.follow(t)
    pred.follow(42)                                   # an edit at position 6
    # (1, 2, 3) ends at 3, 8 and 13: 3 is behind the confirmed place (6), 13 beyond the nearest.
    assert pred.place([42, 1, 2, 3]) == 8


def test_one_token_agreeing_by_chance_does_not_move_the_lookups_on():
    """Repetitive text: after an edit, a lookup finds a place further on and the next token agrees
    there by chance; when the output then leaves it, the place it really is at is found again."""
    pred = Prediction(list(range(10)) + [50, 51, 52, 53, 54, 55, 56, 57, 77, 52, 99, 98])
    for t in list(range(10)) + [50]:
        pred.follow(t)
    pred.follow(77)                                   # the edit: 51 became 77
    assert pred.place([9, 50, 77]) == 19              # 77 occurs once: the wrong place, after 77
    pred.follow(52)                                   # agrees there by chance
    pred.follow(53)
    assert pred.place([50, 77, 52, 53]) == 14         # where the output really is


def test_token_boundaries_that_differ_fall_in_line():
    """The same text cut into tokens differently inside the answer (a merged token at an edit's edge):
    the tokens after the cut match the prediction's own again."""
    pred = Prediction([10, 11, 12, 13, 14, 15, 16])    # "ab" "c" "d" ... tokenized alone
    pred.follow(99)                                    # the answer cut "abc" as one token
    assert pred.place([99]) is None
    pred.follow(12)
    pred.follow(13)
    assert pred.place([99, 12, 13]) == 4
    assert pred.chain([99, 12, 13], 8) == [14, 15, 16]


def test_chain_length_follows_acceptance_and_cost():
    cheap, dear = (lambda k: 1 + 0.01 * k), (lambda k: 1 + 0.2 * k)
    def rate(r):
        return lambda i: r

    def doubtful(first):                                  # a place not yet confirmed: its first tokens
        return lambda i: first if i < 2 else 0.95

    assert chain_length(rate(0.95), 64, cheap) > chain_length(rate(0.95), 64, dear) > 0
    assert chain_length(rate(0.05), 64, dear) == 0          # a failing prediction costs nothing
    assert chain_length(rate(0.99), 5, cheap) == 5          # never past what is left
    # Doubtful first tokens shorten the chain, down to none.
    assert chain_length(rate(0.95), 64, dear) > chain_length(doubtful(0.6), 64, dear) > 0
    assert chain_length(doubtful(0.05), 64, dear) == 0


def test_acceptance_is_learnt_from_every_committed_token():
    """A prediction the output keeps leaving stops drafting; the output following it again, even while
    nothing is drafted, brings the chains back."""
    dear = lambda k: 1 + 0.3 * k                       # noqa: E731
    pred, out = Prediction(list(range(1000))), []

    def commit(tokens):
        for t in tokens:
            out.append(t)
            pred.follow(t)
            pred.place(out[-4:])                       # as the scheduler looks it up each step

    commit(range(4))
    for start in range(10, 200, 10):                   # places found by chance, left at once
        commit([start, -start])
    assert chain_length(pred.chance, 64, dear) == 0
    commit(range(300, 330))                            # undrafted, the output follows the prediction
    assert chain_length(pred.chance, 64, dear) >= 8


# ---------------------------------------------------------------------------------------- lossless
@pytest.mark.parametrize("algo", [None] + ALGOS)
def test_greedy_output_is_the_model_own_whatever_the_prediction(algo, model, tmp_path):
    """Every kind of prediction, batched with a request that has none: greedy tokens equal plain
    decoding's without predictions, under every algorithm; the exact prediction was verified."""
    if algo:
        pytest.importorskip(module_for(algo))
    kw = draft_setup(algo, model, tmp_path) if algo else {}
    target = kw.pop("model_path", model)
    prompts = random_prompts(2, seed=5, lo=12, hi=30)
    plain = Engine(planner=untimed, model_path=str(target), dtype="float32", max_total_tokens=8192)
    expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    spec = {"speculative_algorithm": algo, **kw} if algo else {}
    eng = Engine(planner=untimed, model_path=str(target), dtype="float32", max_total_tokens=8192, **spec)
    for name, pred in edits(expected[0]).items():
        outs = eng.generate(input_ids=prompts, sampling_params=[{**GREEDY, "prediction": pred}, GREEDY])
        assert [o["output_ids"] for o in outs] == expected, name
        meta = outs[0]["meta_info"]
        if name == "exact":
            assert meta["accepted_prediction_tokens"] > NEW // 2 and meta["rejected_prediction_tokens"] == 0
        assert "accepted_prediction_tokens" not in outs[1]["meta_info"]


@pytest.mark.parametrize("variant", [{"chunked_prefill_size": 8}, {"max_total_tokens": 120},
                                     {"max_running_requests": 1}], ids=["chunked", "preempt", "one-at-a-time"])
def test_predictions_under_scheduling_variants(variant, model):
    prompts = random_prompts(4, seed=6, lo=12, hi=30)
    plain = Engine(planner=untimed, model_path=str(model), dtype="float32", max_total_tokens=8192)
    expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    eng = Engine(planner=untimed, model_path=str(model), dtype="float32", **{"max_total_tokens": 8192, **variant})
    params = [{**GREEDY, "prediction": edits(out)["changed"]} for out in expected]
    for _ in range(2):                                        # the second time over cached prompts
        assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)] == expected
    if variant.get("max_total_tokens"):
        assert eng.stats()["retractions"] > 0


def test_seeded_sampling_with_a_prediction_draws_plain_decodings_tokens(model):
    prompts = random_prompts(6, seed=8, lo=12, hi=30)
    params = [{"temperature": 0.8, "seed": i, "max_new_tokens": NEW, "ignore_eos": True} for i in range(6)]
    plain = Engine(planner=untimed, model_path=str(model), dtype="float32", max_total_tokens=8192)
    expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    outs = plain.generate(input_ids=prompts, sampling_params=[{**p, "prediction": e} for p, e in zip(params, expected)])
    assert [o["output_ids"] for o in outs] == expected
    assert sum(o["meta_info"]["accepted_prediction_tokens"] for o in outs) > NEW


def test_usage_counts_what_was_verified(model):
    """accepted + rejected = the prediction tokens verified; an exact prediction has none rejected and
    one decode step per chain."""
    eng = Engine(planner=untimed, model_path=str(model), dtype="float32", max_total_tokens=8192)
    p = random_prompts(1, seed=9, lo=20, hi=21)[0]
    out = eng.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
    steps = eng.stats()["decode_steps"]
    meta = eng.generate(input_ids=p, sampling_params={**GREEDY, "prediction": out})["meta_info"]
    steps = eng.stats()["decode_steps"] - steps
    # The first token comes from the prompt's forward; each decode step emits its accepted tokens + 1.
    assert meta["rejected_prediction_tokens"] == 0
    assert meta["accepted_prediction_tokens"] + steps == NEW - 1
    meta = eng.generate(input_ids=p, sampling_params={**GREEDY, "prediction": [t + 1 for t in out]})["meta_info"]
    assert meta["accepted_prediction_tokens"] == 0


def test_prediction_with_n_choices_and_logprobs(model):
    eng = Engine(planner=untimed, model_path=str(model), dtype="float32", max_total_tokens=8192)
    p = random_prompts(1, seed=10, lo=20, hi=21)[0]
    base = eng.generate(input_ids=p, sampling_params={**GREEDY, "n": 2}, return_logprob=True, top_logprobs_num=2)
    got = eng.generate(input_ids=p, sampling_params={**GREEDY, "n": 2, "prediction": base[0]["output_ids"]},
                       return_logprob=True, top_logprobs_num=2)
    for a, b in zip(base, got):
        assert a["output_ids"] == b["output_ids"]
        for (la, ta, _), (lb, tb, _) in zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]):
            assert ta == tb and la == pytest.approx(lb, abs=1e-4)


def test_text_prediction_and_bad_predictions(model):
    eng = Engine(planner=untimed, model_path=str(model), dtype="float32", max_total_tokens=8192)
    out = eng.generate(prompt="hello world", sampling_params=GREEDY)
    again = eng.generate(prompt="hello world", sampling_params={**GREEDY, "prediction": out["text"]})
    assert again["output_ids"] == out["output_ids"]
    for bad, says in ((5, "prediction must be text"), ([1, -2], "prediction must be text"),
                      ("a\ud800", "surrogate"), ([10 ** 6], "outside the vocabulary"),
                      ([1] * 100_000, "more than the context length")):
        with pytest.raises(RequestError, match=says) as err:
            eng.generate(prompt="hi", sampling_params={**GREEDY, "prediction": bad})
        assert err.value.param == "prediction"


def test_prediction_under_grammar_stop_strings_and_logit_bias(model):
    """A prediction with structured output, stop strings and logit_bias: the output is the one without
    the prediction, and a drafted prediction token the grammar refuses is never accepted."""
    eng = Engine(planner=untimed, model_path=str(model), dtype="float32", max_total_tokens=8192,
                 constrained_json_disable_any_whitespace=True)
    p = random_prompts(1, seed=12, lo=15, hi=16)[0]
    schema = {"type": "object", "properties": {"kind": {"enum": ["fox", "dog"]}, "n": {"type": "integer"}},
              "required": ["kind", "n"]}
    cases = [{"json_schema": json.dumps(schema), "max_new_tokens": 40, "ignore_eos": False},
             {"logit_bias": {"7": 100.0}, "max_new_tokens": 12}]
    plain_text = eng.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 30})["text"]
    if len(plain_text) > 8:
        cases.append({"stop": [plain_text[4:8]], "max_new_tokens": 30})
    for extra in cases:
        params = {**GREEDY, **extra}
        expected = eng.generate(input_ids=p, sampling_params=params)
        for pred in (expected["output_ids"], expected["output_ids"][::-1], edits(expected["output_ids"])["changed"]):
            got = eng.generate(input_ids=p, sampling_params={**params, "prediction": pred})
            assert got["output_ids"] == expected["output_ids"] and got["text"] == expected["text"], extra


@pytest.mark.parametrize("rule", ["coupled", "tree"])
def test_sampled_output_with_a_prediction_is_the_target_distribution(rule, tmp_path):
    """Two-token continuations of an 8-token-vocabulary target sampled with a prediction of their most
    likely pair: under both rules, the target's exact joint distribution (chi-square)."""
    from engine.core.sampling_params import SamplingParams
    from tests.lossless import SAMPLE_PROMPT, SAMPLES, VOCAB, chi_square_p, exact_two_token_distribution

    target = make_model(tmp_path / "small", "llama", seed=5, vocab=VOCAB)
    eng = Engine(planner=untimed,
                 model_path=str(target), dtype="float32", max_total_tokens=32768, max_running_requests=256,
                 speculative_sampling=rule) if rule != "coupled" else Engine(planner=untimed, 
        model_path=str(target), dtype="float32", max_total_tokens=32768, max_running_requests=256)
    sampling = {"temperature": 0.9}
    expected = exact_two_token_distribution(target, SAMPLE_PROMPT, SamplingParams(**sampling))
    best = divmod(int(expected.flatten().argmax()), VOCAB)
    # Three tokens: the first comes from the prompt's forward, the second is the verified one.
    params = {**sampling, "max_new_tokens": 3, "ignore_eos": True, "prediction": list(best) + [1, 2]}
    outs = eng.generate(input_ids=[SAMPLE_PROMPT] * SAMPLES, sampling_params=[
        {**params, "seed": i} if rule == "coupled" else params for i in range(SAMPLES)])
    counts = torch.zeros(VOCAB, VOCAB)
    for o in outs:
        a, b, _ = o["output_ids"]
        counts[a, b] += 1
    assert chi_square_p(counts, expected) > 0.001
    assert sum(o["meta_info"]["accepted_prediction_tokens"] for o in outs) > SAMPLES * expected[best] / 2
