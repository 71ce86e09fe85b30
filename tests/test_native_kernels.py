"""Building the C kernels (kernels/native.py): where a compiler is, every kernel builds (CI fails
otherwise) and the start-up line names each; without one, every kernel falls back, the line says so
and why, and speculative output is still plain decoding's on the fallbacks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spec_kernels import cpu_argmax, native
from tests.compiler import needs_compiler

ROOT = Path(__file__).resolve().parents[1]


@needs_compiler
def test_every_kernel_builds_where_a_compiler_is():
    line = native.build_all()
    assert "falling back" not in line, line
    assert all(name in line for name in native.KERNELS.values()), line
    assert native.toolchain().describe() in line


@pytest.fixture
def fresh_toolchain():
    """The toolchain is probed once per process: probe again here, and again for later tests."""
    native._toolchain.cache_clear()
    yield
    native._toolchain.cache_clear()


@needs_compiler
def test_without_openmp_kernels_build_for_one_thread(monkeypatch, tmp_path, fresh_toolchain):
    real = native._compiles
    monkeypatch.setattr(native, "_compiles", lambda command, flags, source: "-fopenmp" not in flags
                        and real(command, flags, source))
    monkeypatch.setenv("SPEC_KERNEL_CACHE", str(tmp_path))
    assert "-fopenmp" not in native.toolchain().flags and "no OpenMP" in native.toolchain().describe()
    kernel = native.Kernel("cpu_argmax.c", cpu_argmax._declare, "unavailable: %s")
    assert kernel.library() is not None, kernel.failure()


@needs_compiler
def test_a_compiler_wrapper_in_cc_builds(monkeypatch, tmp_path, fresh_toolchain):
    """$CC may hold several words (ccache gcc, env ... gcc): it is split, not taken as one path."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    monkeypatch.setenv("CC", f"env SPEC_UNUSED=1 {compiler}")
    monkeypatch.setenv("SPEC_KERNEL_CACHE", str(tmp_path))
    kernel = native.Kernel("cpu_argmax.c", cpu_argmax._declare, "unavailable: %s")
    assert kernel.library() is not None, kernel.failure()
    assert native.toolchain().command[:2] == ["env", "SPEC_UNUSED=1"]
    assert list(tmp_path.glob("cpu_argmax-*.so"))


def test_without_a_compiler_every_kernel_falls_back_loudly_and_output_stays_lossless(tmp_path):
    env = {**os.environ, "CC": "false", "SPEC_KERNEL_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", "from spec_kernels.native import build_all; print(build_all())"],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    line = run.stdout.strip()
    assert run.returncode == 0, run
    assert line == ("CPU kernels built with no compiler: none; falling back (slower) for "
                    f"{', '.join(native.KERNELS.values())}: the C compiler 'false' does not run (`--version` exited 1)")
    assert "unavailable" in run.stderr          # each kernel's own warning names its fallback
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                            "tests/test_speculative_lossless.py", "-k", "test_greedy_identical_batched"],
                           env=env, capture_output=True, text=True, cwd=ROOT)
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert " passed" in tests.stdout and "skipped" not in tests.stdout.splitlines()[-1]
