"""`spec tune`: the search space, successive halving and its time budget (with a fake clock and fake
speeds), the saved config, and an end-to-end search on a tiny model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from spec_tools.bench.datasets import Conversation
from spec_tools.bench.measure import PassResult, TurnResult, interleave_chunks
from spec_tools.bench.offline import OfflineBackend, plain_args, tree_args
from spec_tools.bench.tune import Plan, describe, label, search_space, serve_command, serve_config, successive_halving
from engine.config import ServerArgs
from engine.engine import Engine
from spec_cli.main import app
from tests.planning import untimed
from tests.tiny import make_model

NGRAM = ServerArgs(speculative_algorithm="NGRAM")
PROMPTS = [Conversation(str(i), "c", ("hello",), i) for i in range(16)]


def fake_pass(tokens_per_s: float, prompts: list[Conversation]) -> PassResult:
    turns = [TurnResult(c.id, c.category, 0, 4, 10, 0.01, 0.1, [], []) for c in prompts]
    return PassResult(turns, duration=10 * len(prompts) / tokens_per_s)


# --- search space -----------------------------------------------------------------------------------

def test_search_space_skips_impossible_trees():
    trees, skipped = search_space(NGRAM, [1, 2, 3], [1, 2], [3, 4])
    # topk 1 is a chain: steps + 1 tokens, whatever --search-draft-tokens says.
    assert trees == [(1, 1, 2), (1, 2, 3), (2, 1, 3), (2, 2, 3), (2, 2, 4), (3, 1, 4), (3, 2, 3), (3, 2, 4)]
    assert [s["tree"] for s in skipped] == [[1, 2, 4]]
    assert "topk + (steps-1)*topk^2 + 1 = 3" in skipped[0]["reason"]


def test_plan_fits_the_prompts():
    plan = Plan.make(8, 16, 1)
    assert plan == Plan(3, 2, 2.0, 1)                                # 2 + 4 + 8 prompts, 8 -> 4 -> 2
    assert [len(interleave_chunks(range(n), 1)) for n in (2, 4, 8)] == [2, 4, 4]
    assert [len(c) for c in interleave_chunks(range(10), 4)] == [4, 4, 2]     # a full batch at least
    assert plan.evaluations(8) == 9 * 2 + 5 * 4 + 3 * 4
    plan = Plan.make(20, 16, 4)                                     # room for two rounds with a full batch
    assert (plan.rounds, plan.first) == (2, 5) and plan.keep(20) == 2
    assert Plan.make(1, 16, 1).rounds == 1                          # one candidate: no halving


# --- successive halving -----------------------------------------------------------------------------

def test_halving_keeps_the_fastest_and_always_the_baseline():
    speed = {None: 100.0, **{(s, 1, s + 1): 50.0 + 20 * s for s in range(1, 9)}}   # (8, 1, 9) is fastest
    calls = []

    def evaluate(tree, part, r):
        calls.append((tree, len(part), r))
        return fake_pass(speed[tree], part)

    trees = [t for t in speed if t is not None]
    plan = Plan.make(len(trees), len(PROMPTS), 1)
    result = successive_halving(trees, PROMPTS, plan, evaluate, deadline=float("inf"))
    assert result.best == (8, 1, 9) and not result.out_of_time
    assert len(calls) == plan.evaluations(len(trees))
    assert sorted({r for t, _, r in calls if t is None}) == [0, 1, 2]        # the baseline runs every round
    assert result.finalists == [None, (8, 1, 9), (7, 1, 8)]
    assert result.dropped == {(1, 1, 2): 0, (2, 1, 3): 0, (3, 1, 4): 0, (4, 1, 5): 0, (5, 1, 6): 1, (6, 1, 7): 1}
    # One merged record per round; every candidate of a round runs the same prompts, rounds never repeat them.
    assert [len(p.turns) for p in result.records[(8, 1, 9)]] == [2, 4, 8]
    assert len({t.conversation for p in result.records[(8, 1, 9)] for t in p.turns}) == 2 + 4 + 8
    assert [t.conversation for t in result.records[None][1].turns] == [t.conversation for t in
                                                                       result.records[(5, 1, 6)][1].turns]


def test_halving_picks_the_baseline_when_speculation_loses():
    result = successive_halving([(1, 1, 2), (2, 1, 3)], PROMPTS, Plan.make(2, 16, 1),
                                lambda tree, part, r: fake_pass(100.0 if tree is None else 80.0, part), float("inf"))
    assert result.best is None


def test_time_budget_stops_between_chunks():
    now = [0]
    speed = {None: 100.0, (1, 1, 2): 90.0, (2, 1, 3): 150.0, (3, 1, 4): 140.0, (4, 1, 5): 10.0}

    def evaluate(tree, part, r):
        now[0] += 1
        return fake_pass(speed[tree], part)

    trees = [t for t in speed if t is not None]
    # Round 0: 2 chunks x 5 candidates (clock 10); round 1 (4 prompts in 4 chunks, 3 candidates): the clock
    # reaches the deadline after two chunks.
    result = successive_halving(trees, PROMPTS, Plan(3, 2, 2.0), evaluate, deadline=16, clock=lambda: now[0])
    assert result.out_of_time and now[0] == 16
    assert result.finalists == [None, (2, 1, 3), (3, 1, 4)] and result.best == (2, 1, 3)
    # The finalists ran the same part of round 1, and are ranked on it with round 0.
    for cand in result.finalists:
        assert [len(p.turns) for p in result.records[cand]] == [2, 2]
    rows = {r["label"]: r for r in describe(result)}
    assert rows["2x1x3"]["status"] == "best" and rows["2x1x3"]["prompts"] == 4
    assert rows["1x1x2"]["status"] == "cut (round 1)" and rows["1x1x2"]["prompts"] == 2
    assert rows["2x1x3"]["speedup"] == pytest.approx(1.5)


def test_interleaving_cancels_a_drifting_machine():
    calls = [0]

    def evaluate(tree, part, r):
        calls[0] += 1          # the machine gets faster all along: whoever ran last would look best
        return fake_pass(100.0 * (1 + 0.05 * calls[0]), part)

    trees = [(1, 1, 2), (2, 1, 3), (3, 1, 4)]
    result = successive_halving(trees, PROMPTS, Plan(1, 8, 2.0), evaluate, deadline=float("inf"))
    for row in describe(result):
        assert row["speedup"] == pytest.approx(1.0, abs=0.03), row


# --- the saved config -------------------------------------------------------------------------------

def test_serve_config_round_trips_and_drops_speculation_for_the_baseline(tmp_path):
    user = ServerArgs(model_path="m", speculative_algorithm="NGRAM", dtype="float32", api_key="secret")
    config = serve_config(user, (3, 2, 4), 8)
    assert "api-key" not in config
    args = ServerArgs.from_dict(config)
    assert args.speculative_tree == (3, 2, 4) and args.max_running_requests == args.cuda_graph_max_bs == 8
    assert serve_command(config).startswith("spec serve --model-path m --dtype float32 ")
    plain = ServerArgs.from_dict(serve_config(user, None, 1))
    assert plain.speculative_algorithm is None and plain.dtype == "float32"


# --- one engine, configurations in turn -----------------------------------------------------------

def test_configurations_run_alike_in_any_order(tmp_path):
    """spec tune switches one engine from configuration to configuration: with the step cost pinned,
    what each produces (tokens, verifications, drafts accepted, steps) does not depend on which ran
    before it."""
    model = make_model(tmp_path / "model", "llama", max_pos=2048)
    prompts = [Conversation(str(i), "c", (text,), i) for i, text in enumerate(
        ("one two one two one two", "def add(a, b): return a + b", "the cat the cat the", "abc abc abc abc"))]
    trees = [(1, 1, 2), None, (3, 1, 4), (3, 2, 5)]

    def run(order):
        eng = Engine(model_path=str(model), dtype="float32", max_total_tokens=4096, speculative_algorithm="NGRAM",
                     planner=untimed)
        base, results = eng.args, {}
        for tree in order:
            args = plain_args(base) if tree is None else tree_args(base, tree)
            passed = OfflineBackend(eng, label(tree), args, concurrency=2, max_new_tokens=16,
                                    temperature=0).run(prompts, lambda *_: None)
            results[tree] = ([(t.output, t.verify_ct, t.accepted) for t in passed.turns], passed.decode_steps)
        return results

    assert run(trees) == run(trees[::-1])


# --- end to end -------------------------------------------------------------------------------------

def test_tune_end_to_end(tmp_path, served):
    model = make_model(tmp_path / "model", "llama", max_pos=2048)
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"turns": [t], "category": "c"}) + "\n" for t in (
        "The quick brown fox", "def add(a, b):", "one two three four", "Speculative decoding drafts", "five six")))
    saved, out = tmp_path / "tuned.yaml", tmp_path / "tune.json"
    result = CliRunner().invoke(app, [
        "tune", "--model", str(model), "--dtype", "float32", "--max-total-tokens", "4096", "--algo", "NGRAM",
        "--search-steps", "1,2,3", "--search-topk", "1,2", "--search-draft-tokens", "3,4", "--batch-sizes", "1,2",
        "--dataset-path", str(questions), "--max-new-tokens", "12", "--save", str(saved), "--output", str(out),
    ], prog_name="spec", env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [s["tree"] for s in data["skipped"]] == [[1, 2, 4]]
    assert not data["out_of_time"]
    assert data["prompt_runs"] < data["full_grid_prompt_runs"]
    for bs in ("1", "2"):
        entry = data["batch_sizes"][bs]
        rows = entry["results"]
        assert len(rows) == 9 and sum(r["label"] == "baseline" for r in rows) == 1
        finalists = [r for r in rows if r["rounds"] == entry["rounds"]]
        best = max(finalists, key=lambda r: r["output_tokens_per_s"])
        assert entry["best"] == best and best["status"] == "best"
        for r in rows:
            assert r["output_tokens_per_s"] > 0 and r["prompts"] > 0
            assert (r["accept_length"] is None) == (r["label"] == "baseline")
            assert r["label"] == "baseline" or r["accept_length"] >= 1
        assert entry["command"].startswith("spec serve --model-path ")
        assert f"--max-running-requests {bs}" in entry["command"]
    assert "best at batch size 1" in result.output
    # The saved file is the batch size 2 config, and `spec serve --config` takes it as is.
    assert CliRunner().invoke(app, ["serve", "--config", str(saved)]).exit_code == 0
    [args] = served
    best = data["batch_sizes"]["2"]["best"]
    assert args.speculative_tree == (tuple(best["tree"]) if best["tree"] else None)
    assert args.max_running_requests == 2 and args.model_path == str(model)
