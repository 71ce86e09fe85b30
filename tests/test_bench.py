"""`spec bench`: datasets, offline and online runs on a tiny model, the baseline comparison, user errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spec_tools.bench import BenchError
from spec_tools.bench.datasets import datasets_dirs, interleave_categories, load_conversations
from spec_tools.bench.measure import SpecCounts, TurnResult
from spec_tools.bench.summary import decode_speed
from spec_cli.main import app
from tests.serving import free_port, serve, server_args
from tests.tiny import make_model

ROWS = [
    {"question_id": 1, "category": "writing", "turns": ["The quick brown fox", "Now say it again, shorter."]},
    {"question_id": 2, "category": "coding", "turns": ["def add(a, b):"]},
    {"question_id": 3, "category": "writing", "turns": ["Speculative decoding drafts tokens"]},
    {"question_id": 4, "category": "math", "turns": ["one two three four five six"]},
]
NUM_TURNS = sum(len(r["turns"]) for r in ROWS)
TREE = ["--algo", "NGRAM", "--steps", "3", "--topk", "1", "--draft-tokens", "4"]
FIELDS = ("output_tokens_per_s", "accept_length", "num_requests", "completion_tokens", "duration_s")
SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("bench-model"), "llama", max_pos=2048)


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-data") / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def engine_flags(model_dir) -> list[str]:
    return ["--model", str(model_dir), "--dtype", "float32", "--max-total-tokens", "4096"]


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), prog_name="spec", env={"COLUMNS": "200", **(env or {})})


def assert_user_error(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def assert_sane(result: dict, num_requests: int, max_new_tokens: int) -> None:
    for key in FIELDS:
        assert key in result, key
    assert result["num_requests"] == num_requests
    assert result["num_conversations"] == len(ROWS)
    assert 0 < result["completion_tokens"] <= num_requests * max_new_tokens
    assert result["output_tokens_per_s"] > 0 and result["duration_s"] > 0
    assert result["output_tokens_per_s"] == pytest.approx(result["completion_tokens"] / result["duration_s"])
    assert set(result["categories"]) == {"writing", "coding", "math"}
    assert sum(c["num_requests"] for c in result["categories"].values()) == num_requests
    assert result["e2e_latency_s"]["p50"] > 0 and result["ttft_s"]["mean"] > 0


# --- datasets ---------------------------------------------------------------------------------------

def test_question_jsonl_round_robins_categories(questions):
    convs = load_conversations(path=str(questions))
    assert [c.category for c in convs] == ["writing", "coding", "math", "writing"]
    assert [c.index for c in convs] == [0, 1, 2, 3]
    assert convs[0].turns == tuple(ROWS[0]["turns"])
    assert [c.id for c in load_conversations(path=str(questions), num_prompts=2)] == ["1", "2"]


def test_other_formats(tmp_path):
    humaneval = tmp_path / "HumanEval.jsonl"
    humaneval.write_text(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"}) + "\n")
    [conv] = load_conversations(path=str(humaneval))
    assert (conv.id, conv.category, conv.turns) == ("HumanEval/0", "HumanEval", ("def f():\n",))
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "opened by the model: skipped"}]},
    ]))
    [conv] = load_conversations(path=str(sharegpt))
    assert (conv.id, conv.turns) == ("a", ("hi",))
    rand = load_conversations("random", num_prompts=3, input_len=7, output_len=5)
    assert len(rand) == 3 and all(len(c.turns[0].split()) == 7 and c.max_new_tokens == 5 for c in rand)
    assert rand == load_conversations("random", num_prompts=3, input_len=7, output_len=5)  # seeded


def test_interleave_categories_takes_each_in_turn():
    from spec_tools.bench.datasets import Conversation

    rows = [Conversation(str(i), cat, ("x",), i) for i, cat in enumerate("aaabbc")]
    assert [c.category for c in interleave_categories(rows, None)] == list("abcaba")


@pytest.mark.skipif(not (SHARED / "mt_bench" / "question.jsonl").is_file(), reason="no shared datasets")
def test_named_datasets_come_from_shared(monkeypatch):
    monkeypatch.delenv("SPEC_DATASETS_DIR", raising=False)
    assert datasets_dirs()[0] == SHARED
    mt = load_conversations("mt-bench", num_prompts=8)
    assert len({c.category for c in mt}) == 8 and all(len(c.turns) == 2 for c in mt)
    gsm = load_conversations("gsm8k", num_prompts=3)
    assert len(gsm) == 3 and all(c.category == "math" for c in gsm)


def test_missing_dataset_says_what_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_DATASETS_DIR", str(tmp_path))
    with pytest.raises(BenchError) as err:
        load_conversations("mt-bench")
    message = str(err.value)
    assert str(tmp_path / "mt_bench" / "question.jsonl") in message and "curl" in message
    assert "FastChat" in message
    assert_user_error(run("bench", "--dataset", "humaneval", env={"SPEC_DATASETS_DIR": str(tmp_path)}),
                      "humaneval/question.jsonl", "gunzip")


def test_malformed_jsonl_line_is_a_clear_error(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{\"turns\": [\"a\"]\n")
    assert_user_error(run("bench", "--dataset-path", str(bad)), "line 2", "not valid JSON")
    bad.write_text(json.dumps({"question_id": 1, "turns": []}) + "\n")
    assert_user_error(run("bench", "--dataset-path", str(bad)), "line 1", "turns")


def test_spec_counts_histogram_and_difference():
    counts = SpecCounts(10, 22, (6, 4, 2)) - SpecCounts(0, 0, (0, 0, 0))
    assert counts.accept_length == 2.2 == 1 + sum(counts.by_position)
    assert counts.histogram == {1: 4, 2: 2, 3: 2, 4: 2}
    info = {"spec_verify_ct": 10, "avg_spec_accept_length": 2.2, "spec_accept_by_position": [0.6, 0.4, 0.2]}
    assert SpecCounts.from_server_info(info).histogram == counts.histogram


# --- offline ----------------------------------------------------------------------------------------

def test_offline_compare_baseline(model_dir, questions, tmp_path):
    out, plot = tmp_path / "run.json", tmp_path / "run.png"
    pytest.importorskip("matplotlib")
    result = run("bench", *engine_flags(model_dir), *TREE, "--dataset-path", str(questions), "--max-new-tokens", "16",
                 "--compare-baseline", "--output", str(out), "--plot", str(plot))
    assert result.exit_code == 0, result.output
    assert "speedup over plain decoding" in result.output
    data = json.loads(out.read_text())
    assert_sane(data, NUM_TURNS, 16)
    assert_sane(data["baseline"], NUM_TURNS, 16)
    assert data["mode"] == "offline" and data["label"] == "spec"
    assert data["accept_length"] >= 1 and data["baseline"]["accept_length"] is None
    assert len(data["accept_rate_by_position"]) == 3
    assert data["accept_length"] == pytest.approx(1 + sum(data["accept_rate_by_position"]))
    assert sum(data["accept_length_histogram"].values()) == data["spec_verify_ct"]
    assert data["speedup"] == pytest.approx(data["output_tokens_per_s"] / data["baseline"]["output_tokens_per_s"])
    # Greedy in fp32: speculative decoding is lossless, so every output equals the baseline's.
    assert data["differing_outputs"] == 0 and data["differing_outputs_share"] == 0
    assert data["completion_tokens"] == data["baseline"]["completion_tokens"]
    assert data["config"]["server_args"]["speculative_num_draft_tokens"] == 4
    assert data["config"]["bench"]["compare_baseline"] is True
    assert plot.stat().st_size > 1000


def test_second_turn_follows_the_models_own_answer(model_dir, questions):
    from spec_tools.bench.offline import OfflineBackend
    from engine.engine import Engine

    engine = Engine(model_path=str(model_dir), dtype="float32", max_total_tokens=4096)
    backend = OfflineBackend(engine, "plain", engine.args, concurrency=2, max_new_tokens=8,
                             temperature=0.0)
    [conv] = load_conversations(path=str(questions), num_prompts=1)
    turns = backend.run([dataclasses.replace(conv, max_new_tokens=8)], lambda *_: None).turns  # 8 tokens each
    assert [(t.turn, t.completion_tokens) for t in turns] == [(0, 8), (1, 8)]
    first, second = turns
    answer = engine.tokenizer.decode(first.output, skip_special_tokens=True)
    assert answer.strip()
    expected = backend.chat.encode([{"role": "user", "content": ROWS[0]["turns"][0]},
                                    {"role": "assistant", "content": answer},
                                    {"role": "user", "content": ROWS[0]["turns"][1]}])
    assert second.prompt_tokens == len(expected)


def test_compare_baseline_needs_speculation(model_dir, questions):
    assert_user_error(run("bench", *engine_flags(model_dir), "--dataset-path", str(questions), "--compare-baseline"),
                      "--speculative-algorithm")


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, questions):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert_user_error(run("bench", "--dataset-path", str(questions), "--plot", "x.png"), "pip install matplotlib")


# --- online -----------------------------------------------------------------------------------------

def spec_server(model_dir):
    """A real `spec serve` (NGRAM) on a free local port, in a thread."""
    return serve(server_args(model_dir, speculative_algorithm="NGRAM", speculative_num_steps=3,
                             speculative_eagle_topk=1, speculative_num_draft_tokens=4, log_level="warning"))


def test_online_against_spec_serve(model_dir, questions, tmp_path):
    out = tmp_path / "online.json"
    with spec_server(model_dir) as live:
        url = live.url
        # The same server as its own baseline: exercises the interleaved online path; greedy outputs agree.
        result = run("bench", "--url", url + "/v1", "--baseline-url", url, "--dataset-path", str(questions),
                     "--max-new-tokens", "12", "--max-concurrency", "2", "--output", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert_sane(data, NUM_TURNS, 12)
    assert data["mode"] == "online" and data["config"]["url"] == url
    assert data["config"]["server_info"]["speculative_algorithm"] == "NGRAM"
    assert data["accept_length"] >= 1 and len(data["accept_rate_by_position"]) == 3
    assert data["itl_s"]["p99"] >= data["itl_s"]["p50"] > 0
    assert data["speedup"] > 0 and data["differing_outputs"] == 0


def test_unreachable_url_is_one_line():
    port = free_port()              # nothing listens on it
    line = assert_user_error(run("bench", "--url", f"http://127.0.0.1:{port}", "--dataset", "random", "-n", "2"),
                             f"127.0.0.1:{port}", "spec serve")
    assert "Traceback" not in line
    assert_user_error(run("bench", "--url", "localhost:1", "--dataset", "random"), "http://")
    assert_user_error(run("bench", "--url", f"http://127.0.0.1:{port}", "--compare-baseline", "--dataset", "random"),
                      "--baseline-url")


# --- Predicted Outputs --------------------------------------------------------------------------------
def test_code_edit_prompts_carry_the_function_as_prediction():
    convs = load_conversations("code-edit", num_prompts=4)
    assert len(convs) == 4 and all(c.category == "code-edit" for c in convs)
    for c in convs:
        code = c.prediction.removeprefix("```python\n").removesuffix("\n```")
        assert 30 <= len(code.splitlines()) <= 150 and code in c.turns[0]
    assert [c.turns for c in load_conversations("code-edit", num_prompts=4)] == [c.turns for c in convs]


def test_use_prediction_runs_with_and_without_predictions(model_dir, tmp_path):
    """--use-prediction: the same requests with their predictions and without, interleaved; greedy outputs
    agree, and the prediction tokens verified are reported."""
    from engine.engine import Engine

    engine = Engine(model_path=str(model_dir), dtype="float32", max_total_tokens=4096)
    rows = []
    for i, row in enumerate(ROWS):
        answer = engine.generate(prompt=row["turns"][0], sampling_params={"max_new_tokens": 16, "temperature": 0})
        rows.append({**row, "turns": row["turns"][:1], "prediction": answer["text"] if i % 2 else "unrelated"})
    path, out = tmp_path / "predicted.jsonl", tmp_path / "run.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run("bench", *engine_flags(model_dir), "--dataset-path", str(path), "--max-new-tokens", "16",
                 "--use-prediction", "--output", str(out))
    assert result.exit_code == 0, result.output
    assert "without predictions" in result.output
    data = json.loads(out.read_text())
    assert data["label"] == "prediction" and data["baseline"]["prediction_tokens"] is None
    assert data["prediction_tokens"]["requests"] == len(ROWS) and data["differing_outputs"] == 0
    assert_user_error(run("bench", *engine_flags(model_dir), "--dataset-path", str(tmp_path / "predicted.jsonl"),
                          "--use-prediction", "--compare-baseline"), "--use-prediction")


def test_decode_speed_leaves_the_first_token_out():
    """Tokens after the first over the time after the first, summed over requests: prefill left out."""
    def turn(tokens, ttft, e2e):
        return TurnResult("c", "x", 0, 10, tokens, ttft, e2e, [], None)

    assert decode_speed([turn(11, 5.0, 6.0), turn(31, 1.0, 2.0)]) == pytest.approx(40 / 2.0)
    assert decode_speed([turn(1, 1.0, 1.0)]) is None             # one token: no decode phase
