"""The optim tests use small matrices: one intra-op thread avoids OpenMP spin-waits on a shared CPU
(a 32x32 Newton–Schulz step is ~100x slower with 2 contended threads than with 1)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
