"""benchmarks/gpu_check.sh --cpu-dry-run: the GPU check's every step at tiny shapes on the CPU, so the
script a lent GPU will run has run here first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402  (a script beside its stages, not a package)
from gpu_check import REPORT_KEYS, STAGE_TIMEOUTS_S  # noqa: E402


@pytest.mark.slow          # a minute or two: run it (-m slow) before spending device time
def test_cpu_dry_run_writes_its_report(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    results = tmp_path / "results"
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-dry-run", "--out", str(tmp_path),
                          "--results-dir", str(results)], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["mode"] == "cpu-dry-run"
    assert report["tests"]["rc"] == 0 and report["tests"]["failed"] == report["tests"]["errors"] == 0
    assert report["tests"]["skipped"] > 0, "the GPU tests were collected (and skipped without CUDA)"
    assert set(report["stages"]) == set(STAGE_TIMEOUTS_S)
    assert not [name for name, stage in report["stages"].items() if "error" in stage]
    assert all((tmp_path / f"stage-{name}.json").is_file() for name in STAGE_TIMEOUTS_S)
    assert set(REPORT_KEYS) <= set(report)
    # Measured on the CPU at tiny shapes where the stage runs there; null where it cannot measure.
    for key in ("hbm_copy_gb_s", "default_b1_tok_s", "best_b1_tok_s", "b16_tok_s", "eagle3_chain_step_ratio",
                "eagle3_tree_step_ratio", "controlled_all_accepted_speedup"):
        assert report[key] > 0, key
    assert report["floor_b1_tok_s"] is None, "no nominal bandwidth for a CPU"
    assert report["fp8_b1_tok_s"] is None and report["stages"]["fp8"]["note"].startswith("not available")
    assert report["http_ok"] is True, report["stages"]["http"]
    assert report["card"] == report["device"] and report["commit"]
    saved = list(results.glob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["http_ok"] is True
    assert "| eagle3_chain_step_ratio |" in (tmp_path / "report.md").read_text()
    assert "GPU check (cpu-dry-run)" in run.stdout


def test_a_stage_that_fails_records_its_error_and_the_rest_run(tmp_path):
    """A stage's error is its result (stage-NAME.json) and the report's keys it feeds stay null."""
    report = {"device": "NVIDIA H200", "stages": {"plain": {"error": "boom", "rows": []},
                                                  "hbm": {"copy_gb_s": 4000.0}}}
    keys = gpu_check.report_keys(report)
    assert keys["hbm_copy_gb_s"] == 4000.0 and keys["default_b1_tok_s"] is None and keys["floor_b1_tok_s"] is None
    assert set(keys) == set(REPORT_KEYS)
    report["stages"]["plain"] = {"weight_bytes": 16e9, "rows": [
        {"variant": "default", "batch": 1, "decode_tok_s": 200.0}, {"variant": "torch eager", "batch": 1, "decode_tok_s": 20.0},
        {"variant": "default", "batch": 16, "decode_tok_s": 3000.0}]}
    keys = gpu_check.report_keys(report)
    assert (keys["floor_b1_tok_s"], keys["default_b1_tok_s"], keys["best_b1_tok_s"], keys["b16_tok_s"]) == (300.0, 200.0, 200.0, 3000.0)
    assert gpu_check.results_name(report).endswith("-nvidia-h200.json")
