"""Test-wide settings."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Tiny models spend their time in thread hand-offs, not math: one thread is ~5x faster on 2 busy cores.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
