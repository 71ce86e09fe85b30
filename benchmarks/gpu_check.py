"""The GPU check, second edition: spec's CUDA path proved and measured in one command, on a GPU machine
lent for a few minutes (within 8.5 minutes: every stage has its own time limit).

On a bare GPU machine (Python 3.12 with torch, triton, transformers; spec not installed, no network), from
the repository root, with the wheels fetched beforehand here (`bash benchmarks/fetch_gpu_wheels.sh`) and
carried there (device tool: carry ["benchmarks/gpu_wheels"]):

    bash benchmarks/gpu_check.sh --out "$OUT" --commit <sha>

1. Installs the carried wheels (benchmarks/gpu_wheels/) into a temporary folder, which goes on PYTHONPATH
   with the repository root and a link spec_kernels -> kernels/ (pyproject.toml's package-dir mapping).
   Skipped where spec's dependencies import already.
2. Runs the GPU tests: pytest -m gpu tests/test_gpu.py, each test function in a process of its own (a
   CUDA error spoils its process), with Triton compiled (TRITON_INTERPRET=0).
3. Runs the stages (benchmarks/gpu_stages.py), each in a process of its own with its own time limit and
   its own stage-NAME.json; a stage that fails or runs out of time records its error and the check goes
   on. On a Llama-3.1-8B-shaped model with random bf16 weights made on the device:
   hbm (copy bandwidth), plain (decode at batch 1 and 16 with the default flags and each alternative),
   profile (20 graphed decode steps: kernels, time by kind, host gaps), speculation (EAGLE-3 at trees
   (3,1,4) and (5,4,8), whole trees, batch 1/4/16, against the plain step; the forward against rows),
   controlled (the model's own output as a Predicted Output: known acceptance), fp8 (--quantization fp8,
   "not available" where refused), http (spec serve on a tiny model: sampling, JSON schema, logprobs).
4. Prints a summary and writes report.md and report.json (the keys in REPORT_KEYS, null where a stage
   could not measure), with the logs, into the output folder; --results-dir also writes report.json as
   <date>-<card>.json there (benchmarks/results/gpu/ in the repository).

--cpu-dry-run runs the same steps on the CPU at tiny shapes (Triton in its interpreter, the GPU tests
skipped, torch.compile skipped), so that the script is exercised by tests/test_gpu_check.py. Its
figures measure nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "benchmarks" / "gpu_wheels"
# spec's dependencies that a bare GPU machine lacks (benchmarks/fetch_gpu_wheels.sh fetches them).
NEEDED = ("fastapi", "uvicorn", "pydantic", "gguf", "xgrammar")
# SGLang, plain decoding, Llama-3.1-8B on one H100, batch 1: a published figure for scale.
SGLANG_PLAIN_TOK_S = 158.0
# Seconds per stage, in the order they run: all together under 8.5 minutes on an H100/H200.
TESTS_TIMEOUT_S = 140
STAGE_TIMEOUTS_S = {"hbm": 15, "plain": 90, "profile": 40, "speculation": 60, "controlled": 45, "fp8": 30, "moe": 20,
                    "http": 55}
REPORT_KEYS = ("card", "commit", "hbm_copy_gb_s", "floor_b1_tok_s", "default_b1_tok_s", "best_b1_tok_s", "b16_tok_s",
               "eagle3_chain_step_ratio", "eagle3_tree_step_ratio", "controlled_all_accepted_speedup",
               "fp8_b1_tok_s", "moe_b8_triton_ms", "moe_b8_torch_ms", "http_ok")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                   help="folder for report.md, report.json and the logs (default: $OUT)")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="tiny shapes on the CPU, Triton in its interpreter: checks the script, measures nothing")
    p.add_argument("--skip-tests", action="store_true", help="stages only")
    p.add_argument("--stages", default=",".join(STAGE_TIMEOUTS_S),
                   help=f"comma-separated stages to run (default: all: {','.join(STAGE_TIMEOUTS_S)}; none: '')")
    p.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD, where git works)")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="also write report.json as <date>-<card>.json here (benchmarks/results/gpu to commit it)")
    p.add_argument("--stage", choices=list(STAGE_TIMEOUTS_S), help=argparse.SUPPRESS)   # a stage's own process
    args = p.parse_args(argv)
    if args.out is None:
        p.error("give --out DIR or set $OUT")
    unknown = [name for name in filter(None, args.stages.split(",")) if name not in STAGE_TIMEOUTS_S]
    if unknown:
        p.error(f"unknown stage(s) {', '.join(unknown)}; the stages are {', '.join(STAGE_TIMEOUTS_S)}")
    return args


# ------------------------------------------------------------------------------------------------ setup
def prepare_site(site: Path, out: Path) -> dict:
    """Fill `site`, a folder for PYTHONPATH: the carried wheels installed in it (unless spec's dependencies
    import already) and spec_kernels linked to kernels/. Returns what was done."""
    (site / "spec_kernels").symlink_to(ROOT / "kernels", target_is_directory=True)
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if not missing:
        return {"installed": [], "note": "dependencies import already; no wheels installed"}
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"error: {', '.join(missing)} do not import and {WHEELS} holds no wheels: run "
                         "bash benchmarks/fetch_gpu_wheels.sh where PyPI is reachable, and carry "
                         "benchmarks/gpu_wheels to this machine.")
    if importlib.util.find_spec("pip") is None:
        raise SystemExit(f"error: {sys.executable} has no pip to install {WHEELS}'s wheels with.")
    say(f"installing {len(wheels)} wheels into {site}")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", str(WHEELS),
           "--target", str(site), "--disable-pip-version-check", *map(str, wheels)]
    with open(out / "install.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"error: installing the wheels failed (exit {rc}); see {out / 'install.log'}")
    return {"installed": [w.name for w in wheels], "target": str(site)}


def say(message: str) -> None:
    """Progress on stdout as it happens: a run cut short shows where it was."""
    print(f"[gpu_check] {message}", flush=True)


def child_env(site: Path, dry: bool) -> dict:
    """The environment of the test and benchmark processes: the site folder and the repository first on
    PYTHONPATH; Triton compiled on a GPU (tests/conftest.py would choose its interpreter), interpreted
    in the dry run."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(ROOT), env.get("PYTHONPATH")]))
    env["TRITON_INTERPRET"] = "1" if dry else "0"
    return env


def run_logged(cmd: list[str], env: dict, log_path: Path, timeout: int) -> tuple[int, float]:
    """Run cmd with its output in log_path (and echoed when it ends); (exit code, seconds). A command
    past `timeout` is killed and reported as exit code 124."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            log.write(f"\n[gpu_check] killed after {timeout} s\n")
            rc = 124
    return rc, time.perf_counter() - start


# ------------------------------------------------------------------------------------------------ tests
def run_tests(env: dict, out: Path) -> dict:
    """Each test function of tests/test_gpu.py in a pytest process of its own: a CUDA error is sticky (an
    illegal memory access spoils the process's context), so one failing test must not fail the rest."""
    names = re.findall(r"^def (test_\w+)\(", (ROOT / "tests" / "test_gpu.py").read_text(), re.M)
    say(f"GPU tests: {len(names)} functions, one process each (at most {TESTS_TIMEOUT_S} s in all), "
        f"log in {out / 'pytest.log'}")
    totals = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    worst, seconds = 0, 0.0
    with open(out / "pytest.log", "w") as log:
        for name in names:
            xml, part = out / f"pytest-{name}.xml", out / f"pytest-{name}.log"
            cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider",
                   f"--junitxml={xml}", f"tests/test_gpu.py::{name}"]
            rc, took = run_logged(cmd, env, part, max(10, int(TESTS_TIMEOUT_S - seconds)))
            log.write(f"===== {name} (exit {rc}, {took:.1f} s)\n{part.read_text()}\n")
            counts = junit_counts(xml)
            xml.unlink(missing_ok=True)
            part.unlink()
            for key in totals:
                totals[key] += counts[key]
            worst, seconds = worst or rc, seconds + took
    return {"rc": worst, "seconds": round(seconds, 1), **totals}


def junit_counts(xml: Path) -> dict:
    """passed / failed / errors / skipped, and the failing tests' ids, from pytest's JUnit XML."""
    if not xml.is_file():
        return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": ["no pytest.xml: see pytest.log"]}
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(kind, "passed")
        counts[key] += 1
        if key in ("failed", "errors"):
            failures.append(f"{case.get('classname')}::{case.get('name')}")
    return {**counts, "failures": failures}


# ------------------------------------------------------------------------------------------------ stages
def run_stages(names: list[str], env: dict, out: Path, dry: bool) -> dict:
    """Each stage in a process of its own (a clean CUDA context, its own time limit); what it measured
    comes back through stage-NAME.json, written after each measurement, so a stage cut short keeps what
    it finished. A stage that fails or times out records its error; the next one runs."""
    stages = {}
    for name in names:
        limit = STAGE_TIMEOUTS_S[name]
        say(f"stage {name} (at most {limit} s), log in {out / f'stage-{name}.log'}")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", name, "--out", str(out)]
        rc, seconds = run_logged(cmd + (["--cpu-dry-run"] if dry else []), env, out / f"stage-{name}.log", limit)
        path = out / f"stage-{name}.json"
        result = json.loads(path.read_text()) if path.is_file() else {}
        if rc == 124:
            result["error"] = f"timed out after {limit} s"
        elif rc != 0 and "error" not in result:
            result["error"] = f"exit status {rc}; see stage-{name}.log"
        stages[name] = {**result, "rc": rc, "seconds": round(seconds, 1)}
        say(f"stage {name}: {'error: ' + result['error'] if 'error' in result else 'ok'} ({seconds:.0f} s)")
    return stages


def bandwidth_bytes_per_s(device_name: str) -> Optional[float]:
    """Nominal HBM bandwidth by device name (NVIDIA's datasheets), None where unknown."""
    if "H200" in device_name:
        return 4.8e12
    if "H100" in device_name and "PCIe" in device_name:
        return 2.0e12
    if "H100" in device_name and ("SXM" in device_name or "HBM3" in device_name):
        return 3.35e12
    return None


# ------------------------------------------------------------------------------------------------ report
def report_keys(report: dict) -> dict:
    """The report's headline keys (REPORT_KEYS), each read from the stage that measures it: None where
    that stage did not run or could not measure, never an estimate."""
    stages = report.get("stages", {})
    plain = stages.get("plain", {})
    rows = plain.get("rows", [])
    small, large = (min(r["batch"] for r in rows), max(r["batch"] for r in rows)) if rows else (None, None)

    def speed(variant: Optional[str], batch: Optional[int]) -> Optional[float]:
        found = [r["decode_tok_s"] for r in rows if r["batch"] == batch and variant in (None, r["variant"])]
        return max(found) if found else None

    bandwidth, weights = bandwidth_bytes_per_s(report["device"]), plain.get("weight_bytes")
    return {"card": report["device"], "commit": report.get("commit"),
            "hbm_copy_gb_s": stages.get("hbm", {}).get("copy_gb_s"),
            "floor_b1_tok_s": round(bandwidth / weights, 1) if bandwidth and weights else None,
            "default_b1_tok_s": speed("default", small), "best_b1_tok_s": speed(None, small),
            "b16_tok_s": speed("default", large),
            "eagle3_chain_step_ratio": step_ratio(stages, "3,1,4"), "eagle3_tree_step_ratio": step_ratio(stages, "5,4,8"),
            "controlled_all_accepted_speedup": stages.get("controlled", {}).get("all_accepted_chain_3", {}).get("speedup"),
            "fp8_b1_tok_s": stages.get("fp8", {}).get("decode_tok_s"),
            "moe_b8_triton_ms": moe_ms(stages, "triton_ms"), "moe_b8_torch_ms": moe_ms(stages, "torch_loop_ms"),
            "http_ok": stages.get("http", {}).get("ok")}


def moe_ms(stages: dict, key: str) -> Optional[float]:
    """A mixture layer's milliseconds for 8 tokens (the moe stage's)."""
    return next((r.get(key) for r in stages.get("moe", {}).get("rows", []) if r["tokens"] == 8), None)


def step_ratio(stages: dict, tree: str) -> Optional[float]:
    """A full drafted step over a plain one at batch 1 (the speculation stage's)."""
    batches = stages.get("speculation", {}).get("trees", {}).get(tree, {}).get("batches", {})
    return batches.get("1", batches.get(1, {})).get("step_ratio")


def summary_lines(report: dict) -> list[str]:
    """The report as a Markdown document: the keys, the tests, each stage's state, the plain table."""
    lines = [f"# GPU check ({report['mode']})", "", f"- device: {report['device']}", f"- torch {report['torch']}, "
             f"triton {report['triton']}, CUDA {report['cuda']}; commit {report.get('commit')}",
             f"- wheels: {install_line(report['install'])}", f"- took {report['elapsed_s']} s", "",
             "| key | value |", "| --- | --- |"]
    lines += [f"| {key} | {report[key]} |" for key in REPORT_KEYS] + [""]
    tests = report.get("tests")
    if tests:
        lines += ["## GPU tests (pytest -m gpu tests/test_gpu.py)", "",
                  f"{tests['passed']} passed, {tests['failed']} failed, {tests['errors']} errors, "
                  f"{tests['skipped']} skipped in {tests['seconds']} s (exit {tests['rc']}; pytest.log)", ""]
        lines += [f"- failed: `{f}`" for f in tests["failures"]] + ([""] if tests["failures"] else [])
    stages = report.get("stages", {})
    if stages:
        lines += ["## Stages (stage-NAME.json, stage-NAME.log)", ""]
        lines += [f"- {name}: {stage.get('error') or stage.get('note') or 'ok'} ({stage['seconds']} s)"
                  for name, stage in stages.items()] + [""]
    rows = stages.get("plain", {}).get("rows", [])
    if rows:
        lines += ["| plain decoding | batch | tok/s | ms/step |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['variant']} | {r['batch']} | {r['decode_tok_s']} | {r['ms_per_step']} |" for r in rows]
        lines += ["", f"SGLang publishes {SGLANG_PLAIN_TOK_S} tok/s for Llama-3.1-8B on one H100 at batch 1 (real "
                      "weights, another card): for scale only.", ""]
    return lines


def install_line(install: dict) -> str:
    if not install["installed"]:
        return install["note"]
    return f"{len(install['installed'])} installed into {install['target']} (install.log)"


def results_name(report: dict) -> str:
    """<date>-<card>.json: the card's name in lower case, runs of other characters as one dash."""
    card = re.sub(r"[^a-z0-9]+", "-", report["device"].lower()).strip("-")
    return f"{time.strftime('%Y-%m-%d')}-{card}.json"


def git_commit() -> Optional[str]:
    try:
        run = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (run.stdout.strip() or None) if run.returncode == 0 else None


def versions() -> dict:
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA)"
    return {"device": device, "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda}


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.stage:
        from gpu_stages import run_stage      # beside this script

        return run_stage(args.stage, out, args.cpu_dry_run)
    start = time.perf_counter()
    report = {"mode": "cpu-dry-run" if args.cpu_dry_run else "gpu", "commit": args.commit or git_commit(), **versions()}
    with tempfile.TemporaryDirectory(prefix="spec-gpu-site-") as site:
        report["install"] = prepare_site(Path(site), out)
        env = child_env(Path(site), args.cpu_dry_run)
        if not args.skip_tests:
            report["tests"] = run_tests(env, out)
        report["stages"] = run_stages(list(filter(None, args.stages.split(","))), env, out, args.cpu_dry_run)
    report["elapsed_s"] = round(time.perf_counter() - start, 1)
    report.update(report_keys(report))
    text = "\n".join(summary_lines(report))
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    if args.results_dir is not None:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        (args.results_dir / results_name(report)).write_text(json.dumps(report, indent=2))
    print(text)
    failed = [name for name, stage in report["stages"].items() if "error" in stage]
    return 0 if report.get("tests", {}).get("rc", 0) == 0 and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
