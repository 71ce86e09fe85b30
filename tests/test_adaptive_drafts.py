"""--speculative-adaptive: each step's draft sizes come from the step cost model and each request's
acceptance, speculation turns off and on again with the batch, and output stays lossless when sizes
change from step to step and request to request (down to none, where STANDALONE's draft falls behind
and catches up)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core import cost_probe
from engine import Engine
from engine.build import TimedPlanners
from engine.speculative import standalone
from engine.speculative.cost import DRAFT_WARMUP, Curve, StepCost
from engine.speculative.sizing import DECAY, START_ALPHA, Acceptance, draft_sizes, expected_accepted, worth_exploring
from tests.drafts import ALGOS, draft_setup
from tests.planning import Fixed, fitted, planner
from tests.greedy import generate
from tests.greedy import prompts as standalone_prompts
from tests.lossless import GREEDY, prompts


# ------------------------------------------------------------------ the model
def test_the_cost_model_prices_steps_from_those_observed():
    cost = fitted(0.3, draft=0.002)
    assert cost.seconds(10) == pytest.approx(0.01 * (1 + 0.3 * 10), rel=1e-6)
    assert cost.seconds(10, 2) - cost.seconds(10) == pytest.approx(0.004, rel=1e-6)
    assert cost.relative(4, 2) == pytest.approx((1 + 0.3 * 6) / (1 + 0.3 * 4))
    # Memory-bound to 4 rows, compute-bound past them: between counts seen, interpolated; past the
    # largest, the slope of the two largest goes on.
    knee = StepCost(0.1)
    for rows, seconds in ((1, 0.048), (4, 0.050), (8, 0.100)):
        knee.observe(rows, seconds)
    assert knee.seconds(2) == pytest.approx(0.048 + 0.002 / 3)
    assert knee.seconds(16) == pytest.approx(0.100 + 0.0125 * 8)
    # One count seen: the prior's slope there.
    single = StepCost(0.2)
    single.observe(4, 0.018)
    assert single.seconds(8) == pytest.approx(0.018 + 4 * 0.2 * 0.018 / 1.8)


def test_forwards_measured_at_start_up_price_steps_before_any_is_observed():
    # 1 to 4 rows memory-bound, compute-bound past them; a noisy 2-row time below the 1-row one.
    cost = StepCost(0.1)
    cost.measured({1: 0.050, 2: 0.049, 4: 0.052, 8: 0.090, 16: 0.170}, draft={1: 0.020, 8: 0.034, 32: 0.100})
    assert cost.seconds(1) == pytest.approx(0.050) and cost.seconds(2) == pytest.approx(0.050)   # never cheaper
    assert cost.seconds(6) == pytest.approx(0.071)
    assert cost.seconds(24) == pytest.approx(0.170 + 8 * 0.010)        # past the largest: its last slope
    # Observed steps carry host work a bare forward does not: outside the counts seen, the measured
    # curve scaled through the nearest one.
    cost.observe(4, 0.060)
    assert cost.seconds(4) == pytest.approx(0.060)
    assert cost.seconds(16) == pytest.approx(0.060 * 0.170 / 0.052)
    # A draft model 7 tokens behind feeds them with the next root: 8 rows where 1 would do.
    assert cost.catch_up(7) == pytest.approx(0.014) and cost.catch_up(0) == 0
    assert StepCost(0.1).catch_up(7) == 0                               # nothing measured: not priced


def test_sizes_from_timed_forwards_match_sizes_from_observed_steps():
    """A cost model that only timed forwards at start-up sizes drafts as one that observed steps taking
    those times: every row count priced, the marginal row too (memory-bound to 4 rows here)."""
    times = {1: 0.050, 2: 0.051, 4: 0.053, 8: 0.075, 16: 0.130, 32: 0.240}
    timed, observed = StepCost(0.1), StepCost(0.1)
    timed.measured(times)
    for rows in range(1, 65):
        observed.observe(rows, Curve(times)(rows))
    for alphas in ([0.7], [0.8, 0.4], [0.75] * 4, [0.6] * 8, [0.9, 0.5, 0.2] * 4):
        assert draft_sizes(alphas, 5, timed) == draft_sizes(alphas, 5, observed), alphas
    assert draft_sizes([0.8], 5, timed) == [5] and draft_sizes([0.6] * 8, 5, timed) == [0] * 8


def test_a_draft_model_s_timed_forwards_price_drafting_until_drafted_steps_are_observed():
    """A fresh STANDALONE server under load: drafting priced at nothing until observed made four requests
    draft (and pay for it) before learning that it does not pay; priced by the draft model's start-up
    timings, they stay off while a request alone still drafts."""
    target = {1: 0.040, 2: 0.041, 4: 0.047, 8: 0.060, 16: 0.095, 32: 0.170}
    draft = {1: 0.013, 2: 0.013, 4: 0.014, 8: 0.016, 16: 0.024, 32: 0.040}
    cost, unpriced = StepCost(0.1), StepCost(0.1)
    cost.measured(target, draft, draft_forwards=2, draft_rows=2)
    unpriced.measured(target, draft)
    assert cost.seconds(4, 4) - cost.seconds(4) == pytest.approx(2 * 0.016)       # 2 forwards of 8 rows
    assert cost.seconds(1, 1) - cost.seconds(1) == pytest.approx(2 * 0.013)
    assert draft_sizes([START_ALPHA], 2, cost) == [2]
    assert draft_sizes([START_ALPHA] * 4, 2, cost) == [0] * 4
    assert draft_sizes([START_ALPHA] * 4, 2, unpriced) == [2] * 4
    # Drafted steps observed take over once there are enough to price from.
    for _ in range(DRAFT_WARMUP):
        cost.observe(4, 0.047 + 0.004, 4, 0.004)
    assert cost.seconds(4, 4) - cost.seconds(4) == pytest.approx(0.004)


def test_a_catch_up_keeps_a_request_off_until_it_pays():
    cost = fitted(0.05, draft=0.001)
    assert draft_sizes([0.6, 0.6], 4, cost) == draft_sizes([0.6, 0.6], 4, cost, extra=[0.0, 0.0])
    on = draft_sizes([0.6, 0.6], 4, cost, extra=[0.0, 0.05])
    assert on[0] > 0 and on[1] == 0
    assert draft_sizes([0.6, 0.6], 4, cost, extra=[0.0, 0.0005])[1] > 0   # a small one is worth paying


def timing(timed: list) -> TimedPlanners:
    """The default planner factory, recording each runner it times."""
    def timer(runner, kv):
        timed.append(runner)
        return cost_probe.forward_times(runner, kv)

    return TimedPlanners(timer)


def test_the_forwards_are_timed_on_the_engine_s_own_runners(confident_dir):  # noqa: F811
    """The target's forwards are timed, and the draft model's where it catches up (other tests give
    fixed costs: timings vary by machine), and every slot used is handed back."""
    timed = []
    eng = Engine(model_path=str(confident_dir), dtype="float32", max_total_tokens=8192,
                 speculative_algorithm="STANDALONE", speculative_draft_model_path=str(confident_dir),
                 speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                 planner=timing(timed))
    view = eng.debug
    assert timed == [view.target, view.drafter.runner]
    assert view.kv.unused() == view.kv.capacity
    times = cost_probe.forward_times(view.target, view.kv)
    assert list(times) == list(cost_probe.ROWS) and min(times.values()) > 0
    # Output after the probe is what it was: the probe wrote no slot a request reads.
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    ps = standalone_prompts(2, seed=3, lo=6, hi=10)
    assert generate(eng, ps, params) == generate(Engine(model_path=str(confident_dir), dtype="float32"), ps, params)


def test_a_new_draft_is_priced_by_its_own_forwards(confident_dir, target_dir):  # noqa: F811
    """set_speculative to another draft model gets a new planner, whose step cost is timed on the new
    draft's forwards: nothing learnt of one draft prices another. A model already timed (the target, a
    draft reused with another tree) is not timed again: spec tune switches at every evaluation."""
    timed = []
    standalone_on = dict(speculative_algorithm="STANDALONE", speculative_num_steps=3, speculative_eagle_topk=1,
                         speculative_num_draft_tokens=4)
    eng = Engine(model_path=str(confident_dir), dtype="float32", max_total_tokens=8192,
                 speculative_draft_model_path=str(confident_dir), planner=timing(timed), **standalone_on)
    first = eng.debug
    eng.set_speculative(speculative_draft_model_path=str(target_dir), **standalone_on)
    second = eng.debug
    assert second.drafter is not first.drafter and second.planner is not first.planner
    assert timed == [first.target, first.drafter.runner, second.drafter.runner]
    assert second.planner.cost.catch_up(7) > 0              # the new draft's catch-up is priced
    eng.set_speculative(speculative_draft_model_path=str(target_dir), **{**standalone_on, "speculative_num_steps": 2,
                                                                          "speculative_num_draft_tokens": 3})
    assert eng.debug.drafter is second.drafter and eng.debug.planner is not second.planner
    eng.set_speculative(speculative_algorithm=None)
    assert eng.debug.planner.drafter is None and len(timed) == 3


def test_acceptance_follows_the_verifications():
    rng, alpha = random.Random(0), 0.7
    est = Acceptance()
    for _ in range(400):
        accepted = 0
        while accepted < 4 and rng.random() < alpha:
            accepted += 1
        est.record(4, accepted)
    assert abs(est.value - alpha) < 0.12
    est.record(0, 0)            # nothing proposed: nothing learnt
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)


def test_acceptance_of_sibling_drafts_expects_what_they_give():
    """Two children of the root (STANDALONE's tree on a CPU), one of them accepted 9 times in 10: the
    estimate expects 0.9 tokens from two drafts, as they give. Counted as a chain stopped early at every
    verification it expected 0.70, and a lone request stopped drafting where drafting paid 1.2x."""
    rng, est, expected = random.Random(1), Acceptance(), []
    for _ in range(400):
        est.record(2, int(rng.random() < 0.9))
        expected.append(expected_accepted(est.value, 2))
    assert sum(expected[100:]) / 300 == pytest.approx(0.9, abs=0.04)     # a decayed estimate: on average
    # A lone request on a CPU-like curve: a draft token's row costs 10% of a step, drafting 35%.
    target = {1: 0.035, 2: 0.0385, 4: 0.045, 8: 0.057}
    cost = StepCost(0.1)
    cost.measured(target, {1: 0.0123, 2: 0.0123, 4: 0.0139}, draft_forwards=1, draft_rows=2)
    assert draft_sizes([est.value], 2, cost) == [2]


def test_one_request_keeps_the_whole_tree_where_rows_are_cheap():
    assert draft_sizes([0.7], 5, fitted(0.005)) == [5]
    assert draft_sizes([0.02], 5, fitted(0.005, draft=0.005)) == [0]       # drafting costs more than it gains


def test_drafts_shrink_and_turn_off_as_the_batch_grows():
    cost = fitted(0.25)
    sizes = {b: draft_sizes([0.6] * b, 5, cost) for b in (1, 2, 4, 8, 16, 32)}
    totals = [sum(s) / len(s) for s in sizes.values()]
    assert totals == sorted(totals, reverse=True) and totals[0] >= 2 and totals[-1] == 0


def test_requests_that_draft_worst_turn_off_first():
    sizes = draft_sizes([0.9, 0.5, 0.1, 0.9, 0.5, 0.1], 5, fitted(0.15))
    assert sizes[0] == sizes[3] > sizes[1] == sizes[4] >= sizes[2] == sizes[5]
    assert sizes[2] == 0 and sizes[0] > 0


def test_exploring_requests_draft_one_token_at_least():
    assert draft_sizes([0.01, 0.01], 5, fitted(0.5), forced=[True, False]) == [1, 0]


def test_requests_explore_only_where_drafting_well_would_pay():
    """Sixteen requests, half of them due to try drafting again: where rows are cheap they do; where a
    row costs more than even a draft accepted 9 times in 10 brings (a compute-bound batch), none does."""
    due = [True, False] * 8
    assert worth_exploring([0.01] * 16, due, 5, fitted(0.05)) == due
    assert worth_exploring([0.01] * 16, due, 5, fitted(1.2)) == [False] * 16
    assert worth_exploring([0.01] * 16, [False] * 16, 5, fitted(0.05)) == [False] * 16


# ------------------------------------------------------------------ in the engine
class RecordDrafts:
    """Wraps the worker's forward to record every decode step's draft sizes, checking that no tree
    holds more drafts than its size allowed."""

    def __init__(self, eng: Engine):
        self.steps = []
        self.sized = []             # sized steps: (evidence, draft sizes, drafts proposed) per request
        worker = eng.debug.worker
        forward = worker.forward

        def recording(step):
            result = forward(step)
            if hasattr(step, "drafts"):
                self.steps.append((len(step.reqs), step.drafts))
                if step.drafts is not None:
                    assert all(p <= k for p, k in zip(result.proposed, step.drafts)), (result.proposed, step.drafts)
                    self.sized.append((step.evidence, step.drafts, result.proposed))
            return result

        worker.forward = recording


def test_speculation_turns_off_as_the_batch_grows_and_on_again(confident_dir):  # noqa: F811
    """With every request's acceptance at 0.5 and rows costing 0.4 of a one-row step each, drafting pays
    for one or two requests and not for three or more: it runs for a lone request, stops when eleven
    share the steps, and starts again as they finish (tries to draft again, which a fixed estimate
    cannot use, aside)."""
    eng = Engine(model_path=str(confident_dir), dtype="float32", max_total_tokens=8192,
                 speculative_algorithm="STANDALONE", speculative_draft_model_path=str(confident_dir),
                 speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                 planner=planner(lambda: fitted(0.4), estimate=lambda start, decay: Fixed(0.5),
                                 explore_every=10 ** 6))
    seen = RecordDrafts(eng)
    ps = standalone_prompts(12, seed=4, lo=8, hi=12)
    lens = [6] + [8 + 4 * i for i in range(11)]     # one request alone, then eleven that end one by one
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in lens]
    expected = generate(Engine(model_path=str(confident_dir), dtype="float32"), ps, params)
    first = eng.generate(input_ids=ps[0], sampling_params=params[0])
    rest = eng.generate(input_ids=ps[1:], sampling_params=params[1:])
    assert [first["output_ids"]] + [o["output_ids"] for o in rest] == expected
    steps = [(n, sum(k > 0 for k in d)) for n, d in seen.steps if d is not None]
    assert {on for n, on in steps if n <= 2} == {n for n, _ in steps if n <= 2}     # all drafted
    assert {on for n, on in steps if n >= 3} == {0}
    order = [n for n, _ in steps]
    assert order[0] == 1 and 11 in order and order[-1] == 1     # alone, then eleven, then alone again


def test_drafts_are_sized_by_the_evidence_they_rest_on(target, monkeypatch):
    """NGRAM sizes a draft by the acceptance of drafts from matches as long as its match: where rows
    cost 0.4 of a step, requests matching long contexts (drafts accepted 9 in 10) draft and the others
    (1 in 10) do not, in the same steps; nothing is drafted where nothing matches."""
    eng = Engine(model_path=str(target), dtype="float32", max_total_tokens=8192, speculative_algorithm="NGRAM",
                 planner=planner(lambda: fitted(0.4)))
    eng.debug.planner.by_evidence.update({5: Fixed(0.9), 1: Fixed(0.1)})
    keys = {}                                       # the evidence of each request, the same every step
    monkeypatch.setattr(eng.debug.drafter, "evidence",
                        lambda req: keys.setdefault(req.rid, (5, 1, 0)[len(keys) % 3]))
    seen = RecordDrafts(eng)
    eng.generate(input_ids=prompts(), sampling_params=GREEDY)
    full = [(evidence, drafts) for evidence, drafts, _ in seen.sized if len(drafts) == 5]
    assert full and all(sorted(evidence) == [0, 1, 1, 5, 5] for evidence, _ in full)
    drafted = {key: sum(k for evidence, drafts in full for e, k in zip(evidence, drafts) if e == key)
               for key in (0, 1, 5)}
    assert drafted[5] >= len(full) and drafted[1] == drafted[0] == 0


def test_each_verification_counts_toward_the_estimate_of_its_evidence(target):
    """Each verified draft is recorded once, in the estimate of the evidence it was sized by."""
    recorded = {}

    class Counting(Acceptance):
        def record(self, proposed: int, accepted: int) -> None:
            recorded[id(self)] = recorded.get(id(self), 0) + proposed
            super().record(proposed, accepted)

    eng = Engine(model_path=str(target), dtype="float32", max_total_tokens=8192, speculative_algorithm="NGRAM",
                 planner=planner(estimate=lambda start, decay: Counting(start, decay=decay or DECAY)))
    seen = RecordDrafts(eng)
    eng.generate(input_ids=prompts(), sampling_params=GREEDY)
    proposed = {}
    for evidence, _, drafted in seen.sized:
        for key, n in zip(evidence, drafted):
            proposed[key] = proposed.get(key, 0) + n
    assert proposed.get(0, 0) == 0 and sum(proposed.values()) > 0
    estimates = eng.debug.planner.by_evidence
    assert {key: recorded.get(id(e), 0) for key, e in estimates.items()} == {k: n for k, n in proposed.items() if k}


def test_a_draft_model_left_behind_tries_drafting_again(confident_dir):  # noqa: F811
    """A STANDALONE request whose estimate keeps it off drafts again now and then, its draft model fed
    what it skipped first, where drafting well would pay: an estimate that fell low does not keep the
    request (nor the new requests that start from the average) off for good. Output stays plain's."""
    eng = Engine(model_path=str(confident_dir), dtype="float32", max_total_tokens=8192,
                 speculative_algorithm="STANDALONE", speculative_draft_model_path=str(confident_dir),
                 speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                 planner=planner(lambda: fitted(0.05), estimate=lambda start, decay: Fixed(0.01)))
    seen = RecordDrafts(eng)
    ps = standalone_prompts(1, seed=4, lo=8, hi=12)
    params = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
    expected = generate(Engine(model_path=str(confident_dir), dtype="float32"), ps, params)
    assert [o["output_ids"] for o in eng.generate(input_ids=ps, sampling_params=params)] == expected
    drafted = [i for i, (_, sizes) in enumerate(seen.steps) if sizes and sizes[0]]
    assert len(drafted) >= 2 and drafted[0] > 0          # off at first, by its estimate; then tries


@pytest.fixture
def random_sizes():
    """A planner whose draft sizes are drawn at random per request and step (0 included)."""
    rng = random.Random(7)
    return planner(sizes=lambda alphas, limit: [rng.randint(0, limit) for _ in alphas])


@pytest.mark.parametrize("algo", ALGOS)
def test_lossless_with_sizes_changing_every_step(algo, target, tmp_path, random_sizes):
    kw = {"model_path": str(target), "dtype": "float32", "max_total_tokens": 8192,
          **draft_setup(algo, target, tmp_path)}
    plain = Engine(model_path=kw["model_path"], dtype="float32", max_total_tokens=8192)
    seeded = {"temperature": 0.9, "top_k": 20, "max_new_tokens": 32, "ignore_eos": True, "seed": 5}
    expected = [[o["output_ids"] for o in plain.generate(input_ids=prompts(), sampling_params=p)]
                for p in (GREEDY, seeded)]
    eng = Engine(speculative_algorithm=algo, speculative_num_steps=3, speculative_eagle_topk=2,
                 speculative_num_draft_tokens=5, planner=random_sizes, **kw)
    seen = RecordDrafts(eng)
    for params, want in zip((GREEDY, seeded), expected):
        outs = eng.generate(input_ids=prompts(), sampling_params=params)
        assert [o["output_ids"] for o in outs] == want
    sizes = {k for _, d in seen.steps if d for k in d}
    assert sizes == {0, 1, 2, 3, 4}


def test_a_lagging_draft_catches_up_exactly(confident_dir, random_sizes, monkeypatch):  # noqa: F811
    """STANDALONE with the target as its own draft accepts every drafted token, however long its draft
    was left behind (caught up in pieces of 5 tokens here), and a prefix a lagging request left in the
    radix cache is fed again when reused."""
    monkeypatch.setattr(standalone, "CATCH_UP_CHUNK", 5)
    eng = Engine(model_path=str(confident_dir), dtype="float32", max_total_tokens=8192,
                 speculative_algorithm="STANDALONE", speculative_draft_model_path=str(confident_dir),
                 speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                 planner=random_sizes)
    ps = standalone_prompts(4, seed=9, lo=6, hi=14)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    plain = Engine(model_path=str(confident_dir), dtype="float32")
    first = eng.generate(input_ids=ps, sampling_params=params)
    assert [o["output_ids"] for o in first] == generate(plain, ps, params)
    again = [p + o["output_ids"][:30] + [7, 8] for p, o in zip(ps, first)]          # radix hits on lagged prefixes
    second = eng.generate(input_ids=again, sampling_params=params)
    assert [o["output_ids"] for o in second] == generate(plain, again, params)
    drafter = eng.debug.drafter
    assert not drafter.behind and not drafter.parked       # every finished request's state is gone
    # Every drafted token was accepted (a miss would pull the estimate down).
    assert eng.debug.planner.across.value > 0.95


def test_a_budget_keeps_the_best_drafts_of_the_search():
    """A tree cut to k drafts holds what a search for k + 1 nodes finds: the k best-scoring drafts,
    parents before children; the other trees of the batch keep theirs."""
    from engine.speculative.draft_tree_search import search_trees

    B, V, steps, topk = 3, 50, 3, 3
    roots = torch.arange(B)

    def expand_for(seed: int):
        def expand(depth, tokens, parents):
            g = torch.Generator().manual_seed(seed * 100 + depth)
            return torch.randn((B, topk, V), generator=g) * 3
        return expand

    scores = torch.randn((B, V), generator=torch.Generator().manual_seed(1)) * 3
    cut = search_trees(roots, scores, expand_for(2), steps, topk, 10, budgets=[2, 0, 9])
    for b, k in enumerate([2, 0, 9]):
        alone = search_trees(roots, scores, expand_for(2), steps, topk, k + 1)
        assert cut.sizes[b] == k + 1
        assert cut.tokens[b, :k + 1].tolist() == alone.tokens[b].tolist()
        assert cut.parents[b, :k + 1].tolist() == alone.parents[b].tolist()
        assert (cut.tokens[b, k + 1:] == 0).all() and (cut.parents[b, k + 1:] == -1).all()
