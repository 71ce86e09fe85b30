"""Kernel tests skip only where this machine has no C compiler; where it has one, a kernel that does not
build fails them (CI must not pass on fallbacks by accident)."""

from __future__ import annotations

import pytest

from spec_kernels.native import toolchain


def _no_compiler() -> bool:
    try:
        toolchain()
        return False
    except RuntimeError:
        return True


NO_COMPILER = _no_compiler()
needs_compiler = pytest.mark.skipif(NO_COMPILER, reason="no C compiler on this machine")


def require(kernel) -> None:
    """Skips where there is no compiler; fails where there is one and `kernel` did not build."""
    if NO_COMPILER:
        pytest.skip("no C compiler on this machine")
    if kernel.library() is None:
        pytest.fail(f"a C compiler is here but the kernel did not build: {kernel.failure()}")
