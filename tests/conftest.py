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

from tests.tiny import make_model, make_tokenizer


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


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny random Llama (two layers, seed 0): the draft-model tests' target."""
    return make_model(tmp_path_factory.mktemp("target"), "llama", seed=0)


@pytest.fixture(scope="module")
def confident_dir(tmp_path_factory, target_dir):
    """The target with a sharper lm_head: its greedy path is the best-scoring path of a draft tree, so
    as its own draft everything drafted along it must be accepted."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    path = tmp_path_factory.mktemp("confident")
    model.save_pretrained(path)
    make_tokenizer(path)
    return path
