"""The `spec` command line: help, version, generated flags, user errors, --config, fetch --list,
shell completions and packaging. Fast: no model loads (engine.server is replaced by a stub)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from engine.config import ServerArgs
from spec_cli.args import build_server_args, flag_name
from spec_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
WIDE = {"COLUMNS": "200"}  # rich help is 80 columns by default off a terminal; flag names must not be cut
SERVE_FLAGS = ["--speculative-algorithm", "--algo", "--speculative-num-steps", "--cuda-graph-max-bs",
               "--mem-fraction-static", "--speculative-draft-model-path", "--draft", "--disable-radix-cache",
               "--model-path", "--model", "--config"]
REGENERATE = "for sh in bash zsh fish; do _SPEC_COMPLETE=source_$sh spec > completions/spec.$sh; done"


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), prog_name="spec", env={**WIDE, **(env or {})})


def assert_user_error(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


# --- help and version -----------------------------------------------------------------------------

def test_help_lists_commands():
    result = run("--help")
    assert result.exit_code == 0, result.output
    for command in ("serve", "bench", "tune", "convert", "fetch"):
        assert command in result.output
    assert "OpenAI-compatible" in result.output


def test_version():
    result = run("--version")
    assert result.exit_code == 0
    assert result.output.strip() == f"spec {importlib.metadata.version('spec')}"


def test_serve_help_shows_sglang_flags_in_panels():
    result = run("serve", "--help")
    assert result.exit_code == 0, result.output
    for flag in SERVE_FLAGS:
        assert flag in result.output, flag
    for panel in ("Model", "Memory and scheduling", "Speculative decoding", "Compilation", "Server"):
        assert panel in result.output
    assert "spec serve --model smollm2-135m --algo NGRAM" in result.output
    assert "…" not in result.output


@pytest.mark.parametrize("args", [["bench"], ["tune"], ["convert", "token-map"], ["convert", "draft"],
                                  ["convert"]])
def test_other_commands_have_help(args):
    result = run(*args, "--help")
    assert result.exit_code == 0, result.output
    assert len(result.output.strip()) > 100


@pytest.mark.parametrize("command", ["serve", "bench", "tune"])
def test_help_at_80_columns_cuts_no_flag_name(command):
    """Every spelling of every flag appears whole in 80-column help; switches show no value."""
    result = run(command, "--help", env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    for param in get_command(app).commands[command].params:
        for name in (*param.opts, *param.secondary_opts):
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", result.output), name
    assert "…" not in result.output and "<bool>" not in result.output
    wide = [line for line in result.output.splitlines() if len(line) > 80]
    assert all(line.lstrip().startswith("spec ") for line in wide), wide      # example command lines alone
    assert "  --disable-radix-cache  " in run("serve", "--help", env={"COLUMNS": "80"}).output


@pytest.mark.parametrize("args", [[], ["convert"]])
def test_a_bare_group_prints_its_help(args):
    result = run(*args, env={"COLUMNS": "80"})
    assert result.output.startswith("Usage: spec") and "error:" not in result.output, result.output
    assert "<bool>" not in result.output and "╭" not in result.output


@pytest.mark.parametrize("args,needle", [
    (["serve", "--bogus"], "--bogus"), (["serve", "--port", "x"], "--port"), (["bench", "--num-prompts", "-3"],
                                                                                "--num-prompts"),
    (["tune", "--bogus"], "--bogus"), (["convert", "draft"], "SOURCE"), (["convert", "token-map", "--bogus"], "--bogus"),
    (["fetch", "nosuch"], "nosuch"), (["nosuchcmd"], "nosuchcmd"), (["serve", "--max-n", "0"], "--max-n")])
def test_every_command_reports_bad_input_as_one_error_line(args, needle):
    """Click's usage errors and spec's own alike: one `error:` line naming what was wrong, status 2."""
    line = assert_user_error(run(*args), needle)
    assert "╭" not in line


# --- flags generated from ServerArgs --------------------------------------------------------------

def test_every_server_args_field_is_a_flag_in_its_panel():
    serve = get_command(app).commands["serve"]
    params = {p.name: p for p in serve.params}
    for f in dataclasses.fields(ServerArgs):
        param = params[f.name]
        assert flag_name(f.name) in param.opts
        assert set(f.metadata["flags"]) <= set(param.opts)
        assert param.rich_help_panel == f.metadata["group"]
        assert param.help
        assert param.default == f.default


def test_flags_reach_server_args(served):
    result = run("serve", "-m", "some/model", "--algo", "ngram", "--steps", "3", "--topk", "2",
                 "--draft-tokens", "5", "--mem-fraction", "0.5", "--cuda-graph-max-bs", "8",
                 "--disable-radix-cache", "--port", "1234")
    assert result.exit_code == 0, result.output
    [args] = served
    assert args.model_path == "some/model"
    assert args.speculative_algorithm == "NGRAM"
    assert args.speculative_tree == (3, 2, 5)
    assert args.mem_fraction_static == 0.5 and isinstance(args.mem_fraction_static, float)
    assert args.cuda_graph_max_bs == 8 and isinstance(args.cuda_graph_max_bs, int)
    assert args.disable_radix_cache is True and args.disable_cuda_graph is False
    assert args.port == 1234


def test_defaults_are_server_args_defaults(served):
    assert run("serve").exit_code == 0
    assert served == [ServerArgs()]


def test_nextn_is_accepted_as_mtp(served):
    assert run("serve", "--speculative-algorithm", "NEXTN").exit_code == 0
    assert served[0].speculative_algorithm == "MTP"


@pytest.mark.parametrize("args, needle", [(["--algo", "FOO"], "FOO"), (["--dtype", "int3"], "int3"),
                                          (["--cuda-graph-max-bs", "many"], "--cuda-graph-max-bs")])
def test_bad_value_exits_2_without_traceback(served, args, needle):
    result = run("serve", *args)
    assert result.exit_code == 2
    assert needle in result.output and "Traceback" not in result.output
    assert not served


def test_bad_combination_is_one_line_before_anything_loads(served):
    line = assert_user_error(run("serve", "--algo", "EAGLE3"), "--speculative-algorithm EAGLE3", "--draft")
    assert "draft model" in line
    assert not served


# --- prefixes of long options, as argparse takes them ------------------------------------------------

@pytest.mark.parametrize("args, field, value", [
    (["--speculative-algo", "NGRAM"], "speculative_algorithm", "NGRAM"),                 # SGLang's guides
    (["--speculative-draft", "d", "--speculative-algo", "EAGLE3"], "speculative_draft_model_path", "d"),
    (["--speculative-draft-model", "d", "--algo", "EAGLE3"], "speculative_draft_model_path", "d"),
    (["--mem-frac", "0.5"], "mem_fraction_static", 0.5),             # two spellings of one option: not ambiguous
    (["--max-run=7"], "max_running_requests", 7),
    (["--disable-radix"], "disable_radix_cache", True),
    (["--api-key", "--speculative-n"], "api_key", "--speculative-n"),      # a value is never expanded
    (["--model", "m"], "model_path", "m"),                          # an exact name wins over longer ones
])
def test_unambiguous_prefixes_are_accepted(served, args, field, value):
    result = run("serve", *args)
    assert result.exit_code == 0, result.output
    assert getattr(served[0], field) == value


def test_ambiguous_prefix_lists_the_candidates(served):
    line = assert_user_error(run("serve", "--speculative-num", "3"), "--speculative-num is ambiguous",
                             "--speculative-num-steps", "--speculative-num-draft-tokens")
    assert "--speculative-ngram" not in line
    assert not served


def test_prefixes_reach_groups_and_subcommands():
    assert run("--vers").output.strip().startswith("spec ")
    result = run("convert", "token-map", "--he")
    assert result.exit_code == 0 and "--size" in result.output


# --- --config -------------------------------------------------------------------------------------

def test_config_values_and_explicit_overrides(tmp_path):
    config = tmp_path / "tuned.yaml"
    config.write_text("algo: NGRAM\nport: 1234\nmax-running-requests: 8\nspeculative_num_steps: 3\n"
                      "speculative_eagle_topk: 1\nspeculative_num_draft_tokens: 4\n")
    values = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    values.update(max_running_requests=4, port=30000)  # port is at its default: not typed, not applied
    args = build_server_args(values, explicit=["max_running_requests"], config=config)
    assert args.speculative_algorithm == "NGRAM" and args.speculative_tree == (3, 1, 4)
    assert args.port == 1234
    assert args.max_running_requests == 4
    # Without a file, only the typed values count and the rest keep ServerArgs' defaults.
    assert build_server_args({"port": 9, "host": "0.0.0.0"}, explicit=["port"]) == ServerArgs(port=9)


def test_config_through_the_command_line(tmp_path, served):
    config = tmp_path / "tuned.json"
    config.write_text(json.dumps({"speculative-algorithm": "NGRAM", "port": 1234, "host": "0.0.0.0"}))
    result = run("serve", "--config", str(config), "--port", "4321", "--host", "127.0.0.1")
    assert result.exit_code == 0, result.output
    [args] = served
    assert (args.speculative_algorithm, args.port) == ("NGRAM", 4321)
    assert args.host == "127.0.0.1"  # typed, though equal to the default: it still wins over the file


def test_bad_config_file_is_a_user_error(tmp_path, served):
    assert_user_error(run("serve", "--config", str(tmp_path / "missing.yaml")), "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_option: 1\n")
    assert_user_error(run("serve", "--config", str(bad)), "no_such_option")
    assert not served


# --- fetch ----------------------------------------------------------------------------------------

def test_fetch_list():
    result = run("fetch", "--list")
    assert result.exit_code == 0, result.output
    assert "smollm2-135m" in result.output.split()


def test_fetch_needs_a_name():
    assert_user_error(run("fetch"), "--list")


def test_fetch_unknown_name_is_a_user_error():
    assert_user_error(run("fetch", "no-such-model"), "no-such-model", "smollm2-135m")


# --- completions ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_files_match_the_cli(shell):
    result = CliRunner().invoke(app, [], prog_name="spec", env={"_SPEC_COMPLETE": f"source_{shell}"})
    assert result.exit_code == 0 and result.stdout.strip(), result.output
    path = ROOT / "completions" / f"spec.{shell}"
    assert path.is_file() and path.read_text() == result.stdout, (
        f"completions/spec.{shell} is out of date; regenerate from the repository root with: {REGENERATE}")


# --- installed package ----------------------------------------------------------------------------

def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COLUMNS", "TERMINAL_WIDTH")}
    return env


def test_installed_spec_works_outside_the_repo(tmp_path):
    script = shutil.which("spec", path=str(Path(sys.executable).parent)) or shutil.which("spec")
    if script is None:
        pytest.skip("the spec console script is not installed (pip install -e .)")
    result = subprocess.run([script, "serve", "--help"], cwd=tmp_path, env=_clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for flag in SERVE_FLAGS:  # piped help is laid out wide enough for every flag name
        assert flag in result.stdout, flag
    assert "…" not in result.stdout


def test_kernels_folder_is_not_the_hf_kernels_library(tmp_path):
    try:
        importlib.metadata.distribution("spec")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("spec is not installed (pip install -e .)")
    check = ("import importlib.util, spec_kernels\n"
             "from transformers.utils.import_utils import is_kernels_available\n"
             "assert importlib.util.find_spec('kernels') is None, importlib.util.find_spec('kernels')\n"
             "assert not is_kernels_available()\n")
    result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=_clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_cpu_requirements_cover_the_base_install():
    """requirements-cpu.txt (the README's install without Triton) pins every package a base install of spec
    needs, as this environment resolved them, but triton; and the torch of constraints-cpu.txt."""
    from packaging.requirements import Requirement

    def name(text: str) -> str:
        return re.sub(r"[-_.]+", "-", text).lower()

    pinned = dict(line.split("==") for line in (ROOT / "requirements-cpu.txt").read_text().splitlines()
                  if line and not line.startswith("#"))
    pinned = {name(k): v for k, v in pinned.items()}
    needed, todo = set(), ["spec"]
    while todo:
        for text in importlib.metadata.requires(todo.pop()) or []:
            req = Requirement(text)
            if (req.marker is None or req.marker.evaluate({"extra": ""})) and name(req.name) not in needed:
                needed.add(name(req.name))
                todo.append(req.name)
    assert "triton" in needed and "triton" not in pinned        # what the file is for
    missing = needed - {"triton"} - set(pinned)
    assert not missing, f"add {sorted(missing)} to requirements-cpu.txt (pinned, as `pip freeze` gives them)"
    constraint = (ROOT / "constraints-cpu.txt").read_text().split("torch==")[1].split()[0]
    assert pinned["torch"] == constraint


def test_pyproject_lists_every_package():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    renamed = {folder: name for name, folder in config.get("package-dir", {}).items() if name}
    found = set()
    for top in ("engine", "spec_cli", "kernels"):
        for init in (ROOT / top).rglob("__init__.py"):
            parts = list(init.parent.relative_to(ROOT).parts)
            parts[0] = renamed.get(parts[0], parts[0])
            found.add(".".join(parts))
    assert found <= listed, (f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml "
                             "(a non-editable install would leave them out)")
