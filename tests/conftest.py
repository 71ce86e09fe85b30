"""Test-wide settings and fixtures."""

import os
import sys
import types

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (numpy); it must be chosen before the first
# `import triton` (importing torch does not import it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny import make_model


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Tiny models spend their time in thread hand-offs, not math: one thread is ~5x faster on 2 busy cores.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def served(monkeypatch):
    """Stand in for engine.server: record the ServerArgs `spec serve` would serve, start nothing."""
    calls = []
    module = types.ModuleType("engine.server")
    module.run_server = calls.append
    monkeypatch.setitem(sys.modules, "engine.server", module)
    return calls


@pytest.fixture(scope="session")
def target(tmp_path_factory):
    """A tiny random Llama target, read-only. Four layers: EAGLE-3's default aux states (2, L//2, L-3)
    need at least three."""
    return make_model(tmp_path_factory.mktemp("target"), "llama", layers=4)
