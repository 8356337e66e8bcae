"""Fixtures for the graph-pass tests (helpers live in fxutil.py)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def blockwise_cpu(monkeypatch):
    """The op reads TRITON_INTERPRET at call time: 0 selects its fast
    blockwise PyTorch path for CPU tensors (the kernels are tested elsewhere)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()

