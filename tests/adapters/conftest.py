"""Fixtures of the adapter tests."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls run fastest on one thread; more threads only spin against the other work
    on a small shared machine (about 30x slower here). Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
