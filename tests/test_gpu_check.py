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


@pytest.mark.slow          # a minute: run it (-m slow) before spending device time
def test_cpu_dry_run_writes_its_report(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-dry-run", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["mode"] == "cpu-dry-run"
    assert report["tests"]["rc"] == 0 and report["tests"]["failed"] == report["tests"]["errors"] == 0
    assert report["tests"]["skipped"] > 0, "the GPU tests were collected (and skipped without CUDA)"
    bench = report["bench"]
    assert {(r["variant"], r["batch"]) for r in bench["rows"]} == {(v, b) for v in ("eager", "triton+graphs") for b in (1, 2)}
    assert all(r["decode_tok_s"] > 0 and r["verify8_cost"] > 0 for r in bench["rows"])
    assert bench["eagle3"]["ms_per_step"] > 0
    assert "| variant | batch |" in (tmp_path / "report.md").read_text()
    assert "GPU check (cpu-dry-run)" in run.stdout
